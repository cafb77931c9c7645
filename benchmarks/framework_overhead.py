"""Framework overhead: median step time through Composer's Trainer (as benchmark.py builds it: progress
bar, SpeedMonitor, in-memory logger) against a bare PyTorch loop, same tiny model, batch, data and AdamW.

    .venv/bin/python benchmarks/framework_overhead.py [--steps 60] [--rounds 3] [benchmark.py flags]

benchmark.py flags that both loops honour may follow: --precomputed_latents, --fused_adamw, --encoders_bf16.

Target: ratio at most 1.05 at steady state. Runs alternate (bare, Composer, bare, ...) so drift in the
machine's speed hits both alike; the first steps of every run are warm-up and left out.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from composer.core import Callback  # noqa: E402
from composer.utils import reproducibility  # noqa: E402

from benchmark import (build_dataloader, build_model, build_optimizer, build_trainer, parse_args,  # noqa: E402
                       resolve_args)


class StepTimer(Callback):
    def __init__(self):
        self.ends = []

    def batch_end(self, state, logger):
        self.ends.append(time.perf_counter())


def steady_step_times(ends: list[float], warmup: int) -> list[float]:
    return [later - earlier for earlier, later in zip(ends[warmup:], ends[warmup + 1:])]


def model_of(args):
    return build_model(args.model_name, precomputed=args.precomputed_latents, encoders_bf16=args.encoders_bf16)


def bare_loop(args, warmup: int) -> list[float]:
    reproducibility.seed_all(args.seed)
    model = model_of(args)
    optimizer = build_optimizer(args, model)
    model.train()
    ends = []
    for step, batch in enumerate(build_dataloader(args, model)):
        if step == args.num_batches:
            break
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return steady_step_times(ends, warmup)


def composer_loop(args, warmup: int) -> list[float]:
    reproducibility.seed_all(args.seed)
    model = model_of(args)
    trainer = build_trainer(args, model, build_dataloader(args, model))
    timer = StepTimer()
    trainer.state.callbacks.append(timer)
    trainer.fit()
    trainer.close()
    return steady_step_times(timer.ends, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--steps', type=int, default=60, help='steps per run')
    parser.add_argument('--warmup', type=int, default=10, help='steps left out at the start of each run')
    parser.add_argument('--rounds', type=int, default=3, help='alternating bare/Composer run pairs')
    parser.add_argument('--batch_size', type=int, default=16)
    parser.add_argument('--image_size', type=int, default=64)
    options, flags = parser.parse_known_args()
    mirrored = {'--precomputed_latents', '--fused_adamw', '--encoders_bf16'}
    if set(flags) - mirrored:
        parser.error(f'only these benchmark.py flags have a bare-loop equivalent: {sorted(mirrored)}')
    args = resolve_args(parse_args(['--model_name', 'tiny', '--use_synth_data', '--batch_size', str(options.batch_size),
                                    '--image_size', str(options.image_size), '--max_duration', f'{options.steps}ba',
                                    *flags]))
    bare, composer = [], []
    for _ in range(options.rounds):
        bare += bare_loop(args, options.warmup)
        composer += composer_loop(args, options.warmup)
    bare_median, composer_median = statistics.median(bare), statistics.median(composer)
    print(f'\ntiny model, batch {options.batch_size}, {options.image_size}px, {torch.get_num_threads()} threads, '
          f'{options.rounds} x {options.steps - options.warmup - 1} steady steps each; {" ".join(flags) or "no flags"}')
    print(f'bare PyTorch loop : {1000 * bare_median:8.2f} ms/step (median)')
    print(f'Composer Trainer  : {1000 * composer_median:8.2f} ms/step (median)')
    print(f'ratio             : {composer_median / bare_median:8.3f}  (target <= 1.05)')


if __name__ == '__main__':
    main()
