"""Ctrl-C and SIGTERM (a Slurm or Kubernetes preemption) end a run with one line, and with a checkpoint of the batch
reached where one can be written on the way out.

Composer turns both signals into sys.exit(128 + signal) wherever the main thread is: the run ended with no word,
and without the batches trained since its last checkpoint. Here the first signal during training asks the run to
stop after the batch in progress: StopOnSignal then saves a checkpoint through Composer's checkpoint saver (one
process only: with several, each would have to reach the same batch before the write, and a rank that stops one
batch later waits forever for the others) and raises Stopped. A second signal, or one before training starts,
stops at once. The line names the batch reached and the newest checkpoint; the exit status is the signal's, 130
for SIGINT and 143 for SIGTERM.
"""

import os
import signal
import zipfile
from pathlib import Path

from composer.core import Callback, State

from checkpoints import CHECKPOINT_FILE
from config import RunConfig

SIGNALS = {signal.SIGINT: 'Ctrl-C (SIGINT)', signal.SIGTERM: 'SIGTERM'}


class Stopped(BaseException):
    """A run stopped by a signal; BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way
    out takes it for an error of its own."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.exit_status = 128 + signum


class StopOnSignal(Callback):
    def __init__(self, config: RunConfig):
        self.config = config
        self.writes_checkpoint = bool(config.save_folder) and config.world_size == 1
        self.pid = os.getpid()
        self.state: State | None = None  # set when training starts
        self.save_checkpoint = None  # the Trainer's save_checkpoint_to_save_folder, given once the Trainer exists
        self.requested: int | None = None
        self.previous = {}

    def install(self) -> None:
        self.previous = {signum: signal.signal(signum, self.handle) for signum in SIGNALS}

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum: int, frame) -> None:
        if os.getpid() != self.pid:
            return  # a loader worker forked from this process: the main process ends the run, and then the workers
        if self.state is not None and self.requested is None and self.writes_checkpoint:
            self.requested = signum
            print(f'{SIGNALS[signum]}: stopping after this batch, with a checkpoint; again to stop at once', flush=True)
            return
        raise Stopped(signum, self.describe(signum, checkpoint_written=False))

    def fit_start(self, state: State, logger) -> None:
        self.state = state

    def batch_end(self, state: State, logger) -> None:
        if self.requested is None:
            return
        self.save_checkpoint()
        raise Stopped(self.requested, self.describe(self.requested, checkpoint_written=True))

    def describe(self, signum: int, checkpoint_written: bool) -> str:
        """e.g. 'Ctrl-C (SIGINT): stopped at batch 3 of 12; checkpoint ep0-ba3-rank0.pt written in ckpt; rerun with
        --autoresume to continue'."""
        config = self.config
        if self.state is None:
            return f'{SIGNALS[signum]}: stopped before training started; nothing trained, no results written'
        reached = f'stopped at batch {int(self.state.timestamp.batch)} of {config.num_batches}'
        # --autoresume needs a --run_name; a run given none may resume under any name (checkpoints.check_resumable).
        resume = f'rerun the same command with {"--run_name NAME " * (config.run_name is None)}--autoresume to continue'
        if not config.save_folder:
            return f'{SIGNALS[signum]}: {reached}; no checkpoint (no --save_folder), no results written'
        newest = newest_checkpoint(config.save_folder)
        if '://' in config.save_folder:
            written = ", this batch's included" if checkpoint_written else ''
            return f'{SIGNALS[signum]}: {reached}; its checkpoints are in {config.save_folder}{written}; {resume}'
        if checkpoint_written:
            return f'{SIGNALS[signum]}: {reached}; checkpoint {newest} written in {config.save_folder}; {resume}'
        if newest is None:
            return f'{SIGNALS[signum]}: {reached}; no checkpoint written yet in {config.save_folder}'
        return f'{SIGNALS[signum]}: {reached}; the newest checkpoint is {newest} in {config.save_folder}; {resume}'


def newest_checkpoint(folder: str) -> str | None:
    """The name of the newest whole checkpoint file in a local save folder (None for a remote or an empty one)."""
    path = Path(folder)
    if '://' in folder or not path.is_dir():
        return None
    whole = [file for file in path.iterdir() if CHECKPOINT_FILE.match(file.name) and zipfile.is_zipfile(file)]
    if not whole:
        return None
    return max(whole, key=lambda file: int(CHECKPOINT_FILE.match(file.name).group(2))).name
