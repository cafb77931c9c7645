"""convert.py's output: MDS datasets that appear only whole (a local one staged and moved into place, a remote one
given its index.json last), the samples that pass the loader's checks written and the rest counted and named, and
a non-empty output refused unless overwritten. The Spark route (spark_convert.py) writes through it too.
"""

import contextlib
import os
import shutil
import sys
import urllib.parse
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from datapath.convert_inputs import ConvertError
from datapath.sample_checks import usable_sample
from guards.outputs import WriteFailed, free_space_fix, system_reason, write_failure
from guards.writer_lock import LOCK_FILE
from settings.dataset_checks import IMAGE_CAPTION_COLUMNS, SHARD_HASH, is_remote, s3_client

COLUMNS = IMAGE_CAPTION_COLUMNS  # the LAION convention of the published benchmark
SKIPPED_NAMED = 10  # skipped samples named one by one; the rest are only counted
# A local output's shards and index until the conversion ends, inside the output folder (its file system, its disk).
STAGING = '.convert-partial'
# --validation_fraction's held-out split: an MDS dataset of its own in this folder of the output (settings/datasets.py
# looks for it there when a run's --local is a converted folder).
VALIDATION_SPLIT = 'validation'


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


def write_samples(writer, validation_writer, samples, total: int | None, progress: bool, before_first_sample) -> dict:
    written, held_out, skipped, skipped_named = 0, 0, Counter(), []
    # No bar at all without progress: even a disabled tqdm takes tqdm's lock, which a conversion worker (forked from
    # a process with a bar and its monitor thread) shares with that process, half of it a semaphore across processes.
    if progress:
        samples = tqdm(samples, total=total, unit='img', desc='converting')
    for name, image, caption, reason, in_validation in samples:
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


def describe_written(stats: dict, validation_fraction: float) -> str:
    """The summary's count of samples, and where the held-out split is when one was asked for or the input had
    its own (a Hugging Face validation split)."""
    out = stats['out']
    if not validation_fraction and not stats['held_out']:
        return f'wrote {stats["written"]} samples in {stats["shards"]} shard(s) to {out}'
    split = f'{out.rstrip("/")}/{VALIDATION_SPLIT}'
    why = share_held_out(stats, validation_fraction) if validation_fraction else ", the input's own split"
    held_out = (
        f'{stats["held_out"]} held out for validation in {split}{why}'
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
