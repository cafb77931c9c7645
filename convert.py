"""Write LAION-style Streaming (MDS) shards: `jpg` (the image file's bytes, never re-encoded) and `caption`.

    python convert.py photos/ out/mds                  # images with same-name .txt captions, any depth
    python convert.py my_images/ out/mds               # a Hugging Face image folder: metadata.jsonl or .csv captions
    python convert.py laion/00000.tar laion/00001.tar out/mds   # img2dataset webdataset output
    python convert.py laion/ s3://bucket/laion/mds     # a folder of .tar shards, uploaded as written
    python convert.py photos/ out/mds --validation_fraction 0.05   # 5% held out in out/mds/validation
    python convert.py hf_dataset/ out/mds              # Parquet (Hugging Face's or img2dataset's), train/ + validation/
    python convert.py laion/ out/mds --workers 32      # 32 processes, each writing a part; one merged index.json

S3-compatible servers: set S3_ENDPOINT_URL (and the usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
Samples the training loader would reject (not a decodable image, a decompression bomb, no caption) are
skipped, counted by reason, and the first ten named; a warning says so when they are more than half the inputs.
--caption_from_filename captions an image without a caption file by its file name. A non-empty output is refused
unless --overwrite is given. --validation_fraction holds a split out, chosen by a hash of each input's name: its
own MDS dataset in OUT/validation, which benchmark.py --local OUT --eval_interval finds.
A Hugging Face dataset's split folders or files (train/ and validation/ or test/) give the training set and
the validation split. With --workers N (default: every core this process may use) each worker converts its share
of the inputs into OUT/part-NNNNN and one index.json lists the parts' shards: the same samples, in the same order.
A dataset appears only once it is whole and holds a sample: with none written (an empty folder, every file
skipped) or an error on the way, the output is left as it was and the exit status is 2.
"""

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from datapath.caption_metadata import CaptionMetadataError, metadata_captions
from datapath.convert_workers import WorkerDied, run_workers
from datapath.parquet_samples import ParquetLayoutError, parquet_layout, parquet_samples, row_groups
from datapath.sample_checks import usable_sample
from guards import arguments
from guards.outputs import WriteFailed, free_space_fix, one_line, system_reason, write_failure
from guards.stopping import SIGNALS, Stopped, stop_on_signals
from guards.writer_lock import LOCK_FILE, FolderBusy, one_writer
from settings.dataset_checks import IMAGE_CAPTION_COLUMNS, SHARD_HASH, is_remote, s3_client

COLUMNS = IMAGE_CAPTION_COLUMNS  # the LAION convention of the published benchmark
IMAGE_EXTENSIONS = ('jpg', 'jpeg', 'png', 'webp', 'bmp', 'gif', 'tif', 'tiff')
SKIPPED_NAMED = 10  # skipped samples named one by one; the rest are only counted
# A local output's shards and index until the conversion ends, inside the output folder (its file system, its disk).
STAGING = '.convert-partial'
# --validation_fraction's held-out split: an MDS dataset of its own in this folder of the output (settings/datasets.py
# looks for it there when a run's --local is a converted folder).
VALIDATION_SPLIT = 'validation'
NO_CAPTION_FILE = 'no caption file'


class ConvertError(ValueError):
    """Bad input or output: reported as one line, exit status 2."""


class NothingWritten(ConvertError):
    """Every sample was skipped, or the inputs held none: the output was left as it was. `stats` names the skipped."""

    def __init__(self, out: str, stats: dict):
        skipped, held_out = sum(stats['skipped'].values()), stats.get('held_out', 0)
        found = f'all {skipped} skipped ({describe_skipped(stats["skipped"])})' if skipped else 'the inputs hold none'
        written = 'samples'
        if held_out:  # a split of a handful of images can fall all on one side
            written, found = 'training samples', f'all {held_out} held out for validation: lower --validation_fraction'
        super().__init__(f'{out}: no {written} written, {found}; the output is left as it was')
        self.stats = stats


def describe_skipped(skipped: dict[str, int]) -> str:
    return ', '.join(f'{count} {reason}' for reason, count in sorted(skipped.items()))


# ------------------------------------------------------------------------------------------- inputs
# Each reader yields (name, image bytes or None, caption or None, reason to skip or None). A reason is counted
# with the others alike; one that a sample's particulars explain better is a pair (reason, detail): counted as the
# reason, and named with the detail (the caption file looked for).


def folder_samples(images: list[Path], repeats: list[Path], caption_from_filename: bool, listed: dict[Path, str]):
    """Images of a folder (image_files). An image's caption: its same-name .txt file, else its row in a metadata
    file (`listed`, caption_metadata.py), else with caption_from_filename its file name."""
    for path in repeats:
        yield str(path), None, None, 'linked folder already read (a loop or a second link)'
    for path in images:
        caption_file = path.with_suffix('.txt')
        if not path.is_file():
            yield str(path), None, None, 'broken link'
            continue
        if not caption_file.is_file() and path not in listed and not caption_from_filename:
            yield str(path), None, None, (NO_CAPTION_FILE, caption_file.name)
            continue
        try:
            if caption_file.is_file():
                caption = caption_file.read_bytes()
            else:
                caption = listed[path] if path in listed else caption_from_name(path)
            yield str(path), path.read_bytes(), caption, None
        except OSError as error:
            yield str(path), None, None, f'unreadable ({error.strerror})'


def caption_from_name(path: Path) -> str:
    """'red_barn-at-dusk.jpg' -> 'red barn at dusk': file names join words with underscores and dashes."""
    return ' '.join(re.split(r'[\s_-]+', path.stem)).strip()


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


# Hugging Face's split folders (`train/`, `validation/`), or Parquet files named for their split
# (`data/train-00000-of-00004.parquet`): the training set, and the validation split, `validation` where there is
# one, else `test`.
TRAINING_SPLIT, HELD_OUT_SPLITS = 'train', ('validation', 'test')
FOLDER_SLICE = 256  # images of a folder shared out to one worker at a time


@dataclass
class Source:
    kind: str  # 'folder', 'tar' or 'parquet'
    path: Path
    base: Path  # samples are named relative to it for the held-out hash (split_name)
    split: str | None = None  # a Hugging Face split's name
    held_out: bool | None = None  # the whole source in the validation split, or out of it; None: by the hash


def expand_inputs(inputs: list[str]) -> list[Source]:
    """Each input is a .tar or .parquet file, a folder of .tar files, a folder of .parquet files at any depth, or a
    folder of images with their captions; a folder of Hugging Face split folders or split files gives its training
    set and its validation split."""
    sources = []
    for name in inputs:
        path = Path(name)
        if path.is_file() and '.tar' in path.name:
            sources.append(Source('tar', path, path.parent))
        elif path.is_file() and path.suffix == '.parquet':
            sources.append(Source('parquet', path, path.parent, split_of(Path(path.name))))
        elif path.is_dir() and sorted(path.glob('*.tar')):
            sources += [Source('tar', tar, path) for tar in sorted(path.glob('*.tar'))]
        elif path.is_dir() and (parquets := sorted(path.rglob('*.parquet'))):
            sources += [Source('parquet', file, path, split_of(file.relative_to(path))) for file in parquets]
        elif path.is_dir() and (path / TRAINING_SPLIT).is_dir() and any((path / s).is_dir() for s in HELD_OUT_SPLITS):
            splits = [split for split in (TRAINING_SPLIT, *HELD_OUT_SPLITS) if (path / split).is_dir()]
            sources += [Source('folder', path / split, path, split) for split in splits]
        elif path.is_dir():
            sources.append(Source('folder', path, path))
        elif not path.exists():
            raise ConvertError(f'{name}: no such file or folder')
        else:
            raise ConvertError(f'{name}: not a .tar or .parquet file, or a folder')
    return with_held_out_split(sources)


def split_of(relative: Path) -> str | None:
    """The Hugging Face split a file belongs to, by its folder (`validation/x.parquet`) or the start of its name
    (`validation-00000-of-00001.parquet`)."""
    for part in relative.parts[:-1]:
        if part in (TRAINING_SPLIT, *HELD_OUT_SPLITS):
            return part
    start = re.match(rf'({TRAINING_SPLIT}|{"|".join(HELD_OUT_SPLITS)})\b', relative.name)
    return start.group(1) if start else None


def with_held_out_split(sources: list[Source]) -> list[Source]:
    """Where the inputs hold a Hugging Face validation split (else a test split), it is the held-out split and the
    rest is the training set; a test split beside a validation split is not read."""
    held_out = next((split for split in HELD_OUT_SPLITS if any(source.split == split for source in sources)), None)
    if held_out is None:
        return sources
    kept = [source for source in sources if source.split not in HELD_OUT_SPLITS or source.split == held_out]
    for source in kept:
        source.held_out = source.split == held_out
    return kept


@dataclass
class Piece:
    """A part of a source that one worker converts: a slice of a folder's images, a tar, or a Parquet file's row
    groups. Its bytes weigh it when the pieces are shared out; its rows count it for the progress bar (None: not
    known before reading)."""

    source: Source
    bytes: int
    rows: int | None
    images: list[Path] = field(default_factory=list)
    repeats: list[Path] = field(default_factory=list)  # a folder's linked folders left out, named by its first slice
    groups: list = field(default_factory=list)


def pieces_of(sources: list[Source]) -> list[Piece]:
    pieces = []
    for source in sources:
        if source.kind == 'folder':
            images, repeats = image_files(source.path)
            for start in range(0, max(len(images), 1), FOLDER_SLICE):
                part = images[start : start + FOLDER_SLICE]
                pieces.append(Piece(source, sum(map(file_size, part)), len(part), part, [] if start else repeats))
        elif source.kind == 'tar':
            pieces.append(Piece(source, file_size(source.path), None))
        else:
            for group in row_groups(source.path):
                pieces.append(Piece(source, group[2], group[3], groups=[group]))
    return pieces


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # a broken link: named when read
        return 0


def shares_of(pieces: list[Piece], workers: int) -> list[list[Piece]]:
    """The pieces in order, cut into up to `workers` runs of about equal bytes: each worker's part of the merged
    dataset follows the one before, so the samples come in the order one process writes them."""
    total = sum(piece.bytes for piece in pieces) or 1
    shares, done = [[] for _ in range(workers)], 0
    for piece in pieces:
        shares[min(workers - 1, int((done + piece.bytes / 2) / total * workers))].append(piece)
        done += piece.bytes
    return [share for share in shares if share]


@dataclass
class Reading:
    """How pieces are read into samples: the same in every worker."""

    caption_from_filename: bool
    listed: dict  # a folder's captions from its metadata files
    layouts: dict  # a Parquet file's image and caption columns
    validation_fraction: float


def piece_samples(piece: Piece, reading: Reading):
    """(name, image, caption, reason to skip, held out) of each sample of a piece."""
    source = piece.source
    if source.kind == 'folder':
        listed = reading.listed[source.path]
        read = folder_samples(piece.images, piece.repeats, reading.caption_from_filename, listed)
    elif source.kind == 'tar':
        read = tar_samples(source.path)
    else:
        read = parquet_samples(source.path, piece.groups, *reading.layouts[source.path])
    for name, image, caption, reason in read:
        held_out = source.held_out
        if held_out is None:
            held_out = split_position(split_name(name, source.base)) < reading.validation_fraction
        yield name, image, caption, reason, held_out


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
        if path.is_dir() and any(entry.name not in (STAGING, LOCK_FILE) for entry in path.iterdir()) and not overwrite:
            raise ConvertError(f'{out} is not empty; pass --overwrite to replace its contents')


def write_mds(
    samples,
    out: str,
    overwrite: bool = False,
    size_limit=1 << 26,
    total: int | None = None,
    progress: bool = True,
    validation: bool = False,
) -> dict:
    """Write (name, image bytes, caption, reason, held out) samples that pass the loader's own checks, the held-out
    ones (with validation=True) to a dataset of their own in out/VALIDATION_SPLIT; count the rest by reason and name
    the first SKIPPED_NAMED of them. One process: the shards lie in `out` itself."""

    def write(target: str, before_first_sample) -> dict:
        split = f'{target.rstrip("/")}/{VALIDATION_SPLIT}'
        return write_part(samples, target, split, size_limit, total, progress, validation, before_first_sample)

    return staged(out, overwrite, write)


def staged(out: str, overwrite: bool, write) -> dict:
    """write(target, before_first_sample) writes the dataset into `target` and returns its counts.

    A later run must never read a half-made dataset as a whole one, so a dataset appears only at the end, and only
    with a sample in it: a local output is written into a staging folder inside it and moved into place then
    (replacing an earlier output's contents, an earlier split included, only at that point); a remote one gets its
    index.json only then. With no training sample written (NothingWritten) or an error on the way, the output is left
    as it was. A split that no sample fell into is not written."""
    remote = is_remote(out)
    if not remote:
        folder = Path(out)
        created = not folder.exists()
        staging = folder / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted conversion
        staging.mkdir(parents=True)
    # Absolute: Streaming reads a relative folder with a colon (`run:2`) as a URL of an unknown cloud.
    target = out if remote else str(staging.resolve())
    # An earlier remote dataset's index would list the shards this one writes over: it goes before the first shard,
    # with its split's (a stale split would overlap the new training samples).
    before_first_sample = (lambda: drop_remote_index(out)) if remote and overwrite else None
    try:
        stats = write(target, before_first_sample)
        if not stats['written']:
            raise NothingWritten(out, stats)
    except BaseException as error:
        if not remote:
            shutil.rmtree(staging, ignore_errors=True)
            if created:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # made by this conversion, and empty again
        failure = write_failure(error)
        if failure is None:
            raise
        # A full disk under the shards (or a remote's scratch folder): one line, exit status 1, nothing kept.
        left = 'no index.json written: no run reads the shards uploaded' if remote else 'the output is left as it was'
        raise WriteFailed(out, system_reason(failure), left, free_space_fix(failure, 'convert again')) from error
    if not remote:
        move_into_place(staging, folder)
    return {**stats, 'out': out}


def write_part(samples, target, split, size_limit, total, progress, validation, before_first_sample, whole=True):
    """The samples as an MDS dataset in `target` and the held-out ones in `split`: a one-process conversion's
    whole output, or (whole=False) one worker's part, kept whenever it holds a sample. Nothing is finished (no
    index.json) where a whole output holds no training sample."""
    from streaming import MDSWriter  # here, not at the top: Streaming loads torch, and --help answers without it

    writer = MDSWriter(out=target, columns=COLUMNS, size_limit=size_limit, hashes=[SHARD_HASH])
    # Made after the training writer, which wants its folder empty; on a remote, uploaded from its own scratch folder.
    validation_writer = (
        MDSWriter(out=split, columns=COLUMNS, size_limit=size_limit, hashes=[SHARD_HASH]) if validation else None
    )
    writers = (writer, validation_writer) if validation else (writer,)
    try:
        stats = write_samples(writer, validation_writer, samples, total, progress, before_first_sample)
        keep_split = stats['held_out'] and (stats['written'] or not whole)
        if validation:  # the split before the training index: a run finds the split once it finds the dataset
            validation_writer.finish() if keep_split else abandon(validation_writer)
        writer.finish() if stats['written'] else abandon(writer)  # the last shard, then index.json
    except BaseException:
        for each in writers:
            abandon(each)
        raise
    return {**stats, 'shards': len(writer.shards) if stats['written'] else 0}


def abandon(writer) -> None:
    """Uploads of shards already written end; no index.json: no dataset. The local folder (the staging folder's
    part, or a remote's scratch folder) is removed."""
    writer.executor.shutdown(wait=True)
    shutil.rmtree(writer.local, ignore_errors=True)


def write_in_workers(shares, reading: Reading, out, overwrite, size_limit, total, progress, validation) -> dict:
    """Each share of the pieces converted by a worker of its own into `part-NNNNN` of the output (and of its split),
    then one index over the parts, merged by Streaming's merge_index, in share order: the samples one process would
    write, in its order, in more shards."""

    def write(target: str, before_first_sample) -> dict:
        first_sample = once_across_workers(before_first_sample)

        def convert_share(index, share, counts):
            part = f'part-{index:05}'
            samples = counted(share, reading, counts, index)
            split = f'{target}/{VALIDATION_SPLIT}/{part}'
            return write_part(
                samples, f'{target}/{part}', split, size_limit, None, False, validation, first_sample, False
            )

        with tqdm(total=total, unit='img', disable=not progress, desc=f'converting ({len(shares)} workers)') as bar:
            parts = run_workers(convert_share, shares, lambda done: bar.update(done - bar.n))
        stats = merged_counts(parts)
        if stats['written']:
            if stats['held_out']:
                held_out = [index for index, part in enumerate(parts) if part['held_out']]
                merge_parts(f'{target}/{VALIDATION_SPLIT}', held_out)
            merge_parts(target, [index for index, part in enumerate(parts) if part['written']])
        return stats

    try:
        return staged(out, overwrite, write)
    except WorkerDied as error:
        left = f'{out} has no index.json of it' if is_remote(out) else f'{out} is left as it was'
        raise ConversionStopped(f'{error}: conversion stopped; {left}') from None


class ConversionStopped(RuntimeError):
    """A worker died (killed, out of memory): one line, exit status 1."""


def counted(share: list[Piece], reading: Reading, counts, index: int):
    """A share's samples, each counted in counts[index] as it is read (the main process's progress bar)."""
    for piece in share:
        for sample in piece_samples(piece, reading):
            yield sample
            counts[index] += 1


def once_across_workers(action):
    """`action` run once, by the first worker to call it (None stays None)."""
    if action is None:
        return None
    import multiprocessing

    context = multiprocessing.get_context('fork')
    lock, done = context.Lock(), context.Value('b', 0, lock=False)

    def run_once():
        with lock:
            if not done.value:
                action()
                done.value = 1

    return run_once


def merged_counts(parts: list[dict]) -> dict:
    """The workers' counts as one conversion's: the first SKIPPED_NAMED skipped in input order (the shares follow
    one another)."""
    skipped, named = Counter(), []
    for part in parts:
        skipped.update(part['skipped'])
        named += part['skipped_named']
    return {
        'written': sum(part['written'] for part in parts),
        'held_out': sum(part['held_out'] for part in parts),
        'skipped': dict(skipped),
        'skipped_named': named[:SKIPPED_NAMED],
        'shards': sum(part['shards'] for part in parts),
    }


def merge_parts(target: str, indexes: list[int]) -> None:
    """One index.json in `target` over its parts' (Streaming's merge_index; on a remote, downloaded, merged and
    uploaded). Parts that hold no sample wrote no index and are left out."""
    import logging

    from streaming.base.util import merge_index

    remote = is_remote(target)
    logging.disable(logging.WARNING)  # merge_index warns of its temporary folder, every time
    try:
        index_files = [f'{target}/part-{index:05}/index.json' for index in indexes]
        merge_index(index_files, target, keep_local=not remote)
    finally:
        logging.disable(logging.NOTSET)


def write_samples(writer, validation_writer, samples, total: int | None, progress: bool, before_first_sample) -> dict:
    written, held_out, skipped, skipped_named = 0, 0, Counter(), []
    for name, image, caption, reason, in_validation in tqdm(
        samples, total=total, unit='img', disable=not progress, desc='converting'
    ):
        if reason is None:
            sample = usable_sample(image, caption)
            reason = sample if isinstance(sample, str) else None
        if reason is not None:
            reason, detail = reason if isinstance(reason, tuple) else (reason, None)
            skipped[reason] += 1
            if len(skipped_named) < SKIPPED_NAMED:
                skipped_named.append((name, f'{reason} {detail}' if detail else reason))
            continue
        if not (written or held_out) and before_first_sample is not None:
            before_first_sample()
        if in_validation:
            validation_writer.write(sample)
            held_out += 1
        else:
            writer.write(sample)
            written += 1
    return {'written': written, 'held_out': held_out, 'skipped': dict(skipped), 'skipped_named': skipped_named}


def move_into_place(staging: Path, folder: Path) -> None:
    """The staged dataset becomes the folder's contents (replacing an earlier output's, with --overwrite). The old
    index.json goes first and the new one comes last, so the folder never holds an index of shards that are not
    there."""
    for path in sorted(folder.iterdir(), key=lambda path: path.name != 'index.json'):
        if path == staging or path.name == LOCK_FILE:  # the lock: this conversion's, held until it ends
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in sorted(staging.iterdir(), key=lambda path: path.name == 'index.json'):
        path.rename(folder / path.name)
    staging.rmdir()


def drop_remote_index(out: str) -> None:
    """The dataset's index.json and its held-out split's (deleting a missing key is no error on S3)."""
    url = urllib.parse.urlparse(out)
    if url.scheme == 's3':
        prefix = url.path.strip('/')
        client = s3_client(timeout=30)
        for index in ('index.json', f'{VALIDATION_SPLIT}/index.json'):
            client.delete_object(Bucket=url.netloc, Key=f'{prefix}/{index}' if prefix else index)


def convert(
    inputs: list[str],
    out: str,
    overwrite: bool = False,
    size_limit=1 << 26,
    progress: bool = True,
    validation_fraction: float = 0.0,
    caption_from_filename: bool = False,
    caption_column: str | None = None,
    workers: int = 1,
) -> dict:
    sources = expand_inputs(inputs)
    check_output(out, overwrite, inputs)
    if validation_fraction and any(source.held_out for source in sources):
        split = next(source for source in sources if source.held_out)
        raise ConvertError(
            f'--validation_fraction {validation_fraction}: the input has its own {split.split} split '
            f'({split.path}), which is the validation split; leave the flag out'
        )
    try:  # read whole before anything is written: a bad row is named at once
        listed = {
            source.path: metadata_captions(source.path, caption_column) for source in sources if source.kind == 'folder'
        }
    except CaptionMetadataError as error:
        raise ConvertError(str(error))
    reading = Reading(caption_from_filename, listed, parquet_layouts(sources, caption_column), validation_fraction)
    pieces = pieces_of(sources)
    if all(source.kind == 'folder' for source in sources) and not any(
        piece.images or piece.repeats for piece in pieces
    ):
        extensions = ', '.join(f'.{extension}' for extension in IMAGE_EXTENSIONS)
        raise ConvertError(
            f'{", ".join(inputs)}: no .tar files, and no image files ({extensions}) at any depth; nothing written'
        )
    rows = [piece.rows for piece in pieces]
    total = None if None in rows else sum(rows)
    validation = validation_fraction > 0 or any(source.held_out for source in sources)
    shares = shares_of(pieces, workers)
    if len(shares) > 1:
        import streaming  # noqa: F401  imported once here, before the workers fork: none imports it again

        return write_in_workers(shares, reading, out, overwrite, size_limit, total, progress, validation)
    samples = (sample for piece in pieces for sample in piece_samples(piece, reading))
    return write_mds(samples, out, overwrite, size_limit, total, progress, validation=validation)


def parquet_layouts(sources: list[Source], caption_column: str | None) -> dict[Path, tuple[str, str]]:
    """Each Parquet file's image and caption columns, from its schema, before anything is written."""
    parquets = [source.path for source in sources if source.kind == 'parquet']
    if not parquets:
        return {}
    layouts = {}
    for path in parquets:
        try:
            layouts[path] = parquet_layout(path, caption_column)
        except ImportError:
            raise ConvertError(f'{path}: Parquet input needs pyarrow (pip install -r requirements-data.txt)')
        except ParquetLayoutError as error:
            raise ConvertError(str(error))
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid, a ValueError, for a file that is not Parquet
            raise ConvertError(f'{path}: not a Parquet file pyarrow can read ({one_line(error)})')
    return layouts


def split_name(name: str, base: Path) -> str:
    """A sample's name from its input folder ('sub/a.jpg'; a tar's member '00000.tar:000123'): the same wherever the
    input lies, so that converting it again, from anywhere, holds out the same samples."""
    return Path(os.path.relpath(name, base)).as_posix()


def split_position(name: str) -> float:
    """Where a sample falls in [0, 1), by a hash of its name: those below --validation_fraction are held out. A hash,
    not a random draw, so that a conversion repeated holds out the same samples and a larger fraction only adds to
    them."""
    return int.from_bytes(hashlib.sha256(os.fsencode(name)).digest()[:8], 'big') / 2**64


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each value checked; ConvertError names a bad one."""
    parser = arguments.ArgumentParser(
        description='Convert images with captions to Streaming MDS shards '
        '(columns jpg: image bytes as they are, caption: text).'
    )
    parser.add_argument(
        'inputs',
        nargs='+',
        help='folders of images with same-name .txt captions (or a metadata.jsonl / metadata.csv of file_name and '
        'caption, as Hugging Face image folders keep them), img2dataset .tar shards, or folders of .tar shards, '
        '.parquet files or folders of them',
    )
    parser.add_argument('out', help='output folder, or a remote such as s3://bucket/laion/mds (uploaded as written)')
    parser.add_argument(
        '--overwrite', action='store_true', help='write into a non-empty output (a local one is emptied first)'
    )
    parser.add_argument(
        '--size_limit', default='64mb', help='shard size before a new shard starts (default: %(default)s)'
    )
    parser.add_argument(
        '--validation_fraction',
        type=float,
        default=0.0,
        metavar='F',
        help=f'hold out this fraction of the images (0 <= F < 1) as a validation split in OUT/{VALIDATION_SPLIT}, '
        "chosen by a hash of each file's name, so converting again holds out the same ones (default: none)",
    )
    parser.add_argument(
        '--caption_from_filename',
        action='store_true',
        help="caption an image that has no .txt caption file by its file name ('red_barn-at-dusk.jpg': "
        "'red barn at dusk'); for folders of images",
    )
    parser.add_argument(
        '--caption_column',
        metavar='NAME',
        help='the caption column of metadata.jsonl / metadata.csv and Parquet files (default: the first of text, '
        'caption, prompt)',
    )
    parser.add_argument(
        '--workers',
        type=int,
        default=len(os.sched_getaffinity(0)),
        metavar='N',
        help='processes converting at once, each its share of the inputs into its own part of the output (default: '
        'the %(default)s cores this process may use); 1 writes the shards into OUT itself',
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise ConvertError(f'--workers {args.workers}: the number of processes converting at once, at least 1')
    if not re.fullmatch(r'\d+(kb|mb|gb|tb|b)?', args.size_limit.strip().lower()):
        raise ConvertError(f"--size_limit {args.size_limit!r}: a byte count, optionally with kb, mb, gb (e.g. '64mb')")
    if not 0 <= args.validation_fraction < 1:  # NaN too
        raise ConvertError(
            f'--validation_fraction {args.validation_fraction}: the fraction of images held out, '
            'at least 0 and below 1 (e.g. 0.05)'
        )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        with stop_on_signals(lambda signum: stopped_line(signum, args.out)), output_lock(args.out):
            stats = convert(
                args.inputs,
                args.out,
                args.overwrite,
                args.size_limit,
                progress=True,
                validation_fraction=args.validation_fraction,
                caption_from_filename=args.caption_from_filename,
                caption_column=args.caption_column,
                workers=args.workers,
            )
    except NothingWritten as error:
        print_skipped(error.stats)
        raise
    print_skipped(stats)
    warn_if_mostly_skipped(stats)
    print(
        f'{describe_written(stats, args.validation_fraction)} in {time.perf_counter() - start:.1f} s; '
        f'skipped {sum(stats["skipped"].values())}: {describe_skipped(stats["skipped"]) or "none"}'
    )
    return stats


def output_lock(out: str):
    """A second conversion into a local output folder is refused in one line before it reads an input
    (writer_lock.py); a remote output is not locked."""
    if is_remote(out):
        return contextlib.nullcontext()
    return one_writer(out, out, 'wait for it to end or stop it, or give another output folder')


def stopped_line(signum: int, out: str) -> str:
    """Ctrl-C or SIGTERM: write_mds removed what this conversion had staged (or, on S3, never wrote the index)."""
    if is_remote(out):
        return (
            f'{SIGNALS[signum]}: conversion stopped; {out} has no index.json of it, so no run reads the shards it '
            'uploaded: convert again with --overwrite'
        )
    return f'{SIGNALS[signum]}: conversion stopped; {out} is left as it was (nothing of this conversion kept)'


def describe_written(stats: dict, validation_fraction: float) -> str:
    """The summary's count of samples, and where the held-out split is when one was asked for."""
    out = stats['out']
    if not validation_fraction:
        return f'wrote {stats["written"]} samples in {stats["shards"]} shard(s) to {out}'
    split = f'{out.rstrip("/")}/{VALIDATION_SPLIT}'
    held_out = (
        f'{stats["held_out"]} held out for validation in {split}{share_held_out(stats, validation_fraction)}'
        if stats['held_out']
        else f'none held out for validation (too few images for --validation_fraction {validation_fraction})'
    )
    return f'wrote {stats["written"]} training samples in {stats["shards"]} shard(s) to {out}, {held_out},'


def share_held_out(stats: dict, validation_fraction: float) -> str:
    """The share held out, where it is far from the fraction asked for: each image is held out by a hash of its
    name, so a few hundred images hold out about that fraction, a few dozen only roughly."""
    held_out, total = stats['held_out'], stats['held_out'] + stats['written']
    expected = validation_fraction * total
    if abs(held_out - expected) <= max(1, 0.25 * expected):
        return ''
    return (
        f' ({held_out / total:.0%} of {total}, where --validation_fraction {validation_fraction} asked for about '
        f'{expected:.0f}: images are held out by a hash of their names, which only a large folder splits evenly)'
    )


def warn_if_mostly_skipped(stats: dict) -> None:
    """A conversion that drops most of its inputs still ends with status 0, but not silently: the usual cause, a
    folder without caption files, gets its fix named."""
    skipped = sum(stats['skipped'].values())
    kept = stats['written'] + stats['held_out']
    if skipped <= kept:
        return
    fix = ''
    if max(stats['skipped'], key=stats['skipped'].get) == NO_CAPTION_FILE:
        fix = (
            "; each image needs a caption file of its name ('a.jpg': 'a.txt') or a row in a metadata.jsonl or "
            'metadata.csv, or pass --caption_from_filename'
        )
    print(
        f'warning: {skipped} of {skipped + kept} inputs skipped, more than half '
        f'({describe_skipped(stats["skipped"])}){fix}',
        file=sys.stderr,
    )


def print_skipped(stats: dict) -> None:
    """The first skipped samples by name, with their reasons, then how many more (the summary counts every reason)."""
    for name, reason in stats['skipped_named']:
        # A name that is not valid UTF-8 holds the bytes Python could not decode (as surrogates, which a strict
        # stream refuses to write): shown as \xNN escapes instead.
        line = f'skipped {name}: {reason}'.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')
        print(line, file=sys.stderr)
    more = sum(stats['skipped'].values()) - len(stats['skipped_named'])
    if more:
        print(f'... and {more} more skipped', file=sys.stderr)


if __name__ == '__main__':
    try:
        main()
    except (ConvertError, FolderBusy) as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
    except (OSError, ConversionStopped) as error:  # a failed write (a full disk), a killed worker: nothing kept
        print(f'error: {one_line(error)}', file=sys.stderr)
        sys.exit(1)
    except Stopped as stopped:
        print(f'error: {stopped}', file=sys.stderr)
        sys.exit(stopped.exit_status)
