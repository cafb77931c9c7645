"""Write LAION-style Streaming (MDS) shards: `jpg` (the image file's bytes, never re-encoded) and `caption`.

    python convert.py photos/ out/mds                  # images with same-name .txt captions, any depth
    python convert.py laion/00000.tar laion/00001.tar out/mds   # img2dataset webdataset output
    python convert.py laion/ s3://bucket/laion/mds     # a folder of .tar shards, uploaded as written

S3-compatible servers: set S3_ENDPOINT_URL (and the usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
Samples the training loader would reject (not a decodable image, a decompression bomb, no caption) are
skipped, counted by reason, and the first ten named. A non-empty output is refused unless --overwrite is given.
A dataset appears only once it is whole and holds a sample: with none written (an empty folder, every file
skipped) or an error on the way, the output is left as it was and the exit status is 2.
Also builds the small generated dataset that benchmark.py trains on by default (`ensure_sample_dataset`).
"""

import contextlib
import io
import json
import os
import random
import re
import shutil
import sys
import tarfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps
from tqdm import tqdm

import arguments
from dataset_checks import s3_client
from images import BadSample, decode_image
from presets import SAMPLE_DATASET, SAMPLE_SIZE

COLUMNS = {'jpg': 'bytes', 'caption': 'str'}  # the LAION convention of the published benchmark
IMAGE_EXTENSIONS = ('jpg', 'jpeg', 'png', 'webp', 'bmp', 'gif', 'tif', 'tiff')
SKIPPED_NAMED = 10  # skipped samples named one by one; the rest are only counted
# A local output's shards and index until the conversion ends, inside the output folder (its file system, its disk).
STAGING = '.convert-partial'


class ConvertError(ValueError):
    """Bad input or output: reported as one line, exit status 2."""


class NothingWritten(ConvertError):
    """Every sample was skipped, or the inputs held none: the output was left as it was. `stats` names the skipped."""

    def __init__(self, out: str, stats: dict):
        skipped = sum(stats['skipped'].values())
        found = f'all {skipped} skipped ({describe_skipped(stats["skipped"])})' if skipped else 'the inputs hold none'
        super().__init__(f'{out}: no samples written, {found}; the output is left as it was')
        self.stats = stats


def describe_skipped(skipped: dict[str, int]) -> str:
    return ', '.join(f'{count} {reason}' for reason, count in sorted(skipped.items()))


# ------------------------------------------------------------------------------------------- inputs
# Each reader yields (name, image bytes or None, caption or None, reason to skip or None).


def folder_samples(folder: Path):
    images, repeats = image_files(folder)
    for path in repeats:
        yield str(path), None, None, 'linked folder already read (a loop or a second link)'
    for path in images:
        caption_file = path.with_suffix('.txt')
        if not path.is_file():
            yield str(path), None, None, 'broken link'
            continue
        if not caption_file.is_file():
            yield str(path), None, None, 'no caption file'
            continue
        try:
            yield str(path), path.read_bytes(), caption_file.read_bytes(), None
        except OSError as error:
            yield str(path), None, None, f'unreadable ({error.strerror})'


def image_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The image files under a folder in name order, linked folders followed; and the linked folders left out
    because they lead to a folder already read (a loop back up the tree, or a second link to one folder)."""
    images, repeats, seen = [], [], set()
    for root, folders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            repeats.append(Path(root))
            folders.clear()
            continue
        seen.add(real)
        images += [Path(root, name) for name in files if Path(name).suffix.lower().lstrip('.') in IMAGE_EXTENSIONS]
    return sorted(images), repeats


def tar_samples(path: Path):
    """webdataset tars (img2dataset): members {key}.jpg, {key}.txt, {key}.json, one sample's members in a row."""

    def sample(key, members):
        image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
        caption = members.get('txt')
        if caption is None and 'json' in members:
            try:
                caption = json.loads(members['json']).get('caption')
            except (ValueError, AttributeError):
                pass
        reason = 'no image member' if image is None else 'no caption' if caption is None else None
        return f'{path}:{key}', image, caption, reason

    key, members = None, {}
    try:
        with tarfile.open(path, 'r|*') as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, base = member.name.rpartition('/')
                stem, _, ext = base.partition('.')
                if f'{folder}/{stem}' != key:
                    if key is not None:
                        yield sample(key, members)
                    key, members = f'{folder}/{stem}', {}
                members[ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as error:  # the sample being read is lost with the rest
        yield str(path), None, None, f'unreadable tar ({type(error).__name__}), rest of the file skipped'
        return
    if key is not None:
        yield sample(key, members)


def expand_inputs(inputs: list[str]) -> list[tuple[str, Path]]:
    """Each input is a .tar file, a folder of .tar files, or a folder of images with .txt captions."""
    sources = []
    for name in inputs:
        path = Path(name)
        if path.is_file() and '.tar' in path.name:
            sources.append(('tar', path))
        elif path.is_dir() and sorted(path.glob('*.tar')):
            sources += [('tar', tar) for tar in sorted(path.glob('*.tar'))]
        elif path.is_dir():
            sources.append(('folder', path))
        else:
            raise ConvertError(f'{name}: not a .tar file or a folder')
    return sources


# ------------------------------------------------------------------------------------------- output


def check_output(out: str, overwrite: bool, inputs: list[str]) -> None:
    url = urllib.parse.urlparse(out)
    if url.scheme == 's3':
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = url.path.strip('/')
        try:
            listing = s3_client(timeout=30).list_objects_v2(
                Bucket=url.netloc, Prefix=prefix + '/' if prefix else '', MaxKeys=1
            )
        except ClientError as error:
            raise ConvertError(
                f'{out}: {error.response.get("Error", {}).get("Code")} from '
                f'{os.environ.get("S3_ENDPOINT_URL") or "AWS"} (does bucket {url.netloc!r} exist?)'
            )
        except BotoCoreError as error:
            raise ConvertError(f'{out}: cannot reach the S3 server: {error}')
        if listing.get('KeyCount', 0) and not overwrite:
            raise ConvertError(f'{out} is not empty; pass --overwrite to write over it')
    elif not url.scheme:
        path = Path(out).resolve()
        if path.exists() and not path.is_dir():
            raise ConvertError(f'{out}: is a file; give a folder (new, or with --overwrite an earlier output)')
        if any(Path(name).resolve().is_relative_to(path) for name in inputs):
            raise ConvertError(f'{out}: the output folder contains an input')
        if path.is_dir() and any(entry.name != STAGING for entry in path.iterdir()) and not overwrite:
            raise ConvertError(f'{out} is not empty; pass --overwrite to replace its contents')


def write_mds(
    samples, out: str, overwrite: bool = False, size_limit=1 << 26, total: int | None = None, progress: bool = True
) -> dict:
    """Write (name, image bytes, caption, reason) samples that pass the loader's own checks; count the rest by reason
    and name the first SKIPPED_NAMED of them.

    A later run must never read a half-made dataset as a whole one, so a dataset appears only at the end, and only
    with a sample in it: a local output is written into a staging folder inside it and moved into place then
    (replacing an earlier output's contents only at that point); a remote one gets its index.json only then. With no
    sample written (NothingWritten) or an error on the way, the output is left as it was."""
    from streaming import MDSWriter  # here, not at the top: Streaming loads torch, and --help answers without it

    remote = bool(urllib.parse.urlparse(out).scheme)
    if not remote:
        folder = Path(out)
        created = not folder.exists()
        staging = folder / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted conversion
        staging.mkdir(parents=True)
    writer = MDSWriter(out=out if remote else str(staging), columns=COLUMNS, size_limit=size_limit)
    # An earlier remote dataset's index would list the shards this one writes over: it goes before the first shard.
    before_first_sample = (lambda: drop_remote_index(out)) if remote and overwrite else None
    try:
        stats = write_samples(writer, samples, total, progress, before_first_sample)
        if not stats['written']:
            raise NothingWritten(out, stats)
    except BaseException:
        writer.executor.shutdown(wait=True)  # uploads of shards already written end; no index.json: no dataset
        shutil.rmtree(writer.local, ignore_errors=True)  # the staging folder, or a remote's temporary one
        if not remote and created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # made by this conversion, and empty again
        raise
    writer.finish()  # the last shard, then index.json (uploaded after every shard)
    if not remote:
        move_into_place(staging, folder)
    return {**stats, 'shards': len(writer.shards), 'out': out}


def write_samples(writer, samples, total: int | None, progress: bool, before_first_sample) -> dict:
    written, skipped, skipped_named = 0, Counter(), []
    for name, image, caption, reason in tqdm(samples, total=total, unit='img', disable=not progress, desc='converting'):
        if reason is None:
            reason = problem(image, caption)
        if reason is not None:
            skipped[reason] += 1
            if len(skipped_named) < SKIPPED_NAMED:
                skipped_named.append((name, reason))
            continue
        if isinstance(caption, bytes):
            caption = caption.decode('utf-8')
        if not written and before_first_sample is not None:
            before_first_sample()
        writer.write({'jpg': image, 'caption': caption.strip()})
        written += 1
    return {'written': written, 'skipped': dict(skipped), 'skipped_named': skipped_named}


def move_into_place(staging: Path, folder: Path) -> None:
    """The staged dataset becomes the folder's contents (replacing an earlier output's, with --overwrite). The old
    index.json goes first and the new one comes last, so the folder never holds an index of shards that are not
    there."""
    for path in sorted(folder.iterdir(), key=lambda path: path.name != 'index.json'):
        if path == staging:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in sorted(staging.iterdir(), key=lambda path: path.name == 'index.json'):
        path.rename(folder / path.name)
    staging.rmdir()


def drop_remote_index(out: str) -> None:
    url = urllib.parse.urlparse(out)
    if url.scheme == 's3':
        prefix = url.path.strip('/')
        s3_client(timeout=30).delete_object(Bucket=url.netloc, Key=f'{prefix}/index.json' if prefix else 'index.json')


def problem(image: bytes, caption) -> str | None:
    if isinstance(caption, bytes):
        try:
            caption = caption.decode('utf-8')
        except UnicodeDecodeError:
            return 'caption is not UTF-8'
    if not isinstance(caption, str):
        return 'caption is not text'
    try:
        decode_image(image, 64)  # JPEG draft mode makes this a 1/8-scale decode
    except BadSample as error:
        return error.kind
    return None


def convert(inputs: list[str], out: str, overwrite: bool = False, size_limit=1 << 26, progress: bool = True) -> dict:
    sources = expand_inputs(inputs)
    check_output(out, overwrite, inputs)
    total = None
    if all(kind == 'folder' for kind, _ in sources):
        total = sum(sum(map(len, image_files(folder))) for _, folder in sources)
        if not total:
            extensions = ', '.join(f'.{extension}' for extension in IMAGE_EXTENSIONS)
            raise ConvertError(
                f'{", ".join(inputs)}: no .tar files, and no image files ({extensions}) at any depth; nothing written'
            )

    def samples():
        for kind, path in sources:
            yield from (folder_samples if kind == 'folder' else tar_samples)(path)

    return write_mds(samples(), out, overwrite, size_limit, total, progress)


# ------------------------------------------------------------------------------- generated samples

COLORS = {
    'red': (215, 48, 39),
    'orange': (244, 140, 40),
    'yellow': (250, 215, 60),
    'green': (60, 160, 70),
    'blue': (50, 100, 200),
    'purple': (130, 70, 170),
    'white': (245, 245, 245),
    'black': (20, 20, 20),
    'gray': (128, 128, 128),
}
SHAPES = ('circle', 'square', 'triangle')
SIZES = ((512, 512), (640, 512), (512, 640), (768, 512), (576, 768))  # width x height, shorter side >= 512


def generated_sample(rng: random.Random) -> tuple[bytes, str]:
    """A JPEG of one to three colored shapes on a gradient, and a caption that describes it."""
    width, height = rng.choice(SIZES)
    background, shade = rng.sample(sorted(COLORS), 2)
    image = ImageOps.colorize(Image.linear_gradient('L').resize((width, height)), COLORS[background], COLORS[shade])
    draw = ImageDraw.Draw(image)
    parts = []
    for _ in range(rng.randint(1, 3)):
        color = rng.choice([c for c in COLORS if c not in (background, shade)])
        shape = rng.choice(SHAPES)
        r = rng.randint(40, min(width, height) // 4)
        x, y = rng.randint(r, width - r), rng.randint(r, height - r)
        if shape == 'circle':
            draw.ellipse((x - r, y - r, x + r, y + r), fill=COLORS[color])
        elif shape == 'square':
            draw.rectangle((x - r, y - r, x + r, y + r), fill=COLORS[color])
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLORS[color])
        parts.append(f'a {color} {shape}')
    buffer = io.BytesIO()
    image.save(buffer, 'JPEG', quality=90)
    return buffer.getvalue(), f'{" and ".join(parts)} on a {background} background'


def ensure_sample_dataset(
    path: Path = SAMPLE_DATASET, num_samples: int = SAMPLE_SIZE, seed: int = 0, broken: bool = True
) -> Path:
    """Build the generated dataset once (local rank 0; other ranks wait) and return its folder.

    Two samples are written as they come in real crawls, an empty download and an HTML error page, so a
    first run also exercises the bad-sample path; the loader replaces them and says so (unless broken=False).
    """
    path = Path(path)
    if (path / 'index.json').is_file():
        return path
    if int(os.environ.get('LOCAL_RANK', '0')) != 0:
        deadline = time.monotonic() + 600
        while not (path / 'index.json').is_file():
            if time.monotonic() > deadline:
                raise ConvertError(f'{path}: local rank 0 did not finish building the sample dataset')
            time.sleep(0.5)
        return path
    work = path.parent / f'.{path.name}-{os.getpid()}'
    rng = random.Random(seed)
    from streaming import MDSWriter

    with MDSWriter(out=str(work), columns=COLUMNS, exist_ok=True) as writer:
        for index in range(num_samples):
            image, caption = generated_sample(rng)
            if broken and index == num_samples // 3:
                image = b''
            elif broken and index == 2 * num_samples // 3:
                image = b'<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>'
            writer.write({'jpg': image, 'caption': caption})
    if path.exists():
        shutil.rmtree(path)  # a folder without index.json: left by an interrupted build
    try:
        work.rename(path)
    except OSError:  # another process (another node on a shared file system) finished first
        shutil.rmtree(work, ignore_errors=True)
    return path


# --------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = arguments.ArgumentParser(
        description='Convert images with captions to Streaming MDS shards '
        '(columns jpg: image bytes as they are, caption: text).'
    )
    parser.add_argument(
        'inputs',
        nargs='+',
        help='folders of images with same-name .txt captions, img2dataset .tar shards, or folders of .tar shards',
    )
    parser.add_argument('out', help='output folder, or a remote such as s3://bucket/laion/mds (uploaded as written)')
    parser.add_argument(
        '--overwrite', action='store_true', help='write into a non-empty output (a local one is emptied first)'
    )
    parser.add_argument(
        '--size_limit', default='64mb', help='shard size before a new shard starts (default: %(default)s)'
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r'\d+(kb|mb|gb|tb|b)?', args.size_limit.strip().lower()):
        raise ConvertError(f"--size_limit {args.size_limit!r}: a byte count, optionally with kb, mb, gb (e.g. '64mb')")
    start = time.perf_counter()
    try:
        stats = convert(args.inputs, args.out, args.overwrite, args.size_limit, progress=True)
    except NothingWritten as error:
        print_skipped(error.stats)
        raise
    print_skipped(stats)
    print(
        f'wrote {stats["written"]} samples in {stats["shards"]} shard(s) to {args.out} '
        f'in {time.perf_counter() - start:.1f} s; skipped {sum(stats["skipped"].values())}: '
        f'{describe_skipped(stats["skipped"]) or "none"}'
    )
    return stats


def print_skipped(stats: dict) -> None:
    """The first skipped samples by name, with their reasons, then how many more (the summary counts every reason)."""
    for name, reason in stats['skipped_named']:
        print(f'skipped {name}: {reason}', file=sys.stderr)
    more = sum(stats['skipped'].values()) - len(stats['skipped_named'])
    if more:
        print(f'... and {more} more skipped', file=sys.stderr)


if __name__ == '__main__':
    try:
        main()
    except ConvertError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
