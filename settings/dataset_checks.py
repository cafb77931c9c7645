"""Where a dataset is, and whether it can be trained on, checked before a run builds anything: the S3 client with
bounded retries, the index (a missing folder, bucket or prefix, a server that is down; its names and sizes, as
untrusted input), the shards of a local
dataset (missing, cut short, rewritten), the columns a dataset must hold, and `describe_dataset`, what a run must
know of a dataset beforehand. Each problem is a DataError naming the dataset, not a failure deep inside Streaming.
"""

import hashlib
import json
import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# Remote reads (index, shards): a connection must open within 10 s and each read return data within 20 s, with
# 2 retries after backoff (botocore's standard mode; Streaming's download_retry): a server that is down or
# hung is reported in about a minute, not after minutes of silence. S3_READ_TIMEOUT_SECONDS sets the read timeout
# (a slow link; the tests' hung servers).
CONNECT_TIMEOUT, RETRIES, READ_TIMEOUT = 10, 2, 20.0


def read_timeout() -> float:
    """The read timeout in force: S3_READ_TIMEOUT_SECONDS where set, else READ_TIMEOUT. Read when a reader is made,
    not when this module is imported, so that the process's environment at that moment decides."""
    return float(os.environ.get('S3_READ_TIMEOUT_SECONDS') or READ_TIMEOUT)


# convert.py's output, and the sample dataset's: the image file's bytes and its caption (LAION's convention).
# The hash every shard's bytes are written with (MDSWriter's hashes), and checked against as a run reads them:
# xxh64, several times faster than SHA-1 on one core (docs/data.md has its cost).
SHARD_HASH = 'xxh64'
IMAGE_CAPTION_COLUMNS = {'jpg': 'bytes', 'caption': 'str'}
# precompute.py's output: the VAE's latent distribution and the text encoder's output, fp16, and the caption;
# for SDXL also the pooled text embedding and the size/crop conditioning.
PRECOMPUTED_COLUMNS = {
    'latent_mean': 'ndarray:float16',
    'latent_logvar': 'ndarray:float16',
    'text_embedding': 'ndarray:float16',
    'caption': 'str',
}
SDXL_PRECOMPUTED_COLUMNS = {'pooled_text_embedding': 'ndarray:float16', 'time_ids': 'ndarray:float32'}
# The diffusion transformers': Flux's and SD3's pooled embedding, PixArt's mask of T5's padding.
TRANSFORMER_PRECOMPUTED_COLUMNS = {'pooled_text_embedding': 'ndarray:float16', 'text_mask': 'ndarray:uint8'}


class DataError(RuntimeError):
    """The data cannot be trained on: an unreachable or missing dataset, or one that is mostly bad samples."""


def is_remote(location: str) -> bool:
    """A URL (s3://, gs://, ...) rather than a local folder. By its `://`, not by urlparse's scheme, which a
    relative folder such as `run:2` or `a:b` also has."""
    return '://' in location


def s3_client(timeout: float | None = None, attempts: int = RETRIES + 1, unsigned: bool = False):
    """boto3 S3 client at S3_ENDPOINT_URL (any S3-compatible server) or AWS, with bounded retries; `timeout`: the
    read timeout in force by default."""
    timeout = read_timeout() if timeout is None else timeout
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        connect_timeout=min(timeout, CONNECT_TIMEOUT),
        read_timeout=timeout,
        retries={'mode': 'standard', 'total_max_attempts': attempts},
        signature_version=UNSIGNED if unsigned else None,
    )
    return boto3.session.Session().client('s3', endpoint_url=os.environ.get('S3_ENDPOINT_URL') or None, config=config)


def s3_folder(url: str) -> tuple[str, str]:
    """An s3:// folder's bucket, and the prefix of its objects' keys ('' at the bucket's top, else ending in '/')."""
    parsed = urllib.parse.urlparse(url)
    prefix = parsed.path.strip('/')
    return parsed.netloc, f'{prefix}/' if prefix else ''


def s3_folder_names(url: str) -> list[str] | None:
    """The names of the objects in an s3:// folder, its subfolders' with their paths (every page of the listing);
    None where it cannot be listed (no credentials, no such bucket, no server)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = s3_folder(url)
    try:
        pages = s3_client().get_paginator('list_objects_v2').paginate(Bucket=bucket, Prefix=prefix)
        return [item['Key'].removeprefix(prefix) for page in pages for item in page.get('Contents', [])]
    except (BotoCoreError, ClientError):
        return None


def check_columns(
    location: str, shard: str, columns: list[str] | None, precomputed: bool, encodings: list[str] | None = None
) -> None:
    """A shard (MDS: it names its columns) holds what the dataset reads: images and captions as convert.py
    writes them, or the latents and embeddings precompute.py writes. No column of pickles: Streaming decodes every
    column of a sample it reads, and unpickling runs whatever code the bytes name."""
    if columns is None:
        return
    pickled = [column for column, encoding in zip(columns, encodings or []) if encoding == 'pkl']
    if pickled:
        raise DataError(
            f"{location}: shard {shard} stores column {pickled[0]!r} as pickles ('pkl'), which reading would run as "
            'code; refused: write it as bytes, str, json or ndarray (convert.py and precompute.py do)'
        )
    if precomputed and not set(PRECOMPUTED_COLUMNS) - {'caption'} <= set(columns):
        raise DataError(
            f"{location}: shard {shard} has columns {columns}, not precompute.py's latent_mean, "
            'latent_logvar and text_embedding: for images and captions leave out --precomputed_latents'
        )
    if not precomputed and not {'jpg', 'caption'} <= set(columns):
        raise DataError(
            f'{location}: shard {shard} has columns {columns}; expected jpg (image bytes) and caption '
            '(text), as convert.py writes'
        )


def check_dataset(remote: str | None, local: str | None, retries: int = RETRIES, timeout: float | None = None) -> None:
    """Fail fast with a message naming the dataset when its index.json cannot be read: a missing folder,
    bucket or prefix, or a server that is down (after `retries` retries), rather than deep inside Streaming."""
    if remote is None or not is_remote(remote):
        folder = local if remote is None else remote
        if not (Path(folder) / 'index.json').is_file():
            raise DataError(
                f'no Streaming dataset at {folder}: {folder}/index.json is missing (write one with convert.py)'
            )
        index_size_within_bound(folder, (Path(folder) / 'index.json').stat().st_size)
        return
    url = urllib.parse.urlparse(remote)
    if url.scheme != 's3':
        return  # other Streaming remotes (gs://, oci://, hf://, ...) are checked by Streaming itself
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, key = url.netloc, '/'.join(part for part in (url.path.strip('/'), 'index.json') if part)
    endpoint = os.environ.get('S3_ENDPOINT_URL') or 'AWS'
    unsigned_note = ''  # said with every error once the bucket is read unsigned for want of credentials
    for unsigned in (False, True):
        client = s3_client(timeout, retries + 1, unsigned)
        try:
            index_size_within_bound(remote, client.head_object(Bucket=bucket, Key=key)['ContentLength'])
            return
        except NoCredentialsError:
            unsigned_note = NO_CREDENTIALS
            continue  # a public bucket: Streaming also falls back to unsigned requests
        except ClientError as error:
            code = error.response.get('Error', {}).get('Code', '')
            if code in ('404', 'NoSuchKey', 'NotFound'):
                try:
                    client.head_bucket(Bucket=bucket)
                except ClientError:
                    raise DataError(f'{remote}: bucket {bucket!r} does not exist on {endpoint}{unsigned_note}')
                raise DataError(
                    f'{remote}: no index.json under this prefix on {endpoint} (wrong prefix? '
                    f'write shards with convert.py){unsigned_note}'
                )
            fix = unsigned_note or ': check the credentials'
            raise DataError(f'{remote}: {endpoint} refused access ({code}){fix}')
        except BotoCoreError as error:
            raise DataError(
                f'{remote}: cannot reach the S3 server {endpoint} after {retries + 1} attempts: {error}{unsigned_note}'
            )


NO_CREDENTIALS = (
    '; no AWS credentials were found, so it was read unsigned, as a public bucket is: for a private one set '
    'AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (~/.aws/credentials)'
)


# ------------------------------------------------------------------------------------- the index, untrusted
# A remote dataset's index.json is someone else's file, and Streaming joins the names it lists to the cache folder
# and writes what it downloads there: a shard named `../x` was written beside the cache, and a deeper name wherever
# the process may write. Every reader of an index (the training and validation datasets, the checks here,
# Streaming's own dataset, precompute.py's merge, generate.py's FID reference) takes its shards from
# `index_shards` or `read_index`, which refuse, in one line naming the dataset and the name, before anything is
# downloaded or read: a file name that is absolute, holds a `..` part, a backslash or a NUL, or leads outside the
# dataset's folder by a link; and the fields a hostile index could use to exhaust memory or disk before a shard's
# hash is checked (the bounds below).

# A larger index.json is refused before it is downloaded or parsed: about two million shards' entries, where
# LAION-5B in 64 MB shards lists under one million.
MAX_INDEX_BYTES = 1 << 30


def index_size_within_bound(location: str, size: int) -> None:
    if size > MAX_INDEX_BYTES:
        raise DataError(
            f'{location}: index.json is {size:,} bytes, more than {MAX_INDEX_BYTES:,}: refused (a broken index, or '
            'a hostile one)'
        )


MAX_SHARD_BYTES = 1 << 32  # an MDS shard's offsets are 32-bit: no real shard is larger
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


def shard_hash_mismatch(location: str, path: Path, expected: dict) -> DataError | None:
    """The error naming a shard whose bytes differ from the hash index.json records (SHARD_HASH), None where they
    match or no hash was recorded (a dataset written before hashes were)."""
    from streaming.base.hashing import get_hash

    if SHARD_HASH not in (expected or {}):
        return None
    if get_hash(SHARD_HASH, path.read_bytes()) == expected[SHARD_HASH]:
        return None
    return DataError(
        f'{location}: shard {path.name} does not match the {SHARD_HASH} hash index.json records (damaged on disk or '
        'in transfer): it cannot be trusted; restore it, or convert the dataset again'
    )


def check_local_shards(location: str, folder: Path, shards: list[dict]) -> None:
    """Each shard of a local dataset is there, whole, and holds the samples index.json counts (an MDS shard's
    header says how many), so that a damaged dataset stops the run at start, naming the shard, instead of
    failing deep in a loader worker or training on a part of it."""
    for shard in shards:
        name, size = shard['raw_data']['basename'], shard['raw_data'].get('bytes')
        path = folder / name
        if not path.is_file():
            packed = (shard.get('zip_data') or {}).get('basename')
            if packed and (folder / packed).is_file():
                continue  # compressed: Streaming decompresses it as the run reads it
            raise DataError(f'{location}: shard {name} is missing (index.json lists it)')
        if size is not None and path.stat().st_size != size:
            raise DataError(
                f'{location}: shard {name} has {path.stat().st_size} bytes where index.json says {size} '
                '(truncated or rewritten?)'
            )
        if shard.get('format') == 'mds':
            with open(path, 'rb') as file:
                held = int.from_bytes(file.read(4), 'little')  # an MDS shard starts with its sample count
            if held != shard['samples']:
                raise DataError(
                    f'{location}: shard {name} holds {held} samples where index.json says {shard["samples"]}'
                )


@dataclass(frozen=True)
class DatasetDescription:
    """What a run must know of a dataset before it is built (see describe_dataset)."""

    location: str
    num_samples: int
    latent_shape: tuple[int, int, int] | None = None  # precomputed latents: (C, H/8, W/8) of the first sample
    embedding_width: int | None = None  # precomputed latents: the text embedding's width
    embedding_length: int | None = None  # precomputed latents: the text embedding's tokens
    pooled_width: int | None = None  # precomputed latents for SDXL: the pooled text embedding's width
    # Its samples and a digest of its index.json (shards, their sizes and sample counts): what a checkpoint of a
    # run on it records, so that a resumption onto data converted again or replaced is found (checkpoints.py).
    identity: str | None = None


def describe_dataset(
    remote: str | None,
    local: str | None,
    precomputed: bool = False,
    retries: int = RETRIES,
    timeout: float | None = None,
) -> DatasetDescription:
    """The size of an MDS dataset, read from its index.json, its columns checked; for precomputed latents also
    the shapes of the first sample (its shard is read into a temporary folder when the dataset is remote)."""
    if remote is not None and not is_remote(remote) and local is None:
        remote, local = None, remote  # a bare folder is read in place
    timeout = read_timeout() if timeout is None else timeout
    check_dataset(remote, local, retries=retries, timeout=timeout)
    # Streaming (which loads torch) only from here on, so that config.py checks the flags before either loads.
    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json
    from streaming.base.storage.download import CloudDownloader

    location = remote or local
    with tempfile.TemporaryDirectory(prefix='sd2-describe-') as work:
        folder = local if remote is None else work

        def fetch(basename: str) -> None:
            if remote is not None:
                CloudDownloader.direct_download(f'{remote.rstrip("/")}/{basename}', f'{work}/{basename}', timeout)

        fetch('index.json')
        # The folders its names are joined to: the dataset's, or a remote's copy here, its cache and a remote folder.
        joined_to = (local,) if remote is None else tuple(f for f in (work, local, remote) if f and not is_remote(f))
        shards = read_index(location, folder, joined_to)
        names = [shard['raw_data']['basename'] for shard in shards]
        num_samples = sum(shard['samples'] for shard in shards)
        for name, shard in zip(names, shards):
            check_columns(location, name, shard.get('column_names'), precomputed, shard.get('column_encodings'))
        if remote is None:  # a cache folder of a remote fills as it downloads: Streaming checks what it fetches
            check_local_shards(location, Path(local), shards)
        identity = dataset_identity(shards, num_samples)
        if not precomputed or num_samples == 0:
            return DatasetDescription(location, num_samples, identity=identity)
        shard = next(shard for shard in shards if shard['samples'])
        raw, packed = shard['raw_data']['basename'], (shard.get('zip_data') or {}).get('basename')
        if not (Path(folder) / raw).is_file():
            fetch(packed if packed and remote is not None else raw)
            if packed:  # Streaming keeps compressed shards in the remote, decompressing them into its cache
                data = decompress(shard['compression'], (Path(folder) / packed).read_bytes())
                folder = work
                (Path(work) / raw).write_bytes(data)
        sample = reader_from_json(folder, None, shard).get_item(0)
    pooled = sample.get('pooled_text_embedding')
    return DatasetDescription(
        location,
        num_samples,
        identity=identity,
        latent_shape=tuple(sample['latent_mean'].shape),
        embedding_width=sample['text_embedding'].shape[-1],
        embedding_length=sample['text_embedding'].shape[-2],
        pooled_width=None if pooled is None else pooled.shape[-1],
    )


def dataset_identity(shards: list[dict], num_samples: int) -> str:
    """`24 samples, index a1b2c3d4e5f6`: the samples and a digest of each shard's name, bytes and sample count, the
    same for the same data converted again (convert.py writes the same shards from the same files)."""
    listed = [[shard['raw_data']['basename'], shard['raw_data'].get('bytes'), shard['samples']] for shard in shards]
    digest = hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:12]
    return f'{num_samples} samples, index {digest}'


def first_captions(local: str, count: int) -> tuple[str, ...]:
    """The captions of a local MDS dataset's first `count` samples (fewer where it holds fewer; empty ones left
    out): a held-out split's captions, drawn as the run's sample grids."""
    from streaming.base.format import reader_from_json

    captions = []
    for shard in read_index(local, local):
        if 'caption' not in (shard.get('column_names') or ()):
            return ()
        reader = reader_from_json(local, None, shard)
        for index in range(int(shard['samples'])):
            caption = str(reader.get_item(index)['caption']).strip()
            if caption:
                captions.append(caption)
            if len(captions) == count:
                return tuple(captions)
    return tuple(captions)
