"""A dataset's index.json as untrusted input. A remote dataset's index is someone else's file, and Streaming joins
the names it lists to the cache folder and writes what it downloads there: a shard named `../x` was written beside
the cache, and a deeper name wherever the process may write. Every reader of an index (the training and validation
datasets, the dataset checks, precompute.py, generate.py's FID reference) takes its shards from `index_shards` or
`read_index`, which refuse, in one line naming the dataset and the name, before anything is downloaded or read:

- a file name that is absolute, holds a `..` part, a backslash or a NUL, or leads outside the dataset's folder by a
  link;
- the fields a hostile index could use to exhaust memory or disk before a shard's hash is checked: an index file
  over dataset_checks.MAX_INDEX_BYTES (checked before it is downloaded where it can be), a shard over
  MAX_SHARD_BYTES (an MDS shard's offsets are 32-bit: no real one is larger), more samples than its bytes can hold,
  more than MAX_COLUMNS columns, more than MAX_SAMPLES samples in all.
"""

import json
import os
from pathlib import Path, PurePosixPath

from settings.dataset_checks import DataError, index_size_within_bound

MAX_SHARD_BYTES = 1 << 32
MAX_COLUMNS = 256
MAX_SAMPLES = 1 << 34  # LAION-5B holds 5.85 billion
# An MDS shard holds its sample count and one 32-bit offset per sample and one more before its samples' bytes.
MDS_HEADER_BYTES_PER_SAMPLE = 4
# The file names a shard's entry may list: the shard, its compressed form, and other formats' metadata files.
FILE_KEYS = ('raw_data', 'zip_data', 'raw_meta', 'zip_meta')


def unsafe_name(name: object) -> str | None:
    """Why a file name listed in an index would lead outside the dataset's folder, or None where it cannot. Names
    may hold folders (`part-00000/shard.00000.mds`: Streaming's merged indexes)."""
    if not isinstance(name, str) or not name.strip('/'):
        return 'is not a file name'
    if '\0' in name:
        return 'holds a NUL'
    if '\\' in name:
        return 'holds a backslash'
    if PurePosixPath(name).is_absolute():
        return 'is absolute'
    if '..' in PurePosixPath(name).parts:
        return "holds a '..' part"
    return None


def outside_by_link(folder: str, name: str) -> bool:
    """Whether `folder/name` resolves outside `folder`: a link in the folder, or a linked subfolder, leading out.
    A file not there yet resolves through the folders that are."""
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(os.path.join(root, name))]) != root


def whole_number(value: object, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def index_shards(location: str, index: object, folders: tuple[str, ...] = ()) -> list[dict]:
    """The shards an index lists, each checked (see the module's text); `folders`: the local folders its names are
    joined to (the dataset read in place, a cache, a remote that is a folder), checked for links leading out."""

    def refuse(what: str) -> DataError:
        return DataError(f'{location}: index.json {what}: refused (a broken index, or a hostile one)')

    shards = index.get('shards') if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise DataError(f'{location}: index.json is not a Streaming index (no list of shards)')
    total = 0
    for number, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get('raw_data'), dict):
            raise refuse(f'lists shard {number} without its file (raw_data)')
        for key in FILE_KEYS:
            info = shard.get(key)
            if info is None:
                continue
            name = info.get('basename') if isinstance(info, dict) else None
            if (reason := unsafe_name(name)) is not None:
                raise refuse(f'names a file {name!r} ({key} of shard {number}), which {reason}')
            for folder in folders:
                if outside_by_link(folder, name):
                    raise refuse(f'names a file {name!r} that a link in {folder} leads outside it')
            if not whole_number(info.get('bytes'), MAX_SHARD_BYTES):
                raise refuse(
                    f'says file {name} holds {info.get("bytes")!r} bytes, not a whole number up to '
                    f'{MAX_SHARD_BYTES:,} (an MDS shard cannot be larger)'
                )
        raw = shard['raw_data']
        samples = shard.get('samples')
        most = raw['bytes'] // MDS_HEADER_BYTES_PER_SAMPLE if shard.get('format') == 'mds' else raw['bytes']
        if not whole_number(samples, most):
            raise refuse(
                f'says shard {raw["basename"]} of {raw["bytes"]:,} bytes holds {samples!r} samples, not a whole '
                f'number up to {most:,}'
            )
        columns = [shard.get(key) for key in ('column_names', 'column_encodings', 'column_sizes')]
        lengths = {len(listed) if isinstance(listed, list) else None for listed in columns if listed is not None}
        if None in lengths or len(lengths) > 1 or max(lengths, default=0) > MAX_COLUMNS:
            raise refuse(
                f'lists columns of shard {raw["basename"]} that are not lists of one length up to {MAX_COLUMNS}'
            )
        total += samples
    if total > MAX_SAMPLES:
        raise refuse(f'counts {total:,} samples in all, more than {MAX_SAMPLES:,}')
    return shards


def read_index(location: str, folder: str, folders: tuple[str, ...] | None = None) -> list[dict]:
    """The checked shards of the index.json in `folder` (see index_shards; `folders` defaults to that one)."""
    path = Path(folder) / 'index.json'
    index_size_within_bound(location, path.stat().st_size)
    try:
        index = json.loads(path.read_bytes())
    except ValueError as error:
        raise DataError(f'{location}: index.json is not a Streaming index ({type(error).__name__}: {error})')
    return index_shards(location, index, (folder,) if folders is None else folders)
