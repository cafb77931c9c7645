"""Run the frozen VAE and text encoder(s) over an MDS dataset once, and write what they give as a new MDS
dataset: the latent distribution (mean and log-variance) and the text embedding, fp16, and the caption; for
SDXL also the pooled text embedding and the image's size and crop conditioning.
`benchmark.py --precomputed_latents` then trains the UNet alone on it, with no encoder in memory or in
the step (in the published run the VAE encoder was about a third of the compute of every step).

    python precompute.py --out data/sample-latents                          # the sample dataset, this device's model
    composer -n 8 precompute.py --remote s3://bucket/laion/mds --out s3://bucket/laion/sd2-latents-512 \\
        --model_name sd2-base --image_size 512

The samples are split into parts of --part_size, each written as its own MDS folder (part-00000, ...) and
spread over the ranks of the launcher. A part is finished when its index.json exists, so running the
same command again after a crash redoes only unfinished parts. Rank 0 then merges the parts' indexes into
one dataset with Streaming's merge_index. Bad samples (see data.py) are left out, and counted.
"""

import argparse

from guards import arguments
from guards.arguments import ConfigError
from guards.library_patches import LibraryChanged
from guards.outputs import one_line
from guards.stopping import SIGNALS, Stopped, stop_on_signals
from settings.dataset_checks import DataError
from settings.precompute_settings import settle_precompute


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(
        description='Precompute VAE latents and text embeddings of an MDS dataset '
        '(images and captions, as convert.py writes) for --precomputed_latents.'
    )
    parser.add_argument('--remote', default=None, help='input dataset to stream, e.g. s3://bucket/laion/mds')
    parser.add_argument(
        '--local',
        default=None,
        help='input MDS folder, or with --remote its cache folder '
        '(default without either: the sample dataset data/sample-mds)',
    )
    parser.add_argument('--out', required=True, help='output folder, or a remote such as s3://bucket/laion/latents')
    parser.add_argument(
        '--model_name',
        default=None,
        help='the model whose VAE and text encoder to run: as in '
        'benchmark.py (default: sd2-base on a GPU, tiny without one)',
    )
    parser.add_argument('--image_size', type=int, default=None, help='resolution in pixels (default: the model preset)')
    parser.add_argument(
        '--tokenizer',
        default=None,
        help="local tokenizer folder (default: SD2's CLIP BPE; for a model with a T5 encoder, T5's, which it needs)",
    )
    parser.add_argument(
        '--batch_size',
        type=int,
        default=None,
        help='samples per encoder pass per device (default: 32 on a GPU, 16 on CPU)',
    )
    parser.add_argument(
        '--num_workers', type=int, default=None, help='decoding workers per device (default: 8 on a GPU, 0 on CPU)'
    )
    parser.add_argument(
        '--part_size',
        type=int,
        default=10_000,
        help='samples per part: the unit of resumption and of work per rank (default: %(default)s)',
    )
    parser.add_argument(
        '--precision',
        choices=['fp32', 'bf16'],
        default=None,
        help='encoder weights and compute (default: bf16 on a GPU, fp32 on CPU); stored as fp16 either way',
    )
    parser.add_argument(
        '--seed',
        type=int,
        default=17,
        help='seeds encoders that have no weights in the model folder, '
        'whose random-init latents are for benchmarking only (default: %(default)s)',
    )
    parser.add_argument(
        '--overwrite', action='store_true', help='start over: discard an output made with other settings'
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with stop_on_signals(lambda signum: stopped_line(signum, args)):
        settings = settle_precompute(args)
        # Imported once the flags check out, not at the top: torch, Streaming and the encoders take seconds to load,
        # and --help or a bad flag answers without them.
        from runs import precomputing
    # Importing Composer installed its own handlers (composer.core.engine: sys.exit(128 + signum), no line): ours
    # again, for the encoding.
    with stop_on_signals(lambda signum: stopped_line(signum, args)):
        return precomputing.precompute(settings)


def stopped_line(signum: int, args: argparse.Namespace) -> str:
    """Ctrl-C or SIGTERM: the parts finished stay, the one in progress goes (precomputing.precompute_part), and the
    same command finishes the rest; with --overwrite it would start over."""
    again = 'the same command without --overwrite' if args.overwrite else 'the same command again'
    return (
        f'{SIGNALS[signum]}: precompute stopped; {args.out} keeps the parts finished, not the one in progress: '
        f'{again} finishes the rest'
    )


DATA_ERROR = f'{DataError.__module__}.{DataError.__name__}: '  # how a loader worker's error begins its last line


def cli(argv=None) -> None:
    """main() with each error it expects as one line (arguments.stop: one write, so that the ranks of a launcher
    sharing a stderr do not interleave theirs) and an exit status."""
    try:
        main(argv)
    except ConfigError as error:
        arguments.stop(2, str(error))
    except LibraryChanged as error:  # an installed library whose patched names changed (guards/library_patches.py)
        arguments.stop(1, str(error))
    except Stopped as stopped:
        arguments.stop(stopped.exit_status, str(stopped))
    except OSError as error:  # a write that failed while encoding (a full disk): the parts finished are kept
        arguments.stop(1, one_line(error))
    except DataError as error:  # found while encoding: a damaged shard, a dead loader worker; a worker's carries
        # its traceback, whose last line is the reason
        arguments.stop(1, str(error).strip().splitlines()[-1].removeprefix(DATA_ERROR))


if __name__ == '__main__':
    cli()
