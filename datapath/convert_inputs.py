"""convert.py's inputs as samples: image folders (captions from .txt files, metadata files or file names),
img2dataset's webdataset tars, Parquet files (parquet_samples.py), and Hugging Face's split folders; cut into pieces
that workers share out (convert_workers.py), each read into (name, image bytes, caption, reason to skip, held out).

Each reader yields (name, image bytes or None, caption or None, reason to skip or None). A reason is counted with
the others alike; one that a sample's particulars explain better is a pair (reason, detail): counted as the reason,
and named with the detail (the caption file looked for).
"""

import hashlib
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from datapath.parquet_samples import ParquetLayoutError, parquet_layout, parquet_samples, row_groups
from guards.outputs import one_line

IMAGE_EXTENSIONS = ('jpg', 'jpeg', 'png', 'webp', 'bmp', 'gif', 'tif', 'tiff')
NO_CAPTION_FILE = 'no caption file'


class ConvertError(ValueError):
    """Bad input or output: reported as one line, exit status 2."""


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


def tar_samples(path, content: bytes | None = None):
    """webdataset tars (img2dataset): members {key}.jpg, {key}.txt, {key}.json, one sample's members in a row; a
    sample is named `{path}:{key}` ('00000.tar:000123'). Read from `path`, or from its `content` already read (the
    Spark route's executors)."""

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
        opened = tarfile.open(path, 'r|*') if content is None else tarfile.open(fileobj=io.BytesIO(content), mode='r|*')
        with opened as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, base = member.name.rpartition('/')
                stem, _, ext = base.partition('.')
                member_key = f'{folder}/{stem}' if folder else stem
                if member_key != key:
                    if key is not None:
                        yield sample(key, members)
                    key, members = member_key, {}
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
FOLDER_SLICE = 64  # images of a folder in one piece: small enough that N workers get about equal shares


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
