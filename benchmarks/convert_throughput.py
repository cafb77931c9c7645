"""Conversion throughput (convert.py's code: datapath/convert_workers.write_pieces) on photo-like JPEGs of three
sizes, for 1 to all cores of this process: img/s and MB/s in all and per worker, the scaling against N times one
worker, the peak memory of a worker; where one image's time goes (reading its files, the decode that checks it,
hashing, writing); the bare Pillow decode rate of the same bytes; and the Spark route's rate in local mode (where
pyspark and a Java runtime are installed: make test-spark).

    .venv/bin/python benchmarks/convert_throughput.py [--images 1200] [--rounds 2] [--sizes 640x480,1024x768,2048x1536]

Each conversion runs in this process after Streaming is imported (convert.py's start-up, a few seconds of imports,
is left out). Rounds alternate between the worker counts so that drift in the machine's speed hits each; medians.
Last, the check of docs/data.md: two workers against one on --images 640x480 JPEGs, the same samples read back.
"""

import argparse
import datetime
import io
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.loader_throughput import WORDS, photo_like


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--images', type=int, default=1200, help='JPEGs of each size (default: %(default)s)')
    parser.add_argument('--distinct', type=int, default=24, help='distinct images per size, repeated (default: 24)')
    parser.add_argument('--rounds', type=int, default=2, help='rounds over the worker counts (default: 2)')
    parser.add_argument('--sizes', default='640x480,1024x768,2048x1536', help='JPEG sizes (default: %(default)s)')
    parser.add_argument('--no_spark', action='store_true', help="leave the Spark route's rate out")
    args = parser.parse_args(argv)
    args.sizes = [tuple(int(side) for side in size.split('x')) for size in args.sizes.split(',')]
    return args


def write_folder(folder: Path, size: tuple[int, int], count: int, distinct: int) -> int:
    """count JPEGs with captions (distinct images, repeated); returns their bytes."""
    import numpy as np

    rng = np.random.default_rng(size[0])
    images = [photo_like(rng, *size) for _ in range(distinct)]
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f'{i:06}.jpg').write_bytes(images[i % distinct])
        (folder / f'{i:06}.txt').write_text(' '.join(WORDS[(i + k) % len(WORDS)] for k in range(8)))
    return sum(len(images[i % distinct]) for i in range(count))


def main(argv=None) -> None:
    args = parse_args(argv)
    import streaming  # noqa: F401  imported before timing: convert.py's start-up is not measured
    from PIL import Image

    from datapath.caption_metadata import metadata_captions
    from datapath.convert_inputs import Reading, expand_inputs, pieces_of
    from datapath.convert_workers import write_pieces
    from datapath.sample_checks import usable_sample
    from settings.dataset_checks import SHARD_HASH

    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()
    print(
        f'# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, '
        f'{cores} cores usable, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; Python {platform.python_version()}, '
        f'Streaming {streaming.__version__}, Pillow {Image.__version__}'
    )
    scratch = Path(tempfile.mkdtemp(prefix='convert-throughput-'))

    def convert_folder(folder: Path, out: Path, workers: int) -> float:
        sources = expand_inputs([str(folder)])
        reading = Reading(False, {source.path: metadata_captions(source.path) for source in sources}, {}, 0.0)
        start, cpu = time.perf_counter(), cpu_seconds()
        stats = write_pieces(pieces_of(sources), reading, str(out), overwrite=True, progress=False, workers=workers)
        seconds = time.perf_counter() - start
        assert stats['written'] == args.images, stats
        cpu_per_image.setdefault((folder.name, workers), []).append((cpu_seconds() - cpu) / args.images)
        return seconds

    cpu_per_image = {}

    print('| size | workers | img/s | MB/s | img/s per worker | scaling (vs N x 1 worker) | CPU ms / image |')
    print('|---|---|---|---|---|---|---|')
    folders = {}
    for size in args.sizes:
        folder = scratch / f'{size[0]}x{size[1]}'
        megabytes = write_folder(folder, size, args.images, args.distinct) / 1e6
        folders[size] = (folder, megabytes)
        times = {workers: [] for workers in range(1, cores + 1)}
        for _ in range(args.rounds):
            for workers in times:
                times[workers].append(convert_folder(folder, scratch / 'out', workers))
        one = args.images / statistics.median(times[1])
        for workers, seconds in times.items():
            rate = args.images / statistics.median(seconds)
            print(
                f'| {size[0]}x{size[1]} ({megabytes / args.images * 1000:.0f} kB) | {workers} | {rate:.0f} | '
                f'{rate * megabytes / args.images:.1f} | {rate / workers:.0f} | {rate / (workers * one):.2f} | '
                f'{statistics.median(cpu_per_image[folder.name, workers]) * 1e3:.2f} |'
            )
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    itself = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f'\npeak memory: a worker {children:.0f} MiB, the main process {itself:.0f} MiB (resident; a forked '
        "worker's counts the pages it shares with the main process, its imports)"
    )
    where_time_goes(folders[args.sizes[0]][0], args, usable_sample, SHARD_HASH)
    if not args.no_spark:
        try:
            from datapath.spark_convert import spark_convert
        except ImportError as error:
            print(f'\nSpark route: not measured ({error}; make test-spark installs it)')
        else:
            spark_rate(spark_convert, scratch, folders[args.sizes[0]], cores)
    check_two_workers(folders[args.sizes[0]][0], scratch, args, convert_folder)


def cpu_seconds() -> float:
    """CPU time of this process and of its ended children (the workers): with the same per image for N workers as
    for one, a scaling below N is the machine's other load, not the workers' overhead."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def where_time_goes(folder: Path, args, usable_sample, shard_hash) -> None:
    """One image's time on one core, step by step, over the first size's files."""
    from PIL import Image
    from streaming import MDSWriter
    from streaming.base.hashing import get_hash

    paths = sorted(folder.glob('*.jpg'))
    steps = {}
    start = time.perf_counter()
    samples = [(path.read_bytes(), path.with_suffix('.txt').read_bytes()) for path in paths]
    steps['reading the image and caption files'] = time.perf_counter() - start
    start = time.perf_counter()
    checked = [usable_sample(image, caption) for image, caption in samples]
    steps['the decode that checks it (1/8 scale)'] = time.perf_counter() - start
    start = time.perf_counter()
    for sample in checked:
        get_hash(shard_hash, sample['jpg'])
    steps[f'hashing ({shard_hash})'] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with MDSWriter(out=out, columns={'jpg': 'bytes', 'caption': 'str'}) as writer:
            for sample in checked:
                writer.write(sample)
        steps['writing MDS shards'] = time.perf_counter() - start
    start = time.perf_counter()
    for image, _ in samples:
        Image.open(io.BytesIO(image)).convert('RGB')
    bare = time.perf_counter() - start
    print(f"\nwhere one {folder.name} image's time goes (one core, {len(paths)} images):")
    for step, seconds in steps.items():
        print(f'- {step}: {seconds / len(paths) * 1e3:.2f} ms')
    total = sum(steps.values())
    print(
        f'- all: {total / len(paths) * 1e3:.2f} ms, {len(paths) / total:.0f} img/s; a bare Pillow full decode of '
        f'the same bytes: {bare / len(paths) * 1e3:.2f} ms, {len(paths) / bare:.0f} img/s'
    )


def spark_rate(spark_convert, scratch: Path, folder_and_megabytes, cores: int) -> None:
    """The Spark route in local mode over the first size's images as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession

    folder, megabytes = folder_and_megabytes
    paths = sorted(folder.glob('*.jpg'))
    table = pa.table(
        {
            'jpg': [path.read_bytes() for path in paths],
            'caption': [path.with_suffix('.txt').read_text() for path in paths],
        }
    )
    pq.write_table(table, scratch / 'images.parquet', row_group_size=max(1, len(paths) // (2 * cores)))
    os.environ.setdefault('PYSPARK_PYTHON', sys.executable)
    start = time.perf_counter()
    session = SparkSession.builder.master(f'local[{cores}]').config('spark.ui.enabled', 'false').getOrCreate()
    started = time.perf_counter() - start
    start = time.perf_counter()
    stats = spark_convert(session, [str(scratch / 'images.parquet')], str(scratch / 'spark'), overwrite=True)
    seconds = time.perf_counter() - start
    session.stop()
    print(
        f'\nSpark route, local[{cores}], {folder.name}: {stats["written"] / seconds:.0f} img/s, '
        f'{megabytes / seconds:.1f} MB/s ({stats["written"]} images in {seconds:.1f} s, after {started:.1f} s '
        'starting Spark)'
    )


def check_two_workers(folder: Path, scratch: Path, args, convert_folder) -> None:
    from streaming import StreamingDataset

    def samples(out: Path) -> list:
        dataset = StreamingDataset(local=str(out), batch_size=1, shuffle=False)
        return [(dataset[i]['jpg'], dataset[i]['caption']) for i in range(dataset.num_samples)]

    one = min(convert_folder(folder, scratch / 'one', 1) for _ in range(args.rounds))
    two = min(convert_folder(folder, scratch / 'two', 2) for _ in range(args.rounds))
    same = samples(scratch / 'one') == samples(scratch / 'two')
    print(
        f'\ncheck: {args.images} {folder.name} JPEGs, one worker {one:.2f} s, two workers {two:.2f} s: '
        f'{one / two:.2f}x (goal: at least 1.5x), the same samples in the same order: {same}; '
        f'load after: {os.getloadavg()[0]:.2f}'
    )


if __name__ == '__main__':
    main()
