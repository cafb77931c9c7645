"""The libraries' names this repo replaces (guards/library_patches.py): each patch checks what it replaces as it is
installed, the names hold on every stack CI runs (the pins, today's releases, a GPU image's packages), and a library
whose name changed stops a program in one line naming the package, its version and the name."""

import subprocess
import sys
import types

import pytest
import torch
from composer import Trainer
from composer.callbacks import CheckpointSaver
from composer.models import ComposerClassifier
from composer.utils import checkpoint as composer_checkpoint
from composer.utils import remote_uploader
from conftest import REPO, TINY

from guards import library_patches
from guards.library_patches import LibraryChanged, replaced

# Every name the repo replaces: (package, owner, name).
PATCHED = {
    ('streaming', 'streaming.base.storage.download', 'DOWNLOADER_MAPPINGS'),
    ('streaming', 'streaming.base.stream.Stream', 'get_shards'),
    ('streaming', 'streaming.base.dataset', 'get_shm_prefix'),
    ('streaming', 'streaming.base.shared.memory.SharedMemory', '__init__'),
    ('streaming', 'streaming.base.shared.prefix', '_check_and_find'),
    ('streaming', 'streaming.base.dataset.StreamingDataset', '_prepare_thread'),
    ('streaming', 'streaming.base.dataset.StreamingDataset', '_ready_thread'),
    ('composer', 'composer.utils.collect_env', 'get_cpu_model'),
    ('composer', 'composer.utils.remote_uploader', '_upload_file_to_object_store'),
    ('composer', 'composer.utils.checkpoint', '_ensure_valid_checkpoint'),
    ('composer', 'composer.utils.checkpoint', '_torch_load_with_validation'),
    ('composer', 'composer.utils.checkpoint', '_write_checkpoint_file'),
    (
        'composer',
        'composer.callbacks.checkpoint_saver.CheckpointSaver',
        '_symlink_upload_wait_before_next_try_in_seconds',
    ),
    ('composer', 'composer.trainer.trainer.Trainer', '_rng_state'),
}


@pytest.mark.stack
def test_every_patch_checks_what_it_replaces_and_each_holds_on_this_stack(tmp_path, monkeypatch):
    import data  # noqa: F401  installs Streaming's patches
    from runs import checkpoints, composer_fixes  # composer_fixes installs Composer's CPU name

    # The three installed when a run asks for them, undone after the test.
    for owner, name in (
        (remote_uploader, '_upload_file_to_object_store'),
        (composer_checkpoint, '_torch_load_with_validation'),
        (composer_checkpoint, '_write_checkpoint_file'),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    for _ in range(2):  # a second run in one process installs them again: checked against the library's own
        composer_fixes.keep_failed_uploads(tmp_path)
        composer_fixes.load_checkpoints_weights_only(checkpoints.composer_load(trust=False))
        composer_fixes.report_failed_writes(checkpoints.CheckpointWriteError.of, checkpoints.record_beside)
    # The two attributes of Composer's objects a run sets or reads, on objects of this Composer.
    saver = CheckpointSaver(folder=str(tmp_path))
    saver.remote_uploader = remote_uploader  # stands in for a remote save folder's uploader
    model = ComposerClassifier(torch.nn.Linear(2, 2), num_classes=2)
    trainer = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.state.callbacks.append(saver)
    composer_fixes.check_remote_checkpoints_often(checkpoints.remote_checkpoint_savers(trainer))
    composer_fixes.restore_random_state_mid_epoch(trainer)
    assert saver._symlink_upload_wait_before_next_try_in_seconds == composer_fixes.REMOTE_CHECKPOINT_CHECK_SECONDS
    saver.remote_uploader = None  # nothing to wait for as the Trainer closes
    trainer.close()
    assert set(library_patches.GUARDED) == PATCHED


def test_a_name_gone_or_reshaped_is_named_with_its_package_and_version():
    fake = types.ModuleType('streaming.fake')
    fake.reshaped = lambda streams_local, world: None
    with pytest.raises(LibraryChanged) as gone:
        replaced(fake, 'renamed', ('x',), 'a fix')
    version = library_patches.installed_version('streaming')
    assert str(gone.value) == (
        f'mosaicml-streaming {version}: streaming.fake.renamed is not there; this repo replaces it (a fix): install '
        'the version requirements.txt pins'
    )
    with pytest.raises(LibraryChanged, match=r'streaming\.fake\.reshaped takes \(streams_local, world\), where this'):
        replaced(fake, 'reshaped', ('streams_local', 'streams_remote'), 'a fix')
    assert replaced(fake, 'reshaped', ('streams_local',), 'a fix') is fake.reshaped  # leading parameters suffice


@pytest.mark.slow
def test_a_run_on_a_streaming_whose_patched_name_changed_stops_in_one_line(tmp_path):
    """As an upgrade that renamed Streaming's prefix check would: the run refuses to start, rather than train with
    the fix silently undone."""
    (tmp_path / 'sitecustomize.py').write_text(
        'from streaming.base.shared import prefix\ndel prefix._check_and_find  # renamed by a release\n'
    )
    command = [sys.executable, 'benchmark.py', *TINY, '--max_duration', '1ba']
    env = {'PYTHONPATH': str(tmp_path), 'PATH': '/usr/bin:/bin', 'HOME': str(tmp_path), 'CUDA_VISIBLE_DEVICES': ''}
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    version = library_patches.installed_version('streaming')
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.splitlines()[-1] == (
        f'error: mosaicml-streaming {version}: streaming.base.shared.prefix._check_and_find is not there; this repo '
        "replaces it (the prefix check's attachments closed): install the version requirements.txt pins"
    )
    assert 'Traceback' not in run.stderr
