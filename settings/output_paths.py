"""Where a run writes, checked before anything is built rather than after hours of training: checkpoints
(--save_folder), the results file, profiler traces, sample grids and exports. An output folder is never overwritten,
a folder Composer would read as another one is refused, and each place is tried for writing (config.py's steps
`settle_outputs` and `settle_evaluation`)."""

import argparse
import importlib.util
import re
import shutil
import tempfile
import time
import urllib.parse
from pathlib import Path

from guards.arguments import ConfigError
from guards.writer_lock import WRITE_CHECK_PREFIX, contents
from settings.dataset_checks import s3_folder_names


def check_name(flag: str, name: str | None) -> None:
    """A name that becomes part of a path (the sample grids' folder, W&B's run folder) stays one folder's name: a
    separator or '..' in it would write outside the folder meant for it."""
    if name is not None and ('/' in name or '\\' in name or name in ('', '.', '..')):
        raise ConfigError(
            f"{flag} '{name}': a name, not a path (no / or \\, not . or ..); it names a folder of the run"
        )


def check_outputs(flags: argparse.Namespace) -> None:
    """Output folders are checked now, not after hours of training, and never overwritten."""
    check_name('--run_name', flags.run_name)
    check_name('--wandb_name', flags.wandb_name)
    if flags.profile:
        refuse_used_output_folder('--profile', flags.profile, 'traces are never overwritten')
        check_writable_folder('--profile', flags.profile)
    if flags.export_ema_unet:
        refuse_used_output_folder('--export_ema_unet', flags.export_ema_unet, 'an export never overwrites weights')
        check_writable_folder('--export_ema_unet', flags.export_ema_unet)
    if flags.wandb_project and importlib.util.find_spec('wandb') is None:
        raise ConfigError('--wandb_project needs the wandb package: pip install wandb (it leaves torch as it is)')
    if flags.autoresume and not (flags.save_folder and flags.run_name):
        raise ConfigError('--autoresume needs --save_folder and --run_name (Composer finds the checkpoint by both)')
    if flags.autoresume and flags.fsdp_state_dict_type == 'sharded' and not flags.trust_checkpoint:
        raise ConfigError(
            '--autoresume with --fsdp_state_dict_type sharded: torch.distributed.checkpoint reads a sharded '
            'checkpoint by unpickling its metadata, which runs any code the files name; pass --trust_checkpoint to '
            'resume from one whose writer you trust (full checkpoints are read weights-only)'
        )
    check_save_folder(flags)
    if flags.results_json:
        check_writable_file('--results_json', flags.results_json)


def check_save_folder(flags: argparse.Namespace) -> None:
    """--save_folder: a folder Composer writes where it is named, new (or the earlier run's, with --autoresume),
    writable; and --save_num_checkpoints_to_keep only where the checkpoints are local."""
    if flags.save_folder:
        refuse_what_composer_changes('--save_folder', flags.save_folder)
    local_save_folder = flags.save_folder and '://' not in flags.save_folder
    if local_save_folder and Path(flags.save_folder).exists() and not Path(flags.save_folder).is_dir():
        raise ConfigError(f'--save_folder {flags.save_folder}: is a file, not a folder of checkpoints')
    if local_save_folder and not flags.autoresume:
        # Composer refuses too, with a traceback that does not say how to continue the earlier run.
        refuse_used_output_folder(
            '--save_folder',
            flags.save_folder,
            "checkpoints are never overwritten; or pass --autoresume with the earlier run's --run_name to continue it",
        )
    if local_save_folder:  # else trained until the first checkpoint, then stopped by an OSError traceback
        check_writable_folder('--save_folder', flags.save_folder)
    if flags.save_folder and flags.save_folder.startswith('s3://') and not flags.autoresume:
        refuse_used_s3_save_folder(flags.save_folder)
    if flags.save_num_checkpoints_to_keep != -1 and not local_save_folder:
        # Composer deletes only its local copies: a remote folder's checkpoints would all stay.
        raise ConfigError(
            f'--save_num_checkpoints_to_keep {flags.save_num_checkpoints_to_keep}: deletes checkpoints of a local '
            f'--save_folder only ({flags.save_folder or "none given"}); pass one, or leave the flag out'
        )


# A checkpoint or the latest link as Composer names them in a save folder (any rank's).
CHECKPOINT_OBJECT = re.compile(r'^(ep\d+-ba\d+-rank\d+\.pt|latest-rank\d+\.pt\.symlink)$')


def refuse_used_s3_save_folder(folder: str) -> None:
    """An s3:// --save_folder that holds checkpoints, given without --autoresume: Composer trained up to its first
    checkpoint, found the object there and stopped in two lines (`Object ... already exists`), the batches lost.
    A folder that cannot be listed is left to Composer, which checks its credentials first."""
    names = s3_folder_names(folder)
    if names is None:
        return
    held = sorted(name for name in names if CHECKPOINT_OBJECT.match(name))
    if held:
        raise ConfigError(
            f'--save_folder {folder}: holds checkpoints ({", ".join(held[:2])}{", ..." * (len(held) > 2)}); give a '
            "new folder (checkpoints are never overwritten), or pass --autoresume with the earlier run's --run_name "
            'to continue it'
        )


def settle_sample_folder(sample_dir: str | None, sample_interval: str | None, run_name: str | None) -> str | None:
    """The sample grids' folder (results/samples/RUN by default, where grids are drawn), writable."""
    if sample_dir is None and sample_interval:
        sample_dir = str(Path('results', 'samples', run_name or time.strftime('%Y%m%d-%H%M%S')))
    if sample_dir and Path(sample_dir).is_file():
        raise ConfigError(f'--sample_dir {sample_dir}: is a file; give a folder')
    if sample_dir:
        check_writable_folder('--sample_dir', sample_dir)
    return sample_dir


def check_export_folder(export_pipeline: str | None) -> None:
    """The pipeline export's folder: new, writable."""
    if export_pipeline:
        refuse_used_output_folder('--export_pipeline', export_pipeline, 'an export never overwrites weights')
        check_writable_folder('--export_pipeline', export_pipeline)


def refuse_what_composer_changes(flag: str, folder: str) -> None:
    """Composer reads a checkpoint folder as a URL: a '#' or '?' (and ';' in the last name) would end its path there.
    It also fills the folder in as a template ({run_name}, {rank}), and again each path in it as it saves, so no
    escaping keeps a brace; and this run reads the folder as given (--autoresume, the checks at start). Either way
    the checkpoints would go to another folder than the one named."""
    if '{' in folder or '}' in folder:
        raise ConfigError(
            f'{flag} {folder}: Composer fills in braces as a template ({{run_name}}, {{rank}}), where this run '
            "reads the folder as given: the checkpoints would go to another folder; give one without '{' or '}'"
        )
    url = urllib.parse.urlparse(folder if '://' in folder else f'./{folder}')
    cut = {'#': url.fragment, '?': url.query, ';': url.params}
    for char, rest in cut.items():
        if rest:
            raise ConfigError(
                f"{flag} {folder}: Composer reads it as a URL, whose path ends before the '{char}': the checkpoints "
                "would go to another folder; give one without '#', '?' or ';'"
            )


def check_writable_file(flag: str, file: str) -> None:
    """A file that can be written once the run ends: not a folder, under a folder that exists or can be made."""
    path = Path(file)
    if path.is_dir():
        raise ConfigError(f'{flag} {file}: is a folder; give a file name')
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f'{flag} {file}: {parent} is a file, so no folder can be made there')
    check_writable_folder(flag, str(path.parent), given=file)  # permission bits, read-only filesystems, quotas


def check_writable_folder(flag: str, folder: str, given: str | None = None) -> None:
    """The run can write in `folder`, or make it: a scratch folder with a small file in it is made and removed there,
    or in its nearest existing parent. Tried rather than read from the permission bits, which say nothing to root,
    and a read-only filesystem or a full disk or quota shows only on writing (a full disk still makes folders, not
    files). Nothing is left behind. `given`: the flag's value, if not the folder itself (a file in it)."""
    parent = Path(folder)
    while not parent.exists():
        parent = parent.parent
    scratch = None
    try:
        scratch = tempfile.mkdtemp(dir=parent, prefix=WRITE_CHECK_PREFIX)
        Path(scratch, 'probe').write_bytes(bytes(4096))
    except OSError as error:
        raise ConfigError(f'{flag} {given or folder}: cannot write in {parent} ({error.strerror or error})') from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def refuse_used_output_folder(flag: str, folder: str, why: str) -> None:
    path = Path(folder)
    if path.is_file() or (path.is_dir() and contents(path)):  # a lock file a killed writer left is no output
        problem = 'is a file' if path.is_file() else 'is not empty'
        raise ConfigError(f'{flag} {folder}: {problem}; give a new folder ({why})')
