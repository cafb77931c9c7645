"""Ctrl-C and SIGTERM (a Slurm or Kubernetes preemption) end a run with one line, and with a checkpoint of the batch
reached where one can be written on the way out.

Composer turns both signals into sys.exit(128 + signal) wherever the main thread is: the run ended with no word,
and without the batches trained since its last checkpoint. Here the first signal during training asks the run to
stop after the batch in progress: StopOnSignal then saves a checkpoint through Composer's checkpoint saver (one
process only: with several, each would have to reach the same batch before the write, and a rank that stops one
batch later waits forever for the others) and raises Stopped. A second signal, or one before training starts,
stops at once; one while that checkpoint is written sets the file aside as NAME.incomplete, whole or not. The
line names the batch reached and the newest whole checkpoint; the exit status is the signal's, 130 for SIGINT and
143 for SIGTERM. A signal to every process of the job (scancel, Ctrl-C) reaches the loader workers too: they leave it
to this process (loaders.StoppableDataLoader), as do the processes Composer spawns to upload checkpoints to a remote
save folder (benchmark.py). There the stop also waits for the checkpoint's upload and points the latest link at it
(checkpoints.finish_uploads), which Composer would do only at the end of training.
"""

import zipfile
from pathlib import Path

from composer.core import Callback, State

from guards.stopping import SIGNALS, STOPS, Stopped
from runs.checkpoints import CHECKPOINT_FILE, checkpoint_files, set_aside_incomplete
from settings.run_sections import BatchSection, OutputSection


class StopOnSignal(Callback):
    def __init__(self, outputs: OutputSection, batch: BatchSection):
        self.outputs, self.batch = outputs, batch
        self.writes_checkpoint = bool(outputs.save_folder) and batch.world_size == 1
        self.state: State | None = None  # set when training starts
        self.save_checkpoint = None  # the Trainer's save_checkpoint_to_save_folder, given once the Trainer exists
        self.finish_uploads = None  # for a remote save folder: waits for the uploads, then points the latest link
        self.requested: int | None = None

    def handle(self, signum: int) -> None:
        """The signal handler while the run trains (STOPS.handling)."""
        if self.state is not None and self.requested is None and self.writes_checkpoint:
            self.requested = signum
            print(f'{SIGNALS[signum]}: stopping after this batch, with a checkpoint; again to stop at once', flush=True)
            return
        STOPS.stop(Stopped(signum, self.describe(signum, checkpoint_written=False)))  # now, or once stops are not held

    def fit_start(self, state: State, logger) -> None:
        self.state = state

    def batch_end(self, state: State, logger) -> None:
        STOPS.check()  # one that came while a loader started its workers
        if self.requested is None:
            return
        folder = Path(self.outputs.save_folder)
        local = '://' not in self.outputs.save_folder
        before = set(checkpoint_files(folder)) if local and folder.is_dir() else set()
        try:
            self.save_checkpoint()
            if not local:
                self.finish_uploads()
        except Stopped as again:  # a second signal while the checkpoint was written
            if not local:
                raise
            raise Stopped(again.signum, self.set_aside_cut_short(again.signum, before)) from None
        raise Stopped(self.requested, self.describe(self.requested, checkpoint_written=True))

    def set_aside_cut_short(self, signum: int, before: set[Path]) -> str:
        """Renames the checkpoint file a second signal stopped NAME.incomplete, and links the latest to the newest
        whole one; returns the stop's line. torch.save, interrupted, still ends its zip archive: the file would pass
        for a whole checkpoint. One the write had finished is set aside too: the signal cannot say which it was."""
        folder = Path(self.outputs.save_folder)
        cut = [path for path in checkpoint_files(folder) if path not in before] if folder.is_dir() else []
        for path in cut:
            path.rename(path.with_name(f'{path.name}.incomplete'))
        if folder.is_dir():
            set_aside_incomplete(folder)
        return self.describe(signum, checkpoint_written=False, cut_short=cut[0].name if cut else None)

    def describe(self, signum: int, checkpoint_written: bool, cut_short: str | None = None) -> str:
        """e.g. 'Ctrl-C (SIGINT): stopped at batch 3 of 12; checkpoint ep0-ba3-rank0.pt written in ckpt; rerun with
        --autoresume to continue'."""
        outputs = self.outputs
        if self.state is None:
            return f'{SIGNALS[signum]}: stopped before training started; nothing trained, no results written'
        reached = f'stopped at batch {int(self.state.timestamp.batch)} of {self.batch.num_batches}'
        if cut_short:
            reached += f', while writing its checkpoint: {cut_short} set aside as {cut_short}.incomplete'
        # --autoresume needs a --run_name; a run given none may resume under any name (checkpoints.check_resumable).
        resume = (
            f'rerun the same command with {"--run_name NAME " * (outputs.run_name is None)}--autoresume to continue'
        )
        if not outputs.save_folder:
            return f'{SIGNALS[signum]}: {reached}; no checkpoint (no --save_folder), no results written'
        newest = newest_checkpoint(outputs.save_folder)
        if '://' in outputs.save_folder:
            if checkpoint_written:
                where = f'its checkpoint uploaded to {outputs.save_folder}, which the latest link there names'
                return f'{SIGNALS[signum]}: {reached}; {where}; {resume}'
            return f'{SIGNALS[signum]}: {reached}; its checkpoints are in {outputs.save_folder}; {resume}'
        if checkpoint_written:
            return f'{SIGNALS[signum]}: {reached}; checkpoint {newest} written in {outputs.save_folder}; {resume}'
        if newest is None:
            return f'{SIGNALS[signum]}: {reached}; no checkpoint written yet in {outputs.save_folder}'
        return f'{SIGNALS[signum]}: {reached}; the newest checkpoint is {newest} in {outputs.save_folder}; {resume}'


def newest_checkpoint(folder: str) -> str | None:
    """The name of the newest whole checkpoint file in a local save folder (None for a remote or an empty one)."""
    path = Path(folder)
    if '://' in folder or not path.is_dir():
        return None
    whole = [file for file in path.iterdir() if CHECKPOINT_FILE.match(file.name) and zipfile.is_zipfile(file)]
    if not whole:
        return None
    return max(whole, key=lambda file: int(CHECKPOINT_FILE.match(file.name).group(2))).name
