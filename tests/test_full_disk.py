"""A full disk under every writer ends the script with one `error:` line naming the output, the reason and the fix,
exit status 1, no traceback, and nothing left that looks whole: convert.py's and precompute.py's shards, the exported
pipeline, the sample grids, generate.py's images, report.py's CSV and figure, and Streaming's shard cache.

The disk is a real one: a small tmpfs mounted for the test (root only; skipped elsewhere), so that every library's own
writer (Streaming's, safetensors', PIL's, matplotlib's) meets ENOSPC as it would on a full disk.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, TINY, good_samples, jpeg, run_process, skip_unless_ci, write_dataset

from guards import outputs
from guards.outputs import WriteFailed, staged_file, staged_folder

# The tiny model on random tensors, as quick as a run gets.
QUICK = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '2ba']


@pytest.fixture
def disk():
    """A folder on a filesystem of its own, 64 KiB: fill() leaves it as little room as a test needs, grow() gives it
    room again. A short path: as TMPDIR it holds the loader workers' sockets, whose paths must stay under 108 bytes
    (`AF_UNIX path too long` under pytest's long temporary folders)."""
    mount = Path(tempfile.mkdtemp(prefix='disk-', dir='/tmp'))
    mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=64k', 'tmpfs', str(mount)], capture_output=True)
    if mounted.returncode:
        mount.rmdir()
        skip_unless_ci(f'cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}')
    yield mount
    subprocess.run(['umount', '-l', str(mount)], check=False)
    shutil.rmtree(mount, ignore_errors=True)


def fill(disk: Path, room: int) -> None:
    """Leaves about `room` bytes free on the disk (tmpfs counts whole 4 KiB pages)."""
    stats = os.statvfs(disk)
    (disk / '.filler').write_bytes(bytes(max(0, stats.f_bavail * stats.f_frsize - room)))


def grow(disk: Path, size: str = '64m') -> None:
    subprocess.run(['mount', '-o', f'remount,size={size}', str(disk)], check=True)


def script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'OMP_NUM_THREADS': '1', **(env or {})}
    command = [sys.executable, str(REPO / name), *args]
    return run_process(command, cwd=REPO, env=environment, timeout=600)


def one_line(run: subprocess.CompletedProcess, status: int) -> str:
    """The run's one error line, checked: its exit status, no traceback, no other error."""
    assert run.returncode == status, run.stderr[-3000:]
    assert 'Traceback' not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.replace('\r', '\n').splitlines() if line.strip()]
    assert lines[-1].startswith('error: ') and run.stderr.count('error:') == 1, run.stderr[-3000:]
    return lines[-1]


def contents(disk: Path) -> list[str]:
    return sorted(str(path.relative_to(disk)) for path in disk.rglob('*') if path.name != '.filler')


@pytest.fixture(scope='module')
def images(tmp_path_factory) -> Path:
    """30 captioned JPEGs of about 10 KB each: 300 KB of shards, more than the disk holds."""
    folder = tmp_path_factory.mktemp('images')
    for i in range(30):
        (folder / f'{i:02d}.jpg').write_bytes(jpeg(i, (200, 160)))
        (folder / f'{i:02d}.txt').write_text(f'photo number {i}')
    return folder


# ------------------------------------------------------------------------------------------- convert.py


def test_convert_on_a_full_disk_is_one_line_and_leaves_no_output(disk, images):
    out = disk / 'mds'
    line = one_line(script('convert.py', str(images), str(out), '--size_limit', '16kb'), 1)
    assert line == (
        f'error: {out}: No space left on device; the output is left as it was: free space there, then convert again'
    )
    assert contents(disk) == []  # no output folder, no staging folder, no lock


def test_convert_over_an_earlier_output_on_a_full_disk_leaves_it_whole(disk, images):
    out = Path(write_dataset(disk / 'mds', good_samples(2, (32, 32))))
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    fill(disk, 8192)
    line = one_line(script('convert.py', str(images), str(out), '--overwrite', '--size_limit', '16kb'), 1)
    assert line.startswith(f'error: {out}: No space left on device; the output is left as it was')
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_the_sample_dataset_that_does_not_fit_leaves_no_part_of_itself(disk):
    from datapath.sample_dataset import ensure_sample_dataset

    with pytest.raises(WriteFailed) as failed:
        ensure_sample_dataset(disk / 'sample-mds', num_samples=40)  # about 25 KB each
    assert str(failed.value) == (
        f'{disk / "sample-mds"} (the sample dataset): No space left on device; nothing written: free space there, '
        'then run again, which builds it'
    )
    assert contents(disk) == []


# ------------------------------------------------------------------------------------------ precompute.py


@pytest.mark.slow
def test_precompute_on_a_full_disk_keeps_finished_parts_and_the_same_command_finishes(disk, tmp_path):
    source = write_dataset(tmp_path / 'mds', good_samples(12, (32, 32)))
    out = disk / 'latents'
    flags = ['--local', source, '--out', str(out), '--image_size', '32', '--part_size', '4']
    fill(disk, 24 * 1024)  # room for the settings and about one part
    line = one_line(script('precompute.py', *flags), 1)
    assert line.startswith(f'error: --out {out}: No space left on device; part-0000')
    assert line.endswith(
        ' was removed, the parts finished are kept: free space there, then run the same command again '
        'to finish the rest'
    )
    parts = sorted(path.name for path in out.glob('part-*'))
    assert all((out / part / 'index.json').is_file() for part in parts)  # no part without its index: each is whole
    assert not (out / 'index.json').exists()
    grow(disk)
    finished = script('precompute.py', *flags)
    assert finished.returncode == 0, finished.stderr[-3000:]
    index = json.loads((out / 'index.json').read_text())
    assert sum(shard['samples'] for shard in index['shards']) == 12


# ------------------------------------------------------------------------------------------- benchmark.py


def test_an_export_that_does_not_fit_is_one_line_and_leaves_no_pipeline(disk):
    out = disk / 'pipeline'
    line = one_line(script('benchmark.py', *QUICK, '--export_pipeline', str(out)), 1)
    assert line == (
        f'error: --export_pipeline {out}: No space left on device; the partial output was removed: free space there, '
        'then run again'
    )
    assert contents(disk) == []


@pytest.mark.slow
def test_an_export_that_does_not_fit_names_autoresume_when_the_run_has_checkpoints(disk, tmp_path):
    out = disk / 'pipeline'
    flags = ['--save_folder', str(tmp_path / 'ckpt'), '--run_name', 'r', '--export_pipeline', str(out)]
    line = one_line(script('benchmark.py', *QUICK, *flags), 1)
    assert line.endswith(
        'free space there, then rerun the same command with --autoresume, which exports its last checkpoint'
    )
    grow(disk)
    exported = script('benchmark.py', *QUICK, *flags, '--autoresume')
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (out / 'model_index.json').is_file() and (out / 'unet' / 'diffusion_pytorch_model.safetensors').is_file()


def test_a_sample_grid_that_does_not_fit_is_one_line_and_leaves_no_part_of_an_image(disk):
    samples = disk / 'samples'
    fill(disk, 4096)  # the folder's write check passes; a grid does not fit
    line = one_line(script('benchmark.py', *QUICK, '--sample_interval', '1ba', '--sample_dir', str(samples)), 1)
    assert line.startswith(f'error: --sample_dir {samples}: No space left on device; ')
    assert not list(samples.glob('*.png')) and not list(samples.glob('.*'))


# ------------------------------------------------------------------------------------------- generate.py


@pytest.fixture(scope='module')
def pipeline(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('export') / 'pipeline'
    exported = script('benchmark.py', *QUICK, '--export_pipeline', str(folder))
    assert exported.returncode == 0, exported.stderr[-3000:]
    return folder


def test_generate_on_a_full_disk_is_one_line_and_leaves_no_images(disk, pipeline):
    out = disk / 'images'
    fill(disk, 4096)
    prompts = ['--prompt', 'a red circle', '--prompt', 'a blue square', '--steps', '1']
    line = one_line(script('generate.py', '--pipeline', str(pipeline), *prompts, '--out', str(out)), 1)
    assert line == (
        f'error: --out {out}: No space left on device; the partial output was removed: free space there, then run again'
    )
    assert contents(disk) == []


# --------------------------------------------------------------------------------------------- report.py


@pytest.mark.parametrize('flag', ['--csv', '--plot'])
def test_a_report_file_that_does_not_fit_is_one_line_and_leaves_the_earlier_one(disk, flag):
    path = disk / ('report.csv' if flag == '--csv' else 'report.png')
    path.write_text('the earlier report')
    fill(disk, 0)
    other = '--plot' if flag == '--csv' else '--csv'
    line = one_line(script('report.py', '--throughput', '8=100', '16=190', flag, str(path), other, ''), 1)
    assert line == (
        f'error: {flag} {path}: No space left on device; the earlier file is left as it was: free space there, then '
        'run again'
    )
    assert path.read_text() == 'the earlier report' and contents(disk) == [path.name]


# ------------------------------------------------------------------------------------ Streaming's cache


@pytest.mark.parametrize('workers', ['0', '2'])
def test_a_full_shard_cache_and_temporary_folder_end_the_run_in_one_line(disk, tmp_path, workers):
    """Shards copied from a remote (here a folder given as --remote) into a cache on a full disk, with TMPDIR, where
    Streaming keeps its locks and the loader its record of a failure, on that disk too."""
    remote = write_dataset(tmp_path / 'mds', good_samples(24, (200, 160)), size_limit=1 << 14)  # 240 KB
    cache = disk / 'cache'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '6ba']
    flags += ['--remote', remote, '--local', str(cache), '--num_workers', workers]
    run = script('benchmark.py', *flags, env={'TMPDIR': str(disk)})
    line = one_line(run, 1)
    assert line == (
        f'error: {remote}: caching shards in {cache} failed: No space left on device; free space there, or pass '
        '--local a folder on a disk with room (without --local the cache is in TMPDIR)'
    )


# ------------------------------------------------------------------------------------ outputs.py, in process


def test_a_staged_file_replaces_the_earlier_one_only_when_whole(tmp_path):
    path = tmp_path / 'figure.png'
    path.write_text('earlier')
    with pytest.raises(WriteFailed) as failed:
        with staged_file(path, f'--plot {path}', 'run again') as partial:
            assert partial.suffix == '.png' and partial.parent == tmp_path  # the writer reads the format from it
            partial.write_text('half of a fig')
            raise OSError(28, 'No space left on device')
    assert str(failed.value) == (
        f'--plot {path}: No space left on device; the earlier file is left as it was: free space there, then run again'
    )
    assert sorted(tmp_path.iterdir()) == [path] and path.read_text() == 'earlier'
    with staged_file(path, f'--plot {path}', 'run again') as partial:
        partial.write_text('new')
    assert sorted(tmp_path.iterdir()) == [path] and path.read_text() == 'new'


def test_a_staged_folder_appears_whole_over_an_empty_one_or_not_at_all(tmp_path):
    folder = tmp_path / 'export'
    with pytest.raises(WriteFailed, match='Disk quota exceeded; the partial output was removed: free space there'):
        with staged_folder(folder, f'--export_pipeline {folder}', 'run again') as partial:
            (partial / 'unet').mkdir()
            raise OSError(122, 'Disk quota exceeded')
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):  # not a failed write: raised as it is, the partial folder removed too
        with staged_folder(folder, 'x', 'run again'):
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    folder.mkdir()  # an empty folder given: replaced
    with staged_folder(folder, 'x', 'run again') as partial:
        (partial / 'model_index.json').write_text('{}')
    assert [path.name for path in tmp_path.iterdir()] == ['export'] and (folder / 'model_index.json').is_file()


@pytest.mark.parametrize(
    'error, errno',
    [
        (OSError(28, 'No space left on device'), 28),
        (RuntimeError('Error while serializing: I/O error: No space left on device (os error 28)'), 28),
        (
            RuntimeError(
                '[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data/3: '
                'file write failed'
            ),
            5,
        ),
        (ValueError('a bad value'), None),
    ],
)
def test_the_failed_write_inside_a_libraries_own_error_is_found(error, errno):
    failure = outputs.write_failure(error)
    assert (failure.errno if failure else None) == errno
