"""LAION-scale conversion on a Spark cluster: Parquet files (Hugging Face's or img2dataset's layout) and webdataset
tars (img2dataset's), local, on a shared file system or on s3a://, read as one DataFrame; each sample checked as
convert.py checks it (one function for both, datapath/sample_checks.py), and written as Streaming (MDS) shards by
Streaming's own dataframe_to_mds: each Spark task writes a part, and one index.json is merged over them at the end.
The held-out split is convert.py's too: the inputs' own (Hugging Face's `validation/`, else `test/`), or
--validation_fraction's, by the same hash of each sample's name; it is written by a second pass over the inputs.

    spark-submit datapath/spark_convert.py s3a://bucket/laion-parquet/ s3://bucket/laion/mds
    python -m datapath.spark_convert hf_dataset/data/ out/mds --master 'local[*]'     # Spark's local mode, one machine

The samples skipped are counted by reason and some named, as convert.py does (Spark's accumulators gather them from
the executors; which ten are named depends on the order the tasks end). A non-empty output is refused unless
--overwrite; a local output appears only whole (convert.py's staging), a remote one gets its index.json last.
Executors need this repo importable (a shared checkout, or `--py-files` with a zip of it).
"""

import argparse
import os
import shutil
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pyspark.accumulators import AccumulatorParam

from datapath.convert_inputs import ConvertError, split_of, split_position, tar_samples, with_held_out_split
from datapath.mds_output import (
    COLUMNS,
    SKIPPED_NAMED,
    VALIDATION_SPLIT,
    NothingWritten,
    check_output,
    describe_skipped,
    describe_written,
    print_skipped,
    staged,
)
from datapath.parquet_samples import ParquetLayoutError, pick_columns
from datapath.sample_checks import usable_sample
from guards import arguments
from settings.dataset_checks import SHARD_HASH, is_remote, s3_client


class SkippedCounts(AccumulatorParam):
    """Skip reasons counted on the executors, summed on the driver."""

    def zero(self, value):
        return Counter()

    def addInPlace(self, total, more):
        total.update(more)
        return total


class SkippedNames(AccumulatorParam):
    """The first SKIPPED_NAMED skipped samples the executors name, (name, reason)."""

    def zero(self, value):
        return []

    def addInPlace(self, named, more):
        return (named + more)[:SKIPPED_NAMED]


@dataclass
class InputFile:
    """A Parquet file or a webdataset tar the inputs hold, as Spark names it."""

    kind: str  # 'parquet' or 'tar'
    path: str  # Spark's name for it ('file:/data/train-00000.parquet', 's3a://bucket/laion/00000.tar')
    name: str  # relative to its input, as convert.py names it for the held-out hash ('data/train-00000.parquet')
    split: str | None  # its Hugging Face split, by its folder or the start of its name
    held_out: bool | None = None  # set by with_held_out_split where the inputs hold a held-out split


def input_files(session, inputs: list[str]) -> list[InputFile]:
    """Every Parquet file and tar at any depth of the inputs (Spark lists them: local, s3a://, hdfs://)."""
    from pyspark.errors import AnalysisException

    files = []
    for given in inputs:
        try:
            listed = session.read.format('binaryFile').option('recursiveFileLookup', 'true').load(given)
            paths = sorted(row.path for row in listed.select('path').collect())
        except AnalysisException as error:
            if 'PATH_NOT_FOUND' in str(error):
                raise ConvertError(f'{given}: no such file or folder')
            raise
        root = comparable(given if '://' in given else Path(given).resolve().as_posix()).rstrip('/')
        found = []
        for path in paths:
            where = comparable(path)
            name = where[len(root) + 1 :] if where.startswith(root + '/') else where.rpartition('/')[2]
            kind = 'parquet' if name.endswith('.parquet') else 'tar' if name.endswith('.tar') else None
            if kind:
                found.append(InputFile(kind, path, name, split_of(PurePosixPath(name))))
        if not found:
            raise ConvertError(f'{given}: no .parquet or .tar files at any depth; nothing written')
        files += found
    return with_held_out_split(files)


def comparable(path: str) -> str:
    """A path as Spark names it and as given compare alike: `file:/x`, `file:///x` and `/x` are all `/x`."""
    path = urllib.parse.unquote(path)
    return '/' + path[len('file:') :].lstrip('/') if path.startswith('file:') else path


def samples_frame(session, files: list[InputFile], caption_column: str | None):
    """The samples of the inputs as one DataFrame: each row's file (`file`), its row or its tar key (`key`), the
    image bytes (`jpg`), the caption (`caption`), and the reason a tar gives to skip it (`reason`, else null)."""
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    frames = []
    parquets = [file.path for file in files if file.kind == 'parquet']
    if parquets:
        try:
            frames.append(parquet_frame(session.read.parquet(*parquets), caption_column))
        except ParquetLayoutError as error:
            raise ConvertError(str(error))
    tars = [file.path for file in files if file.kind == 'tar']
    if tars:
        schema = StructType(
            [StructField(name, StringType()) for name in ('file', 'key')]
            + [
                StructField('jpg', BinaryType()),
                StructField('caption', StringType()),
                StructField('reason', StringType()),
            ]
        )
        # A tar is read whole into a row (Spark's binaryFile: at most 2 GB a file), then split into its samples by
        # convert.py's own reader, so that both routes group a tar's members alike.
        contents = session.read.format('binaryFile').load(tars).select('path', 'content')
        frames.append(session.createDataFrame(contents.rdd.flatMap(tar_rows), schema))
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    return frame


def parquet_frame(dataframe, caption_column: str | None):
    """A Parquet DataFrame's image bytes as `jpg`, its caption as `caption`, each row's file and row number."""
    from pyspark.sql import functions
    from pyspark.sql.types import BinaryType, StructType

    schema = dataframe.schema

    def holds_image(name: str) -> bool:
        kind = schema[name].dataType
        if isinstance(kind, StructType):
            return 'bytes' in kind.fieldNames()
        return isinstance(kind, BinaryType)

    image, caption = pick_columns('the input', schema.fieldNames(), holds_image, caption_column)
    struct = isinstance(schema[image].dataType, StructType)
    return dataframe.select(
        functions.col('_metadata.file_path').alias('file'),
        functions.col('_metadata.row_index').cast('string').alias('key'),
        functions.col(f'{image}.bytes' if struct else image).alias('jpg'),
        functions.col(caption).cast('string').alias('caption'),
        functions.lit(None).cast('string').alias('reason'),
    )


def tar_rows(row):
    """A tar's samples as rows of samples_frame (an unreadable tar: one row naming it, with its reason)."""
    for name, image, caption, reason in tar_samples(row.path, bytes(row.content)):
        key = name[len(row.path) + 1 :] if name.startswith(f'{row.path}:') else ''
        if isinstance(caption, bytes):
            try:
                caption = caption.decode('utf-8')
            except UnicodeDecodeError:
                reason = reason or 'caption is not UTF-8'
        yield row.path, key, image, caption, reason


def checked_samples(rows, skipped, named, names, fraction, held_out):
    """dataframe_to_mds's udf_iterable: a partition's rows (a pandas DataFrame) on this pass's side of the split
    (held_out or not) as the MDS samples that pass the check; the rest of that side counted in the accumulators.
    `names` maps a file to its name and its split (None: the hash decides)."""
    reasons, listed = Counter(), []
    for file, key, image, caption, reason in zip(
        rows['file'], rows['key'], rows['jpg'], rows['caption'], rows['reason']
    ):
        relative, split_held_out = names[comparable(file)]
        name = f'{relative}:{key}'
        side = split_held_out if split_held_out is not None else split_position(name) < fraction
        if side != held_out:
            continue
        # pandas holds a null as NaN or NA: None, as the other readers give a missing image or caption
        image = image if isinstance(image, (bytes, bytearray)) else None
        sample = (
            reason if isinstance(reason, str) else usable_sample(image, caption if isinstance(caption, str) else None)
        )
        if isinstance(sample, str):
            reasons[sample] += 1
            if len(listed) < SKIPPED_NAMED:
                listed.append((name, sample))
            continue
        yield sample
    skipped.add(reasons)
    named.add(listed)


def spark_convert(
    session,
    inputs: list[str],
    out: str,
    overwrite=False,
    size_limit='64mb',
    caption_column=None,
    validation_fraction=0.0,
) -> dict:
    """The inputs (Parquet files, webdataset tars) as MDS shards in `out`, and the held-out split (the inputs' own,
    or --validation_fraction's by the hash convert.py uses) in out/validation; convert.py's counts."""
    check_output(out, overwrite, [name for name in inputs if '://' not in name])
    files = input_files(session, inputs)
    if validation_fraction and any(file.held_out for file in files):
        split = next(file for file in files if file.held_out)
        raise ConvertError(
            f'--validation_fraction {validation_fraction}: the input has its own {split.split} split '
            f'({split.path}), which is the validation split; leave the flag out'
        )
    names = {comparable(file.path): (file.name, file.held_out) for file in files}
    frame = samples_frame(session, files, caption_column)
    if frame.isEmpty():  # dataframe_to_mds refuses an empty DataFrame: convert.py's message instead
        raise NothingWritten(out, {'written': 0, 'held_out': 0, 'skipped': {}, 'skipped_named': []})
    held_out_pass = validation_fraction > 0 or any(file.held_out for file in files)
    skipped = session.sparkContext.accumulator(Counter(), SkippedCounts())
    named = session.sparkContext.accumulator([], SkippedNames())

    def write(target: str, before_first_sample) -> dict:
        from streaming.base.converters import dataframe_to_mds

        if before_first_sample is not None:
            before_first_sample()  # the executors write at once: an earlier remote index goes first
        sides = {False: target, True: f'{target.rstrip("/")}/{VALIDATION_SPLIT}'} if held_out_pass else {False: target}
        for held_out, side_target in sides.items():
            mds = {'out': side_target, 'columns': dict(COLUMNS), 'size_limit': size_limit, 'hashes': [SHARD_HASH]}
            dataframe_to_mds(
                frame,
                merge_index=True,
                mds_kwargs={**mds, 'compression': None},
                udf_iterable=checked_samples,
                udf_kwargs={
                    'skipped': skipped,
                    'named': named,
                    'names': names,
                    'fraction': validation_fraction,
                    'held_out': held_out,
                },
            )
        written, shards = merged_counts(target)
        held_out = merged_counts(sides[True])[0] if held_out_pass else 0
        if held_out_pass and not held_out:
            drop_split(sides[True])
        return {
            'written': written,
            'held_out': held_out,
            'skipped': dict(skipped.value),
            'skipped_named': named.value,
            'shards': shards,
        }

    return staged(out, overwrite, write)


def merged_counts(target: str) -> tuple[int, int]:
    """Samples and shards listed by the merged index.json of `target` (local, or downloaded from a remote)."""
    import json
    import tempfile

    from streaming.base.storage.download import CloudDownloader

    with tempfile.TemporaryDirectory() as scratch:
        index = f'{scratch}/index.json'
        CloudDownloader.direct_download(f'{target.rstrip("/")}/index.json', index, 60)
        with open(index) as file:
            shards = json.load(file)['shards']
    return sum(shard['samples'] for shard in shards), len(shards)


def drop_split(split: str) -> None:
    """A held-out split that no sample fell into is not kept (convert.py writes none): its index goes, locally its
    folder."""
    if not is_remote(split):
        shutil.rmtree(split, ignore_errors=True)
    elif urllib.parse.urlparse(split).scheme == 's3':
        url = urllib.parse.urlparse(split)
        s3_client(timeout=30).delete_object(Bucket=url.netloc, Key=f'{url.path.strip("/")}/index.json')


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(
        description='Convert image-caption data (Parquet files, webdataset tars) to MDS shards on Spark.'
    )
    parser.add_argument(
        'inputs',
        nargs='+',
        help='Parquet files, webdataset .tar files, or folders of them at any depth (local, '
        "s3a://, hdfs://, ...); Hugging Face's split folders or files (train/, validation/) give the validation split",
    )
    parser.add_argument('out', help='output folder, or a remote such as s3://bucket/laion/mds')
    parser.add_argument('--overwrite', action='store_true', help='write into a non-empty output')
    parser.add_argument(
        '--size_limit', default='64mb', help='shard size before a new shard starts (default: %(default)s)'
    )
    parser.add_argument(
        '--validation_fraction',
        type=float,
        default=0.0,
        metavar='F',
        help=f'hold out this fraction of the samples (0 <= F < 1) as a validation split in OUT/{VALIDATION_SPLIT}, '
        "by the hash convert.py uses of each sample's name (its file and row, or its tar and key) (default: none)",
    )
    parser.add_argument('--caption_column', metavar='NAME', help='the caption column (default: text, caption, prompt)')
    parser.add_argument('--master', help="Spark's master URL, where spark-submit does not give one (e.g. 'local[*]')")
    args = parser.parse_args(argv)
    if not 0 <= args.validation_fraction < 1:  # NaN too
        raise ConvertError(
            f'--validation_fraction {args.validation_fraction}: the fraction of samples held out, '
            'at least 0 and below 1 (e.g. 0.05)'
        )
    return args


def main(argv=None) -> dict:
    from pyspark.sql import SparkSession

    args = parse_args(argv)
    os.environ.setdefault('PYSPARK_PYTHON', sys.executable)  # local mode's executors: this environment's Python
    builder = SparkSession.builder.appName('sd2 spark_convert')
    session = (builder.master(args.master) if args.master else builder).getOrCreate()
    start = time.perf_counter()
    try:
        stats = spark_convert(
            session,
            args.inputs,
            args.out,
            args.overwrite,
            args.size_limit,
            args.caption_column,
            args.validation_fraction,
        )
    except NothingWritten as error:
        print_skipped(error.stats)
        raise
    print_skipped(stats)
    print(
        f'{describe_written(stats, args.validation_fraction)} in {time.perf_counter() - start:.1f} s; '
        f'skipped {sum(stats["skipped"].values())}: {describe_skipped(stats["skipped"]) or "none"}'
    )
    return stats


if __name__ == '__main__':
    try:
        main()
    except ConvertError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
