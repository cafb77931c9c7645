"""Framework overhead: step time through Composer's Trainer (as benchmark.py builds it: progress bar,
SpeedMonitor, bad-sample counter, in-memory logger) against a bare PyTorch loop (forward, loss, backward,
AdamW step) of an identical model on the same data.

    .venv/bin/python benchmarks/framework_overhead.py [--steps 60] [--rounds 3] [benchmark.py flags]

benchmark.py flags that both loops honour may follow: --precomputed_latents, --fused_adamw, --encoders_bf16,
--channels_last.

Target: ratio at most 1.05 at steady state. The two loops run interleaved, one step each in turn: a callback
at the end of every Composer step runs one bare step. A shared CPU's speed drifts by tens of percent from run
to run, which swamped a 5% target when the loops ran one after the other (per-round ratios from 0.90 to 1.32);
interleaved, each Composer step has a bare step beside it under the same conditions. A Composer step is the
time from the end of one bare step to the start of the next, so it holds everything the Trainer does per batch
(its other callbacks included). The first steps are warm-up and left out; each round is a fresh pair of models.

Both steps are also split into phases (data, forward, loss, backward, optimizer), Composer's at the events that
close each one, so the table shows where the Trainer's extra time goes; and the Trainer's own host work in each of
its steps is timed where it is called (event dispatch, the FSDP check, the batch copy, time sync, logging), so the
extra can be set against what Composer does with it.
"""

import argparse
import os
import statistics

from guards.arguments import ConfigError
from settings.flags import parse_args

os.environ.setdefault('HF_HUB_OFFLINE', '1')


def median_ms(steps: list[dict], key: str | None = None) -> float:
    """Median over steps of one phase (or part), or of their sum when key is None."""
    return 1000 * statistics.median(sum(step.values()) if key is None else step.get(key, 0.0) for step in steps)


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--steps', type=int, default=60, help='steps per run')
    parser.add_argument('--warmup', type=int, default=10, help='steps left out at the start of each run')
    parser.add_argument('--rounds', type=int, default=3, help='runs, each with fresh models')
    parser.add_argument('--batch_size', type=int, default=16)
    parser.add_argument('--image_size', type=int, default=64)
    options, flags = parser.parse_known_args()
    mirrored = {'--precomputed_latents', '--fused_adamw', '--encoders_bf16', '--channels_last'}
    if set(flags) - mirrored:
        parser.error(f'only these benchmark.py flags have a bare-loop equivalent: {sorted(mirrored)}')
    for flag in ('rounds', 'batch_size', 'image_size'):
        if getattr(options, flag) <= 0:
            parser.error(f'--{flag} {getattr(options, flag)}: must be positive')
    if options.warmup < 0:
        parser.error(f'--warmup {options.warmup}: must be 0 or more')
    if options.steps < options.warmup + 3:
        parser.error(f'--steps {options.steps}: at least --warmup + 3 ({options.warmup + 3})')
    # Loaded once the flags are checked: --help and a bad flag answer without torch, Composer or Diffusers.
    from settings.config import resolve_config

    try:
        args = resolve_config(
            parse_args(
                [
                    '--model_name',
                    'tiny',
                    '--use_synth_data',
                    '--batch_size',
                    str(options.batch_size),
                    '--image_size',
                    str(options.image_size),
                    '--max_duration',
                    f'{options.steps}ba',
                    *flags,
                ]
            )
        )
    except ConfigError as error:  # e.g. an --image_size the VAE cannot take
        parser.error(str(error))
    import torch

    from benchmarks import interleaved_loops

    bare, composer, parts, ratios = [], [], [], []
    for _ in range(options.rounds):
        round_bare, round_composer, round_parts = interleaved_loops.interleaved_round(args, options.warmup)
        bare += round_bare
        composer += round_composer
        parts += round_parts
        ratios.append(median_ms(round_composer) / median_ms(round_bare))
    print(
        f'\ntiny model, batch {options.batch_size}, {options.image_size}px, {torch.get_num_threads()} threads, '
        f'{options.rounds} x {len(bare) // options.rounds} steady steps of each loop, interleaved; '
        f'{" ".join(flags) or "no flags"}'
    )
    print(f'{"median ms":<10} {"bare":>8} {"Composer":>9} {"extra":>8}')
    for phase in (*interleaved_loops.PHASES, None):
        bare_ms, composer_ms = median_ms(bare, phase), median_ms(composer, phase)
        print(f'{phase or "step":<10} {bare_ms:8.2f} {composer_ms:9.2f} {composer_ms - bare_ms:+8.2f}')
    print(
        f'ratio      {median_ms(composer) / median_ms(bare):8.3f}  (target <= 1.05; '
        f'each round: {", ".join(f"{ratio:.3f}" for ratio in ratios)})'
    )
    print("\nComposer's own host work in its step, median ms:")
    for part in (*interleaved_loops.COMPOSER_PARTS, None):
        print(f'{part or "all":<11}{median_ms(parts, part):8.2f}')


if __name__ == '__main__':
    main()
