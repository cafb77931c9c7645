"""EMA update cost on the real SD2 base UNet (865,910,724 parameters, random init, fp32): ours (ema.py) against
the update of Composer's built-in EMA (`compute_ema` on its `EMAParameters`) on the same parameters.

    .venv/bin/python benchmarks/ema_update.py [--repeats 5] [--device cpu|cuda] [--no_step]

Prints one row per implementation: median seconds per update (after one warm-up update), the persistent bytes
each holds (its tensors, and the process RSS or CUDA memory they added) and the bytes each update allocates for
temporaries. Target: ours at least 3x faster, holding exactly the trainable parameter bytes (about 3.46 GB),
and on a GPU with --ema_offload none of it in GPU memory. On a GPU it also times an SD2 training step (512px,
microbatch 4, bf16 autocast, AdamW) to give EMA's cost as a fraction of a step.

Needs about 8 GB of RAM on CPU: the UNet plus one EMA copy at a time (the two are measured one after the other).
"""

import argparse
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--repeats', type=int, default=5, help='timed updates per implementation')
    parser.add_argument('--device', default=None, help='cuda or cpu (default: cuda when there is a GPU, else cpu)')
    parser.add_argument('--no_step', action='store_true', help='on a GPU, skip timing the SD2 training step')
    options = parser.parse_args()
    if options.repeats <= 0:
        parser.error(f'--repeats {options.repeats}: must be positive')
    # Loaded once the flags parse: --help and a bad flag answer without torch, Composer or Diffusers.
    from benchmarks import ema_costs

    ema_costs.compare(options.device, options.repeats, time_step=not options.no_step)


if __name__ == '__main__':
    main()
