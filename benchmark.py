"""The text-to-image training benchmark: a Stable Diffusion UNet or a diffusion transformer (Diffusers), with its
frozen VAE and text encoders, trained from scratch by Composer's Trainer; img/s, FLOP/s and MFU measured.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # published run
    python benchmark.py --use_synth_data                                   # on a laptop: tiny model

Flags default to the published run (512px, global batch 2048, AdamW lr 1e-4 wd 1e-3, constant LR).
Without a GPU the default model is `tiny`, and the choice is printed at start. The flags are in
settings/flags.py, and settings/config.py settles them into one frozen RunConfig before torch loads; runs/run.py runs
the benchmark (models/ builds the model, runs/training.py the Trainer) and reports the throughput: printed, and with
--results_json written in the schema of costs/results.py.
"""

import os

from guards.arguments import ConfigError, stop
from guards.library_patches import LibraryChanged
from guards.stopping import leave_signals_to_parent
from runs.start_lines import start_lines
from settings.config import resolve_config
from settings.flags import parse_args


def cli(argv: list[str] | None = None, callbacks: tuple = ()):
    """The command line: the flags parsed and settled, then the run, each error it expects reported as one line."""
    try:
        config = resolve_config(parse_args(argv))
    except ConfigError as error:
        stop(2, str(error))
    if os.environ.get('RANK', '0') == '0':  # the first lines at once, while torch loads (rank 0's, as run.py's)
        print('\n'.join(start_lines(config)), flush=True)
    # Imported once the flags are settled, not at the top: torch, Composer and Diffusers take seconds to load, and
    # --help or a bad flag answers without them.
    try:
        from runs import run
    except LibraryChanged as error:  # an installed library whose patched names changed (guards/library_patches.py)
        stop(1, str(error))
    trainer = run.main_reporting_errors(config, callbacks, announced=True)
    run.close_process_group()
    return trainer


if __name__ == '__main__':
    cli()
elif __name__ == '__mp_main__':
    # A process that multiprocessing spawned for the run (Composer's checkpoint uploads to s3:// and the like) runs
    # this script's top first, under this name. A job-wide SIGTERM or Ctrl-C (scancel, a deleted pod) would kill it
    # and lose the checkpoint the run writes on its way out: it leaves the signal to the run, which ends it after.
    leave_signals_to_parent()
