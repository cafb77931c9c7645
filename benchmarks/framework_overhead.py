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
import functools
import os
import statistics
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import torch  # noqa: E402
from composer.algorithms.channels_last import apply_channels_last  # noqa: E402
from composer.core import Callback, Engine, Event, State  # noqa: E402
from composer.loggers import Logger  # noqa: E402
from composer.trainer import trainer as composer_trainer  # noqa: E402
from composer.utils import reproducibility  # noqa: E402

from config import resolve_config  # noqa: E402
from flags import parse_args  # noqa: E402
from model import build_model  # noqa: E402
from training import build_dataloader, build_optimizer, build_trainer  # noqa: E402


def model_of(args):
    return build_model(args.model_dir, precomputed=args.precomputed_latents, encoders_bf16=args.encoders_bf16)


PHASES = ('data', 'forward', 'loss', 'backward', 'optimizer')
# The Composer event that ends each phase. 'data' starts when the previous bare step ends, so it holds the
# Trainer's loop bookkeeping too; 'loss' frees the previous step's autograd graph (the Trainer holds each loss until
# the next replaces it; the bare loop frees its own in 'optimizer'); 'optimizer' holds AdamW's step, the loss's
# .item() and the per-batch logging.
PHASE_ENDS = {
    Event.BEFORE_FORWARD: 'data',
    Event.AFTER_FORWARD: 'forward',
    Event.AFTER_LOSS: 'loss',
    Event.AFTER_BACKWARD: 'backward',
    Event.BATCH_END: 'optimizer',
}


# The Trainer's own host work per batch, timed where it is called: composer 0.32.1's internals (pinned).
COMPOSER_PARTS = {
    'events': (Engine, 'run_event'),  # every event: algorithms, callbacks (SpeedMonitor...), loggers, progress bar
    'FSDP check': (State, 'fsdp_enabled'),  # a property that walks all of the model's modules, once per batch
    'batch copy': (composer_trainer, 'deepcopy'),  # each microbatch is deep-copied before its forward
    'time sync': (composer_trainer.Trainer, '_accumulate_time_across_ranks'),  # samples and time over ranks
    'logging': (Logger, 'log_metrics'),  # what the Trainer logs itself: loss, learning rate, microbatch size
}


class ComposerHostTimer:
    """While entered, times each of COMPOSER_PARTS. Only the outermost timed call counts, so a metric logged
    inside an event is the event's time, and nothing is counted twice."""

    def __init__(self):
        self.seconds = dict.fromkeys(COMPOSER_PARTS, 0.0)
        self.depth = 0
        self.originals = {}

    def __enter__(self):
        for part, (owner, name) in COMPOSER_PARTS.items():
            original = self.originals[part] = vars(owner)[name]
            if isinstance(original, property):
                setattr(owner, name, property(self.timed(part, original.fget)))
            else:
                setattr(owner, name, self.timed(part, original))
        return self

    def __exit__(self, *exc_info):
        for part, (owner, name) in COMPOSER_PARTS.items():
            setattr(owner, name, self.originals[part])

    def timed(self, part, function):
        @functools.wraps(function)
        def timed_call(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds[part] += time.perf_counter() - start

        return timed_call

    def take(self) -> dict:
        """The seconds counted since the last take."""
        taken, self.seconds = self.seconds, dict.fromkeys(COMPOSER_PARTS, 0.0)
        return taken


class InterleavedBareLoop(Callback):
    """At each Composer batch end, one step of a bare PyTorch loop on its own model, optimizer and data.

    Records each step of both loops as {phase: seconds}, and each Composer step's host work as {part: seconds}.
    """

    def __init__(self, args, timer: ComposerHostTimer):
        self.timer = timer
        reproducibility.seed_all(args.seed)
        self.model = model_of(args)
        if args.channels_last:  # what Composer's ChannelsLast algorithm does to the other model at INIT
            apply_channels_last(self.model)
        self.optimizer = build_optimizer(args, self.model)
        self.model.train()
        self.batches = iter(build_dataloader(args, self.model))
        self.bare_steps = []
        self.composer_steps = []  # the i-th ran between bare steps i and i + 1
        self.composer_parts = []  # the host work of composer_steps[i]
        self.composer_step = {}
        self.phase_start = None  # None until the first bare step has ended

    def run_event(self, event, state, logger):
        # Callbacks run in order, then loggers: a phase ends after the other callbacks have run on its
        # event, and what the loggers do on it lands in the next phase.
        now = time.perf_counter()
        phase = PHASE_ENDS.get(event)
        if phase is not None and self.phase_start is not None:
            # Summed: with microbatching every phase but the optimizer's runs once per microbatch.
            self.composer_step[phase] = self.composer_step.get(phase, 0.0) + now - self.phase_start
            self.phase_start = now
        super().run_event(event, state, logger)

    def batch_end(self, state, logger):
        entered = time.perf_counter()
        # This batch's BATCH_END dispatch is still running, so it counts with the next step's parts (less this
        # callback's own time, taken off below): steps shift by one event, medians do not.
        parts = self.timer.take()
        if self.phase_start is not None:
            self.composer_steps.append(self.composer_step)
            self.composer_parts.append(parts)
        self.composer_step = {}
        bare_step = {}
        clock = time.perf_counter()

        def phase_ended(phase):
            nonlocal clock
            now = time.perf_counter()
            bare_step[phase] = now - clock
            clock = now

        batch = next(self.batches)
        phase_ended('data')
        outputs = self.model(batch)
        phase_ended('forward')
        loss = self.model.loss(outputs, batch)
        phase_ended('loss')
        loss.backward()
        phase_ended('backward')
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Freeing the step's autograd graph and tensors takes milliseconds on a tiny model. Dropped at this
        # function's return, they would be timed as Composer's; Composer frees its own on the next step.
        del batch, outputs, loss
        phase_ended('optimizer')
        self.bare_steps.append(bare_step)
        self.phase_start = time.perf_counter()
        self.timer.seconds['events'] -= self.phase_start - entered

    def steady_steps(self, warmup: int) -> tuple[list[dict], list[dict], list[dict]]:
        """Bare steps, Composer steps and their host work after warm-up, the same number of each."""
        composer = self.composer_steps[warmup:]
        return self.bare_steps[warmup + 1 : warmup + 1 + len(composer)], composer, self.composer_parts[warmup:]


def interleaved_round(args, warmup: int) -> tuple[list[dict], list[dict], list[dict]]:
    with ComposerHostTimer() as timer:
        bare_loop = InterleavedBareLoop(args, timer)
        reproducibility.seed_all(args.seed)
        model = model_of(args)
        trainer = build_trainer(args, model, build_dataloader(args, model), callbacks=(bare_loop,))
        trainer.fit()
        trainer.close()
    return bare_loop.steady_steps(warmup)


def median_ms(steps: list[dict], key: str | None = None) -> float:
    """Median over steps of one phase (or part), or of their sum when key is None."""
    return 1000 * statistics.median(sum(step.values()) if key is None else step.get(key, 0.0) for step in steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--steps', type=int, default=60, help='steps per run')
    parser.add_argument('--warmup', type=int, default=10, help='steps left out at the start of each run')
    parser.add_argument('--rounds', type=int, default=3, help='runs, each with fresh models')
    parser.add_argument('--batch_size', type=int, default=16)
    parser.add_argument('--image_size', type=int, default=64)
    options, flags = parser.parse_known_args()
    mirrored = {'--precomputed_latents', '--fused_adamw', '--encoders_bf16', '--channels_last'}
    if set(flags) - mirrored:
        parser.error(f'only these benchmark.py flags have a bare-loop equivalent: {sorted(mirrored)}')
    if options.steps < options.warmup + 3:
        parser.error(f'--steps {options.steps}: at least --warmup + 3 ({options.warmup + 3})')
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
    bare, composer, parts, ratios = [], [], [], []
    for _ in range(options.rounds):
        round_bare, round_composer, round_parts = interleaved_round(args, options.warmup)
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
    for phase in (*PHASES, None):
        bare_ms, composer_ms = median_ms(bare, phase), median_ms(composer, phase)
        print(f'{phase or "step":<10} {bare_ms:8.2f} {composer_ms:9.2f} {composer_ms - bare_ms:+8.2f}')
    print(
        f'ratio      {median_ms(composer) / median_ms(bare):8.3f}  (target <= 1.05; '
        f'each round: {", ".join(f"{ratio:.3f}" for ratio in ratios)})'
    )
    print("\nComposer's own host work in its step, median ms:")
    for part in (*COMPOSER_PARTS, None):
        print(f'{part or "all":<11}{median_ms(parts, part):8.2f}')


if __name__ == '__main__':
    main()
