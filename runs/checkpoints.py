"""Checkpoint folders that a killed run cannot poison, and that only the run that wrote them resumes from.

Composer writes a checkpoint straight to its final name and then points `latest-rank0.pt` at it; autoresume
loads what that link names. A run killed while writing leaves a partial file: a resumed run then stops when it
reaches the same batch (Composer will not write over an existing file), and a partial file the link names
cannot be loaded at all. Before autoresume reads a local save folder, `set_aside_incomplete` renames every
incomplete checkpoint file and points the link at the newest complete one.

A run resumed over another run's checkpoints (another run name, model, image size, data mode or global batch size)
would stop in Composer's loading with a page of size mismatches, or, worse, train on at another setting. Each
checkpoint carries the settings of its run (`RunDescription`), and `check_resumable` compares them, and the UNet's
shapes, first.

A checkpoint that does not fit on its disk fails deep in torch.save's zip writer, with a traceback that names
neither the folder nor the cause; composer_fixes.report_failed_writes makes it a CheckpointWriteError that names both
(`CheckpointWriteError.of`).

A checkpoint is a pickle, and unpickling can run any code the file names: one planted in a save folder, or given to
generate.py, would run with the user's rights. Every checkpoint is read weights-only (`load_checkpoint_file`, and
Composer's own load through `composer_load`): tensors, plain values and the few types a
checkpoint of this repo holds; a file that needs more is refused unless the user trusts it (--trust_checkpoint).

With --save_num_checkpoints_to_keep N, Composer deletes the oldest checkpoint files past N as it writes each new
one (after the link points at the new one, so the newest whole checkpoint is never deleted), but counts only those
its own process wrote: `KeepNewestCheckpoints` hands it the ones a resumed run's earlier processes left, so that
the folder holds N across resumptions too. Files set aside as incomplete are not counted, and never deleted.
"""

import contextlib
import datetime
import functools
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
from botocore.exceptions import BotoCoreError, ClientError
from composer.callbacks import CheckpointSaver
from composer.core import Callback
from composer.utils import dist

from guards.arguments import ConfigError
from guards.outputs import DISK_FULL
from settings.config import RunConfig
from settings.dataset_checks import s3_client, s3_folder, s3_folder_names
from settings.run_record import write_run_description
from settings.run_sections import OutputSection

# What a Composer checkpoint of this repo holds besides tensors and plain values: the timestamp's total wall-clock
# time, NumPy's random state (an array and its dtypes), and the torch version it was saved with. NumPy 2 moved
# _reconstruct to numpy._core (numpy.core, deprecated, warns): a checkpoint pickled under either name loads.
NUMPY_RECONSTRUCT = (getattr(np, '_core', None) or np.core).multiarray._reconstruct
CHECKPOINT_TYPES = [
    datetime.timedelta,
    torch.torch_version.TorchVersion,
    np.ndarray,
    np.dtype,
    *{type(np.dtype(name)) for name in ('uint32', 'int64', 'float64')},
    (NUMPY_RECONSTRUCT, 'numpy.core.multiarray._reconstruct'),
    (NUMPY_RECONSTRUCT, 'numpy._core.multiarray._reconstruct'),
]
TRUST_FLAG = '--trust_checkpoint'
RESUMED = '--autoresume: the checkpoint'

# Composer's default names for the file rank 0 writes (all of a DDP or full-state FSDP checkpoint) and its link.
CHECKPOINT_FILE = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
LATEST_LINK = 'latest-rank0.pt'


def load_checkpoint_file(path, *, trust=False, mmap=False, map_location='cpu', what='--checkpoint'):
    """torch.load of a checkpoint, weights-only unless trusted: ConfigError naming the type a file would need
    beyond CHECKPOINT_TYPES, code that loading it would run, instead of running it."""
    if trust:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(CHECKPOINT_TYPES):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        # A name beyond the allowed types is refused as code; any other failure (a damaged pickle) goes on as it is.
        named = re.search(r'\bGLOBAL ([\w.]+)', str(error))
        if named is None:
            raise
        raise ConfigError(
            f'{what} {path}: refused, it names code that loading would run ({named.group(1)}, not a type a '
            f'checkpoint of benchmark.py holds); pass {TRUST_FLAG} only if you trust whoever wrote it'
        ) from None


def composer_load(trust: bool):
    """load_checkpoint_file for a checkpoint Composer resumes from (composer_fixes.load_checkpoints_weights_only)."""
    return functools.partial(load_checkpoint_file, trust=trust, what=RESUMED)


def remote_checkpoint_savers(trainer) -> list[CheckpointSaver]:
    """The Trainer's checkpoint savers that upload to a remote save folder (s3:// and the like)."""
    savers = [callback for callback in trainer.state.callbacks if isinstance(callback, CheckpointSaver)]
    return [saver for saver in savers if saver.remote_uploader is not None]


def finish_uploads(trainer) -> None:
    """Waits for the checkpoint uploads in flight to a remote save folder and points its latest link at the newest,
    as Composer does when training ends (CheckpointSaver.fit_end): for a run stopped before its end, so that
    --autoresume continues from the checkpoint the stop wrote."""
    for saver in remote_checkpoint_savers(trainer):
        saver.fit_end(trainer.state, trainer.logger)


def point_s3_link_at_newest(save_folder: str) -> str | None:
    """--autoresume on an s3:// save folder: the latest link trails each new checkpoint until Composer has seen the
    checkpoint's upload land, and a run killed outright in between left it a checkpoint behind. The resumed run
    then trained those batches again and stopped at the newer checkpoint on `Object ... already exists` (Composer
    does not write over an object). An S3 object appears whole or not at all, so the newest checkpoint there is
    whole: the link is pointed at it. Returns the line saying so, where the link moved."""
    names = s3_folder_names(save_folder)
    batches = {int(match.group(2)): name for name in names or () if (match := CHECKPOINT_FILE.match(name))}
    if not batches:
        return None  # nothing to resume from, or a folder Composer's own check of its credentials reports on
    bucket, prefix = s3_folder(save_folder)
    newest, link = f'{prefix}{batches[max(batches)]}', f'{prefix}{LATEST_LINK}.symlink'  # the link holds a key
    client, has_link = s3_client(), f'{LATEST_LINK}.symlink' in names
    try:
        named = client.get_object(Bucket=bucket, Key=link)['Body'].read().decode().strip() if has_link else None
        if named == newest:
            return None
        client.put_object(Bucket=bucket, Key=link, Body=newest.encode())
    except (BotoCoreError, ClientError):
        return None  # left to Composer, as above
    was = f'named {named.rsplit("/", 1)[-1]}' if named else 'was missing'
    return (
        f'the latest link in {save_folder} {was}, behind the newest checkpoint {newest.rsplit("/", 1)[-1]} (its '
        'run was stopped before it could point the link at it): pointed at the newest, which this run resumes from'
    )


def s3_resume_copy(save_folder: str) -> Path:
    """Where Composer downloads the checkpoint an s3:// save folder's latest link names, to resume from it: the
    folder's URL read as a path under the working directory (`s3:/bucket/prefix/latest-rank0.pt`)."""
    return Path(os.path.abspath(os.path.join(save_folder, LATEST_LINK)))


def remove_s3_resume_copy(save_folder: str) -> None:
    """Composer resumes from that copy whenever it exists, without asking S3 again: one that an earlier resumption
    left in the same working directory (a requeued job's) made the next one resume from it rather than from the
    newest checkpoint, and it kept a whole checkpoint on the local disk. Removed before the Trainer loads and once
    it has, with the folders made for it where they are empty (never the working directory)."""
    copy = s3_resume_copy(save_folder)
    copy.unlink(missing_ok=True)
    for folder in [copy.parent, *copy.parent.parents]:
        if folder == Path.cwd() or not folder.is_dir() or any(folder.iterdir()):
            break
        folder.rmdir()


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint files in a folder, oldest first: not the link, nor files set aside as NAME.incomplete."""
    files = [path for path in folder.iterdir() if CHECKPOINT_FILE.match(path.name) and not path.is_symlink()]
    return sorted(files, key=lambda path: int(CHECKPOINT_FILE.match(path.name).group(2)))  # by batch


def set_aside_incomplete(folder: Path) -> list[str]:
    """Renames incomplete checkpoint files to NAME.incomplete and links `latest-rank0.pt` to the newest complete
    one; returns a line for each thing it changed. A complete file is a whole zip archive (torch.save's format,
    whose index is written last); sharded checkpoints (folders) are left to Composer."""
    changes, complete = [], []
    for path in checkpoint_files(folder):
        if zipfile.is_zipfile(path):
            complete.append(path)
            continue
        aside = path.with_name(path.name + '.incomplete')
        path.rename(aside)
        changes.append(f'{path}: an incomplete checkpoint (a run killed while writing it?): renamed {aside.name}')
    latest = folder / LATEST_LINK
    if complete and (not latest.is_symlink() or latest.resolve() != complete[-1].resolve()):
        linked = latest.readlink().name if latest.is_symlink() else None
        was = (
            'nothing'
            if linked is None
            else linked
            if linked in {path.name for path in complete}
            else f'{linked}, incomplete'
        )
        latest.unlink(missing_ok=True)
        latest.symlink_to(complete[-1].name)
        changes.append(f'{latest}: now links the newest complete checkpoint {complete[-1].name} (it linked {was})')
    return changes


class CheckpointWriteError(Exception):
    """Writing a checkpoint file failed (a full disk, a folder removed or turned read-only): the file, its folder
    and the reason."""

    def __init__(self, file: Path, reason: str, full: bool = True):
        self.file = file
        if full:
            free = shutil.disk_usage(file.parent).free / 1e9 if file.parent.is_dir() else 0.0
            super().__init__(f'checkpoint {file.name} did not fit ({reason}; {free:.1f} GB free there)')
        else:
            super().__init__(f'checkpoint {file.name} could not be written ({reason})')

    @classmethod
    def of(cls, file: Path, error: Exception) -> 'CheckpointWriteError':
        """The error torch.save raised, read: torch's zip writer says only 'file write failed', the usual cause a
        full disk; an OSError says which."""
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[-1]
        full = not isinstance(error, OSError) or error.errno in DISK_FULL
        return cls(file, reason.strip(), full)


def record_beside(state_dict: dict, checkpoint: Path) -> None:
    """The run's record (RunDescription's) as run_description.json beside a checkpoint file rank 0 has written, so
    that generate.py reads it without loading torch. One that cannot be written (a disk full just then) is left out:
    the checkpoint holds the same record, which generate.py reads once torch loads it."""
    description = state_dict.get('state', {}).get('callbacks', {}).get(RunDescription.__name__)
    if description is not None and dist.get_global_rank() == 0:
        with contextlib.suppress(OSError):
            write_run_description(checkpoint.parent, description)


class KeepNewestCheckpoints(Callback):
    """Adds the checkpoint files already in the save folder, oldest first, to those Composer's checkpoint saver
    counts against save_num_checkpoints_to_keep, so that a resumed run deletes its earlier processes' oldest too.
    Rank 0 writes the whole files and deletes them; sharded checkpoints (folders) are left to Composer."""

    def __init__(self, folder: Path):
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        if dist.get_global_rank() != 0 or state.fsdp_sharded_state_dict_enabled or not self.folder.is_dir():
            return
        saver = next(callback for callback in state.callbacks if isinstance(callback, CheckpointSaver))
        counted = {Path(path).resolve() for path in saver.saved_checkpoints}
        earlier = [str(path) for path in checkpoint_files(self.folder) if path.resolve() not in counted]
        saver.saved_checkpoints[:0] = earlier  # deleted oldest first, at the next checkpoint written


def keep_newest_checkpoints(outputs: OutputSection) -> tuple:
    """The Trainer's callbacks for --save_num_checkpoints_to_keep: none where every checkpoint is kept."""
    if outputs.save_num_checkpoints_to_keep == -1:
        return ()
    return (KeepNewestCheckpoints(Path(outputs.save_folder)),)


def run_description(config: RunConfig) -> dict:
    """The settings a checkpoint must share with the run that resumes from it."""
    return {
        'run_name': config.outputs.run_name,
        'model_name': config.model.model_name,
        'image_size': config.data.image_size,
        'precomputed_latents': config.data.precomputed_latents,
        'batch_size': config.batch.batch_size,  # another batch changes the data order and the steps under the run
        'flux_guidance': config.objective.flux_guidance,  # what a guidance-distilled Flux trains at, and samples with
        # Streaming resumes mid-epoch by sample index: onto other data it reads other samples, or stops with a
        # traceback where the data is now smaller than the point reached.
        'dataset_identity': config.data.dataset_identity,
    }


def drawing_settings(config: RunConfig) -> dict:
    """What generate.py draws a checkpoint with besides the model: the prediction type it trained (None: the model's
    own) and the tokenizer folder it read captions with (None: the default), as an absolute path that holds from any
    folder."""
    return {
        'prediction_type': config.model.prediction_type,
        'tokenizer': str(Path(config.data.tokenizer).resolve()) if config.data.tokenizer else None,
    }


class RunDescription(Callback):
    """Saves run_description() in every checkpoint (Composer keeps each callback's state_dict there), and what is
    recorded but not compared: the CPU thread count the weights were trained with, which a resumed run's settling
    takes (settings/run_record.py), the microbatch, which a run on an exported folder takes, and drawing_settings(),
    which generate.py takes. The same record is written beside each checkpoint file (record_beside)."""

    def __init__(self, config: RunConfig):
        self.description = {
            **run_description(config),
            'cpu_threads': config.data.cpu_threads,
            'device_train_microbatch_size': config.batch.device_train_microbatch_size,
            **drawing_settings(config),
        }

    def state_dict(self) -> dict:
        return dict(self.description)

    def load_state_dict(self, state: dict) -> None:
        pass  # compared before loading, by check_resumable


def check_resumable(folder: Path, config: RunConfig, model: torch.nn.Module, rank: int = 0) -> dict:
    """Raises ConfigError naming what differs between this run and the checkpoint autoresume would load: a
    setting of run_description(), or the trained network's (model.denoiser's) parameter shapes. Returns the
    checkpoint's RunDescription ({} where it has none). Reads the checkpoint memory-mapped, so that only its small
    parts are read from disk."""
    latest = folder / f'latest-rank{rank}.pt'
    if not latest.is_file():
        return {}
    try:
        state = load_checkpoint_file(latest, trust=config.outputs.trust_checkpoint, mmap=True, what=RESUMED)['state']
    except (OSError, RuntimeError, KeyError, pickle.UnpicklingError):
        return {}  # not a checkpoint file this check can read (Composer's own loading reports what is wrong)
    where = f'--autoresume: the checkpoint {latest.resolve()} is of another run'
    saved = state.get('callbacks', {}).get(RunDescription.__name__)
    if saved is not None:  # written by this version or later
        here = run_description(config)
        # A setting the checkpoint does not record (an older version's, or a run given no --run_name) is not compared.
        differ = [
            f'{key} {saved[key]!r} there, {here[key]!r} here' for key in here if saved.get(key) not in (None, here[key])
        ]
        if saved.get('dataset_identity') not in (None, here.get('dataset_identity')):
            data = config.data.remote or config.data.local or "this run's data"
            raise ConfigError(
                f'--autoresume: the checkpoint {latest.resolve()} trained on a dataset of '
                f'{saved["dataset_identity"]}; {data} now holds {here.get("dataset_identity") or "other data"} '
                '(converted again, or replaced): resume on the data it trained on, or start over with a new '
                '--save_folder'
            )
        if differ:
            raise ConfigError(f'{where}: {"; ".join(differ)}; pass its flags, or a new --save_folder')
    prefix = f'{model.denoiser_name}.'
    shapes = {name: tuple(p.shape) for name, p in model.denoiser.state_dict().items()}
    saved_shapes = {
        name.removeprefix(prefix): tuple(tensor.shape)
        for name, tensor in state['model'].items()
        if name.startswith(prefix)
    }
    differ = [name for name in shapes if saved_shapes.get(name) != shapes[name]]
    differ += [name for name in saved_shapes if name not in shapes]
    if saved_shapes and differ:  # no names under the prefix: a layout this check does not know, left to Composer
        name = differ[0]
        there, here = (list(side[name]) if name in side else 'absent' for side in (saved_shapes, shapes))
        raise ConfigError(
            f'{where}: {len(differ)} {model.denoiser_name} parameter(s) differ, e.g. {name} is {there} there, '
            f'{here} here '
            '(another model?); pass its flags, or a new --save_folder'
        )
    return saved or {}
