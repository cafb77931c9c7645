"""Composer's names this repo replaces or sets, in one place, each checked as it is installed
(guards/library_patches.py): a Composer whose name is gone or takes other arguments stops the program in one line
naming its version and the name, rather than train with the fix silently undone. docs/architecture.md lists them,
with why each exists and what would let it go.

- `collect_env.get_cpu_model`: the CPU's name read from /proc/cpuinfo, not by starting an interpreter.
- `checkpoint._torch_load_with_validation`: a checkpoint resumed from is read weights-only.
- `checkpoint._write_checkpoint_file`: a checkpoint that cannot be written is named with its cause in one line.
- `remote_uploader._upload_file_to_object_store`: a checkpoint whose upload fails for good is kept on disk.
- `CheckpointSaver._symlink_upload_wait_before_next_try_in_seconds`: a remote latest link pointed within 2 s.
- `Trainer._rng_state`: a checkpoint's random state restored mid-epoch too.
"""

import functools
from collections.abc import Callable
from pathlib import Path

from composer import Trainer
from composer.callbacks import CheckpointSaver
from composer.core import Callback
from composer.utils import checkpoint as composer_checkpoint
from composer.utils import collect_env, remote_uploader, reproducibility

from costs.results import cpu_name
from guards.library_patches import install, replaced
from runs.uploads import upload_or_keep

# The Trainer records the machine it runs on (collect_env.get_composer_env_dict), the CPU's name from py-cpuinfo, which
# starts a Python interpreter to ask the CPU: a second of every rank's start. The name is read from /proc/cpuinfo
# instead, as the results file reads it.
install(
    collect_env, 'get_cpu_model', (), "the CPU's name read without starting an interpreter", lambda original: cpu_name
)

# Composer points a remote save folder's latest link at a checkpoint only once a process of its own has seen the
# checkpoint there, looking every 30 s (CheckpointSaver's _symlink_upload_wait_before_next_try_in_seconds, which its
# tests set). A run stopped in that window resumed one checkpoint back and then stopped on "object already exists",
# and a stopped run waited up to 30 s to point the link, the whole of Slurm's and Kubernetes' default grace period.
# Every 2 s instead: a listing of the folder every 2 s while a checkpoint uploads.
REMOTE_CHECKPOINT_CHECK_SECONDS = 2


def load_checkpoints_weights_only(load_file: Callable) -> None:
    """Composer loads a checkpoint to resume from with torch.load(weights_only=False) (composer 0.32's
    checkpoint._torch_load_with_validation): here with load_file(path, map_location=...), the repo's weights-only
    load (runs/checkpoints.py). Covers an s3:// save folder, whose checkpoint only Composer reads."""

    def load(path, map_location: str):
        return load_file(composer_checkpoint._ensure_valid_checkpoint(path), map_location=map_location)

    why = 'a checkpoint resumed from is read weights-only'
    replaced(composer_checkpoint, '_ensure_valid_checkpoint', ('checkpoint_filepath',), why)  # called by `load`
    parameters = ('checkpoint_filepath', 'map_location')
    install(composer_checkpoint, '_torch_load_with_validation', parameters, why, lambda original: load)


def report_failed_writes(failed: Callable[[Path, Exception], Exception], written: Callable[[dict, Path], None]) -> None:
    """Composer's checkpoint writer, wrapped: a write that fails raises failed(file, error) instead, and a file
    written is handed to written(state_dict, file). Composer has no hook for either: torch.save raises a
    RuntimeError ('PytorchStreamWriter failed writing file ...') or an OSError, with a traceback that names
    neither the folder nor the cause."""

    def reporting(write):
        def write_or_report(state_dict, filename):
            try:
                write(state_dict, filename)
            except (OSError, RuntimeError) as error:
                raise failed(Path(filename), error) from error
            written(state_dict, Path(filename))

        return write_or_report

    why = 'a checkpoint that cannot be written is named with its cause'
    install(composer_checkpoint, '_write_checkpoint_file', ('state_dict', 'filename'), why, reporting)


def keep_failed_uploads(folder: Path) -> None:
    """Every later checkpoint upload of this process keeps a file it fails to upload in `folder` (runs/uploads.py)."""
    install(
        remote_uploader,
        '_upload_file_to_object_store',
        ('remote_backend_name', 'backend_kwargs', 'remote_file_name', 'local_file_path'),
        'a checkpoint whose upload fails for good is kept on disk',
        lambda original: functools.partial(upload_or_keep, keep_in=str(folder)),
    )


def check_remote_checkpoints_often(savers: list[CheckpointSaver]) -> None:
    """The savers to a remote save folder (checkpoints.remote_checkpoint_savers) look for an upload every 2 s."""
    name = '_symlink_upload_wait_before_next_try_in_seconds'
    for saver in savers:
        replaced(saver, name, (), 'a remote latest link pointed at a new checkpoint within 2 s')
        setattr(saver, name, REMOTE_CHECKPOINT_CHECK_SECONDS)


class RestoreRandomState(Callback):
    """Loads a checkpoint's random state (every generator, this rank's) before the first batch after it."""

    def __init__(self, rng_state: list[dict]):
        self.rng_state = rng_state

    def after_dataloader(self, state, logger) -> None:
        if self.rng_state is not None:
            reproducibility.load_rng_state(self.rng_state)
            self.rng_state = None


def restore_random_state_mid_epoch(trainer: Trainer) -> None:
    """Composer restores a checkpoint's random state at an epoch boundary, or while it fast-forwards a dataloader
    to the checkpoint's batch; a Streaming dataset resumes mid-epoch by itself, so there Composer never restores
    it, and the noise and timesteps of a resumed run restarted from the seed. Here the state Composer read
    (a private attribute of its Trainer) is restored at the point of the first batch the checkpoint did not
    train, where the uninterrupted run had it."""
    rng_state = replaced(trainer, '_rng_state', (), "a checkpoint's random state restored mid-epoch")
    resumes_itself = 'train' in trainer.state.dataset_resumption
    if rng_state is not None and resumes_itself and int(trainer.state.timestamp.batch_in_epoch) > 0:
        trainer.state.callbacks.append(RestoreRandomState(rng_state))
        trainer._rng_state = None
