"""Framework overhead: step time through Composer's Trainer (as benchmark.py builds it: progress bar,
SpeedMonitor, bad-sample counter, in-memory logger) against a bare PyTorch loop (forward, loss, backward,
AdamW step) of an identical model on the same data.

    .venv/bin/python benchmarks/framework_overhead.py [--steps 60] [--rounds 3] [benchmark.py flags]

benchmark.py flags that both loops honour may follow: --precomputed_latents, --fused_adamw, --encoders_bf16.

Target: ratio at most 1.05 at steady state. The two loops run interleaved, one step each in turn: a callback
at the end of every Composer step runs one bare step. A shared CPU's speed drifts by tens of percent from run
to run, which swamped a 5% target when the loops ran one after the other (per-round ratios from 0.90 to 1.32);
interleaved, each Composer step has a bare step beside it under the same conditions. A Composer step is the
time from the end of one bare step to the start of the next, so it holds everything the Trainer does per batch
(its other callbacks included). The first steps are warm-up and left out; each round is a fresh pair of models.
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


def model_of(args):
    return build_model(args.model_name, precomputed=args.precomputed_latents, encoders_bf16=args.encoders_bf16)


class InterleavedBareLoop(Callback):
    """At each Composer batch end, one step of a bare PyTorch loop on its own model, optimizer and data."""

    def __init__(self, args):
        reproducibility.seed_all(args.seed)
        self.model = model_of(args)
        self.optimizer = build_optimizer(args, self.model)
        self.model.train()
        self.batches = iter(build_dataloader(args, self.model))
        self.spans = []  # (start, end) of each bare step

    def batch_end(self, state, logger):
        start = time.perf_counter()
        batch = next(self.batches)
        loss = self.model.loss(self.model(batch), batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.spans.append((start, time.perf_counter()))

    def step_times(self, warmup: int) -> tuple[list[float], list[float]]:
        """Bare step times, and Composer's: from the end of one bare step to the start of the next."""
        spans = self.spans[warmup:]
        bare = [end - start for start, end in spans[1:]]
        composer = [start - end for (_, end), (start, _) in zip(spans, spans[1:])]
        return bare, composer


def interleaved_round(args, warmup: int) -> tuple[list[float], list[float]]:
    bare_loop = InterleavedBareLoop(args)
    reproducibility.seed_all(args.seed)
    model = model_of(args)
    trainer = build_trainer(args, model, build_dataloader(args, model), callbacks=(bare_loop,))
    trainer.fit()
    trainer.close()
    return bare_loop.step_times(warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--steps', type=int, default=60, help='steps per run')
    parser.add_argument('--warmup', type=int, default=10, help='steps left out at the start of each run')
    parser.add_argument('--rounds', type=int, default=3, help='runs, each with fresh models')
    parser.add_argument('--batch_size', type=int, default=16)
    parser.add_argument('--image_size', type=int, default=64)
    options, flags = parser.parse_known_args()
    mirrored = {'--precomputed_latents', '--fused_adamw', '--encoders_bf16'}
    if set(flags) - mirrored:
        parser.error(f'only these benchmark.py flags have a bare-loop equivalent: {sorted(mirrored)}')
    if options.steps < options.warmup + 3:
        parser.error(f'--steps {options.steps}: at least --warmup + 3 ({options.warmup + 3})')
    args = resolve_args(parse_args(['--model_name', 'tiny', '--use_synth_data', '--batch_size', str(options.batch_size),
                                    '--image_size', str(options.image_size), '--max_duration', f'{options.steps}ba',
                                    *flags]))
    bare, composer, ratios = [], [], []
    for _ in range(options.rounds):
        round_bare, round_composer = interleaved_round(args, options.warmup)
        bare += round_bare
        composer += round_composer
        ratios.append(statistics.median(round_composer) / statistics.median(round_bare))
    print(f'\ntiny model, batch {options.batch_size}, {options.image_size}px, {torch.get_num_threads()} threads, '
          f'{options.rounds} x {len(bare) // options.rounds} steady steps of each loop, interleaved; '
          f'{" ".join(flags) or "no flags"}')
    print(f'bare PyTorch loop : {1000 * statistics.median(bare):8.2f} ms/step (median)')
    print(f'Composer Trainer  : {1000 * statistics.median(composer):8.2f} ms/step (median)')
    print(f'ratio             : {statistics.median(composer) / statistics.median(bare):8.3f}  (target <= 1.05; '
          f'each round: {", ".join(f"{ratio:.3f}" for ratio in ratios)})')


if __name__ == '__main__':
    main()
