"""Composer's Trainer and a bare PyTorch loop of an identical model, stepped in turn and timed phase by phase: the
measurement behind benchmarks/framework_overhead.py (whose docstring says how and why)."""

import functools
import time

from composer.algorithms.channels_last import apply_channels_last
from composer.core import Callback, Engine, Event, State
from composer.loggers import Logger
from composer.trainer import trainer as composer_trainer
from composer.utils import reproducibility

from models.stable_diffusion import build_model
from runs.training import build_dataloader, build_optimizer, build_trainer


def model_of(args):
    return build_model(
        args.model.model_folder, precomputed=args.data.precomputed_latents, encoders_bf16=args.speed.encoders_bf16
    )


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
        reproducibility.seed_all(args.batch.seed)
        self.model = model_of(args)
        if args.speed.channels_last:  # what Composer's ChannelsLast algorithm does to the other model at INIT
            apply_channels_last(self.model)
        self.optimizer = build_optimizer(args.objective, args.speed, self.model)
        self.model.train()
        self.batches = iter(build_dataloader(args.data, args.batch, args.speed, args.model.caption_inputs, self.model))
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
        reproducibility.seed_all(args.batch.seed)
        model = model_of(args)
        loader = build_dataloader(args.data, args.batch, args.speed, args.model.caption_inputs, model)
        trainer = build_trainer(args, model, loader, callbacks=(bare_loop,))
        trainer.fit()
        trainer.close()
    return bare_loop.steady_steps(warmup)
