"""LAION-scale conversion on a Spark cluster: Parquet files (Hugging Face's or img2dataset's layout, local, on a
shared file system or on s3a://) read as a DataFrame, each sample checked as convert.py checks it (one function for
both, datapath/sample_checks.py), and written as Streaming (MDS) shards by Streaming's own dataframe_to_mds: each
Spark task writes a part, and one index.json is merged over them at the end.

    spark-submit datapath/spark_convert.py s3a://bucket/laion-parquet/ s3://bucket/laion/mds
    python -m datapath.spark_convert hf_dataset/data/ out/mds --master 'local[*]'     # Spark's local mode, one machine

The samples skipped are counted by reason and some named, as convert.py does (Spark's accumulators gather them from
the executors; which ten are named depends on the order the tasks end). A non-empty output is refused unless
--overwrite; a local output appears only whole (convert.py's staging), a remote one gets its index.json last.
Executors need this repo importable (a shared checkout, or `--py-files` with a zip of it).
"""

import argparse
import os
import sys
import time
from collections import Counter

from pyspark.accumulators import AccumulatorParam

from datapath.convert_inputs import ConvertError
from datapath.mds_output import (
    COLUMNS,
    SKIPPED_NAMED,
    NothingWritten,
    check_output,
    describe_skipped,
    print_skipped,
    staged,
)
from datapath.parquet_samples import ParquetLayoutError, pick_columns
from datapath.sample_checks import usable_sample
from guards import arguments
from settings.dataset_checks import SHARD_HASH

PARTITION_ROWS = 4096  # rows of a Spark partition's Arrow batches handed to the sample check at once


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


def image_and_caption(dataframe, caption_column: str | None):
    """The DataFrame's image bytes as `jpg` and its caption as `caption`, with each row's file as `name`."""
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
        functions.input_file_name().alias('name'),
        functions.col(f'{image}.bytes' if struct else image).alias('jpg'),
        functions.col(caption).cast('string').alias('caption'),
    )


def checked_samples(rows, skipped, named):
    """dataframe_to_mds's udf_iterable: a partition's rows (a pandas DataFrame) as the MDS samples that pass the
    check; the rest counted in the accumulators."""
    reasons, names = Counter(), []
    for name, image, caption in zip(rows['name'], rows['jpg'], rows['caption']):
        # pandas holds a null as NaN or NA: None, as the other readers give a missing image or caption
        image = image if isinstance(image, (bytes, bytearray)) else None
        sample = usable_sample(image, caption if isinstance(caption, str) else None)
        if isinstance(sample, str):
            reasons[sample] += 1
            if len(names) < SKIPPED_NAMED:
                names.append((name, sample))
            continue
        yield sample
    skipped.add(reasons)
    named.add(names)


def spark_convert(
    session, inputs: list[str], out: str, overwrite=False, size_limit='64mb', caption_column=None
) -> dict:
    """The Parquet inputs as MDS shards in `out`; convert.py's counts ('written', 'skipped', 'skipped_named')."""
    from streaming.base.converters import dataframe_to_mds

    check_output(out, overwrite, [name for name in inputs if '://' not in name])
    try:
        dataframe = image_and_caption(session.read.parquet(*inputs), caption_column)
    except ParquetLayoutError as error:
        raise ConvertError(str(error))
    skipped = session.sparkContext.accumulator(Counter(), SkippedCounts())
    named = session.sparkContext.accumulator([], SkippedNames())

    def write(target: str, before_first_sample) -> dict:
        if before_first_sample is not None:
            before_first_sample()  # the executors write at once: an earlier remote index goes first
        columns = dict(COLUMNS)
        mds = {'out': target, 'columns': columns, 'size_limit': size_limit, 'hashes': [SHARD_HASH], 'compression': None}
        dataframe_to_mds(
            dataframe,
            merge_index=True,
            mds_kwargs=mds,
            udf_iterable=checked_samples,
            udf_kwargs={'skipped': skipped, 'named': named},
        )
        written, shards = merged_counts(target)
        return {
            'written': written,
            'held_out': 0,
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(description='Convert Parquet image-caption data to MDS shards on Spark.')
    parser.add_argument('inputs', nargs='+', help='Parquet files or folders of them (local, s3a://, hdfs://, ...)')
    parser.add_argument('out', help='output folder, or a remote such as s3://bucket/laion/mds')
    parser.add_argument('--overwrite', action='store_true', help='write into a non-empty output')
    parser.add_argument(
        '--size_limit', default='64mb', help='shard size before a new shard starts (default: %(default)s)'
    )
    parser.add_argument('--caption_column', metavar='NAME', help='the caption column (default: text, caption, prompt)')
    parser.add_argument('--master', help="Spark's master URL, where spark-submit does not give one (e.g. 'local[*]')")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    from pyspark.sql import SparkSession

    args = parse_args(argv)
    os.environ.setdefault('PYSPARK_PYTHON', sys.executable)  # local mode's executors: this environment's Python
    builder = SparkSession.builder.appName('sd2 spark_convert')
    session = (builder.master(args.master) if args.master else builder).getOrCreate()
    start = time.perf_counter()
    try:
        stats = spark_convert(session, args.inputs, args.out, args.overwrite, args.size_limit, args.caption_column)
    except NothingWritten as error:
        print_skipped(error.stats)
        raise
    print_skipped(stats)
    print(
        f'wrote {stats["written"]} samples in {stats["shards"]} shard(s) to {args.out} in '
        f'{time.perf_counter() - start:.1f} s; skipped {sum(stats["skipped"].values())}: '
        f'{describe_skipped(stats["skipped"]) or "none"}'
    )
    return stats


if __name__ == '__main__':
    try:
        main()
    except ConvertError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
