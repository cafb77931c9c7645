"""Stable Diffusion 2 training-throughput benchmark: Composer's Trainer around Diffusers' UNet and VAE
and Transformers' CLIP text encoder, trained from scratch on the noise-prediction loss.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # published run
    python benchmark.py --use_synth_data                                   # on a laptop: tiny model

Flags default to the published run (512px, global batch 2048, AdamW lr 1e-4 wd 1e-3, constant LR).
Without a GPU the default model is `tiny`, and the choice is printed at start. The flags are in flags.py; run.py
runs the benchmark (config.py resolves the flags into one frozen RunConfig, model.py builds the model, training.py
the Trainer) and reports the throughput: printed, and with --results_json written in the schema of results.py.
"""

from flags import parse_args


def cli(argv: list[str] | None = None, callbacks: tuple = ()):
    """The command line: the flags parsed, then the run, each error it expects reported as one line."""
    args = parse_args(argv)
    # Imported once the flags parse, not at the top: torch, Composer and Diffusers take seconds to load, and --help
    # or a mistyped flag answers without them.
    import run

    return run.main_reporting_errors(args, callbacks)


if __name__ == '__main__':
    cli()
