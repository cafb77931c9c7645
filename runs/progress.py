"""What a person reads while a run trains: Composer's progress bar on a terminal, plain lines in a file.

A progress bar redraws its line with cursor escapes (`\\x1b[A`), which a log file keeps as they are, and the last
redraw has no newline, so the line printed after training lands inside it. When the output is not a terminal the
run prints a line every few batches instead: one line, where Composer's ConsoleLogger prints each logged metric
on a line of its own at every interval.
"""

import sys
import time
from datetime import timedelta

from composer.core import Callback, State
from composer.utils import dist

LINES_PER_RUN = 20  # about this many lines a run, and on long runs one every MAX_INTERVAL batches at least
MAX_INTERVAL = 100


def draws_a_bar() -> bool:
    """Composer draws its bar on stderr: a bar only where that is a terminal."""
    return sys.stderr.isatty()


class ProgressLines(Callback):
    """e.g. `batch 8 of 12 (67%): loss 0.9717, 3.21 img/s, 0:00:02 elapsed, about 0:00:01 left`, on rank 0.
    The img/s is training's alone, as the summary's: time spent in validation and sample grids between two lines
    is left out (else the line after a sample grid would read as a collapse of the rate). The time left is reckoned
    from the batches after the first, which carries the start's one-off work (a compile takes minutes), else a short
    compiled run's first line would say it has many times its real length left."""

    def __init__(self, num_batches: int):
        self.num_batches = num_batches
        self.interval = max(1, min(MAX_INTERVAL, num_batches // LINES_PER_RUN))
        self.start = self.last = None
        self.first_end = None  # (time, batch) at the end of the run's first batch
        self.first_end_wall_clock = None  # time.time() then, for the results' provenance
        self.evaluation_start, self.evaluating = None, 0.0  # seconds of evaluation since the last line

    def fit_start(self, state: State, logger) -> None:
        self.start = self.last = (time.perf_counter(), int(state.timestamp.batch), int(state.timestamp.sample))
        self.first_end, self.evaluating = None, 0.0

    def eval_before_all(self, state: State, logger) -> None:
        self.evaluation_start = time.perf_counter()

    def eval_after_all(self, state: State, logger) -> None:
        if self.evaluation_start is not None:
            self.evaluating += time.perf_counter() - self.evaluation_start
            self.evaluation_start = None

    def batch_end(self, state: State, logger) -> None:
        batch = int(state.timestamp.batch)
        if self.first_end is None:
            self.first_end, self.first_end_wall_clock = (time.perf_counter(), batch), time.time()
        if dist.get_global_rank() != 0 or (batch % self.interval and batch != self.num_batches):
            return
        now, sample = time.perf_counter(), int(state.timestamp.sample)
        then, _, then_sample = self.last
        rate = (sample - then_sample) / max(now - then - self.evaluating, 1e-9)
        start, _, _ = self.start
        elapsed = now - start
        loss = state.loss.item() if hasattr(state.loss, 'item') else None  # one value, read every few batches
        parts = [f'loss {loss:.4f}'] if loss is not None else []
        parts += [f'{rate:.2f} img/s', f'{clock(elapsed)} elapsed']
        first_time, first_batch = self.first_end
        if batch == first_batch:
            parts.append("the start's one-off work included")
        elif batch < self.num_batches:
            left = (now - first_time) / (batch - first_batch) * (self.num_batches - batch)
            parts.append(f'about {clock(left)} left')
        print(
            f'batch {batch} of {self.num_batches} ({100 * batch // self.num_batches}%): {", ".join(parts)}', flush=True
        )
        self.last, self.evaluating = (now, batch, sample), 0.0


def clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
