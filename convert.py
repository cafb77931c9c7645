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
import os
import re
import sys
import time

from datapath.caption_metadata import CaptionMetadataError, metadata_captions
from datapath.convert_inputs import (  # noqa: F401  STAGING, split_name and write_mds: the tests' handles
    IMAGE_EXTENSIONS,
    NO_CAPTION_FILE,
    ConvertError,
    Reading,
    expand_inputs,
    parquet_layouts,
    pieces_of,
    split_name,
    split_position,
)
from datapath.convert_workers import ConversionStopped, write_pieces
from datapath.mds_output import (  # noqa: F401
    SKIPPED_NAMED,
    STAGING,
    VALIDATION_SPLIT,
    NothingWritten,
    check_output,
    describe_skipped,
    describe_written,
    print_skipped,
    write_mds,
)
from guards import arguments
from guards.outputs import one_line
from guards.stopping import SIGNALS, Stopped, stop_on_signals
from guards.writer_lock import FolderBusy, one_writer
from settings.dataset_checks import is_remote


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
    validation = validation_fraction > 0 or any(source.held_out for source in sources)
    return write_pieces(pieces, reading, out, overwrite, size_limit, progress, validation, workers)


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
