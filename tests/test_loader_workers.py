"""A loader worker that dies (killed as the kernel's out-of-memory killer does) ends the run in one line instead of
a traceback; the loader waits for a worker's batch at most its timeout; a /dev/shm too full for the loader's
queues is named with its fix."""

import os
import re
import signal
import sys

import pytest
from composer.core import Callback
from conftest import (
    REPO,
    TINY,
    good_samples,
    kill_if_unreaped,
    loader_workers,
    need_mount_namespaces,
    run_process,
    settled,
    write_dataset,
)

from datapath import loaders
from guards.arguments import ConfigError
from runs.run import main_reporting_errors
from settings.flags import parse_args

# Every test here is of processes: CI runs them apart, each command a new interpreter (make test-processes).
pytestmark = pytest.mark.process

RUN = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '6ba', '--num_workers', '2']


class SignalAWorker(Callback):
    """Sends `signal` to one of the training loader's workers once the first batch has trained."""

    def __init__(self, signum):
        self.signum, self.pids, self.earlier = signum, [], loader_workers()

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 1:
            worker = max(loader_workers() - self.earlier)  # the run's: its loader's workers are the only new ones
            self.pids.append(worker)
            os.kill(worker, self.signum)


def test_the_default_wait_is_far_above_a_shards_worst_download(monkeypatch):
    monkeypatch.delenv('LOADER_TIMEOUT_SECONDS', raising=False)
    assert loaders.loader_timeout() == loaders.LOADER_TIMEOUT_SECONDS >= 300
    monkeypatch.setenv('LOADER_TIMEOUT_SECONDS', '3')
    assert loaders.loader_timeout() == 3


def test_pytorchs_errors_of_a_worker_become_one_line():
    killed = RuntimeError('DataLoader worker (pid 4242) is killed by signal: Killed. ')
    assert loaders.loader_failure(killed, 600).startswith('a loader worker (pid 4242) was killed by signal Killed (')
    bus = RuntimeError(
        "DataLoader worker (pid 7) is killed by signal: Bus error. It is possible that dataloader's workers are out "
        'of shared memory. Please try to raise your shared memory limit.'
    )
    assert 'ran out of shared memory (/dev/shm)' in loaders.loader_failure(bus, 600)
    exited = RuntimeError('DataLoader worker (pid(s) 11, 12) exited unexpectedly')
    assert loaders.loader_failure(exited, 5).startswith('a loader worker (pid 11, 12) exited unexpectedly')
    assert loaders.loader_failure(RuntimeError('CUDA error: out of memory'), 5) is None


def run_ending_in_one_line(callback, capfd, flags=()) -> str:
    with pytest.raises(SystemExit) as stopped:
        main_reporting_errors(settled([*RUN, *flags]), callbacks=(callback,))
    assert stopped.value.code == 1 and callback.pids
    err = capfd.readouterr().err
    assert 'Traceback' not in err
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_worker_killed_mid_run_ends_it_in_one_line_with_the_batch_reached_checkpointed(tmp_path, capfd):
    folder = tmp_path / 'ckpt'
    saving = ['--save_folder', str(folder), '--run_name', 'k', '--save_interval', '10ba']
    line = run_ending_in_one_line(SignalAWorker(signal.SIGKILL), capfd, saving)
    assert re.match(r'error: a loader worker \(pid \d+\) (was killed by signal Killed \(|exited unexpectedly)', line)
    # The batches the live worker had made go on training until the dead one's turn: batch 1 or a few more.
    reached = re.search(rf'; batch (\d) is checkpointed in {re.escape(str(folder))}: rerun the same command with', line)
    assert reached and line.endswith('--autoresume to continue')
    assert (folder / 'latest-rank0.pt').resolve().name == f'ep0-ba{reached.group(1)}-rank0.pt'
    resumed = main_reporting_errors(settled([*RUN, *saving, '--autoresume']))
    assert int(resumed.state.timestamp.batch) == 6


def test_a_shared_memory_too_small_for_the_workers_batches_is_refused_at_start(monkeypatch):
    """Docker's default /dev/shm of 64 MB, 4 workers of 2 batches of 16 images at 512px (about 101 MB as uint8):
    refused before anything is built, where the run died at its first batch of a bus error."""
    from settings import device_checks
    from settings.config import resolve_config

    real = device_checks.shutil.disk_usage
    small = real('/').__class__(total=64 << 20, used=0, free=64 << 20)
    monkeypatch.setattr(device_checks.shutil, 'disk_usage', lambda path: small if path == '/dev/shm' else real(path))
    flags = ['--model_name', 'tiny', '--image_size', '512', '--batch_size', '16', '--max_duration', '1ba']
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args([*flags, '--num_workers', '4']))
    assert str(refused.value).startswith(
        '--num_workers 4: /dev/shm holds 67 MB, and the loader workers hand over up to 101 MB of batches there '
        '(2 batches of 16 at 512px each): give the container more shared memory (docker run --shm-size 8g'
    )
    assert resolve_config(parse_args([*flags, '--num_workers', '2'])).data.num_workers == 2  # 50 MB: fits
    none = resolve_config(parse_args([*flags, '--num_workers', '0']))
    assert none.data.num_workers == 0  # no workers, no handing over


def test_a_shared_memory_too_small_for_streamings_sample_order_is_refused_at_start(monkeypatch, tmp_path):
    """Streaming keeps an epoch's sample order in /dev/shm, 8 bytes a sample, even without workers: 2.3 billion
    samples take 18 GB. Here 40 samples (320 bytes) against a /dev/shm of 256 bytes, then of 4 kB beside the workers'
    batches."""
    from settings import device_checks
    from settings.config import resolve_config

    folder = write_dataset(tmp_path / 'mds', good_samples(40))
    real = device_checks.shutil.disk_usage
    limit = {'bytes': 256}

    def disk_usage(path):
        return real('/').__class__(limit['bytes'], 0, limit['bytes']) if path == '/dev/shm' else real(path)

    monkeypatch.setattr(device_checks.shutil, 'disk_usage', disk_usage)
    flags = ['--model_name', 'tiny', '--image_size', '8', '--batch_size', '4', '--max_duration', '1ba']
    flags += ['--local', folder, '--num_workers', '0']
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args(flags))
    assert str(refused.value).startswith(
        f"{folder}: /dev/shm holds 0 MB, and Streaming keeps the epoch's order of its 40 samples there (0 MB): "
        'give the container more shared memory'
    )
    limit['bytes'] = 4096  # the order fits; 2 batches of 4 images of 8x8 from each of 2 workers (3,072 bytes) too
    assert resolve_config(parse_args(flags)).data.num_workers == 0
    assert resolve_config(parse_args([*flags[:-1], '2'])).data.num_workers == 2
    limit['bytes'] = 3300  # the order and the batches do not
    with pytest.raises(ConfigError, match=r'^--num_workers 2: /dev/shm holds 0 MB, and the loader workers hand over'):
        resolve_config(parse_args([*flags[:-1], '2']))


@pytest.mark.slow
def test_a_worker_stopped_for_good_ends_the_run_within_the_loaders_timeout(monkeypatch, capfd):
    """SIGSTOP to a worker: PyTorch waited forever (its timeout covers the queue of batches, not the unpickling of a
    batch taken from it, which asks the stopped worker for its shared memory)."""
    monkeypatch.setenv('LOADER_TIMEOUT_SECONDS', '3')
    stopper = SignalAWorker(signal.SIGSTOP)
    try:
        line = run_ending_in_one_line(stopper, capfd)
    finally:
        for pid in stopper.pids:
            kill_if_unreaped(pid)
    assert re.match(r'error: a loader worker \(pid [\d, ]+\) sent no batch in 3 s \(stopped, or hung on a', line)


def in_small_shared_memory(command: list[str], size: str = '64k') -> list[str]:
    """`command` in a mount namespace of its own whose /dev/shm is a tmpfs of `size` (root only; skipped elsewhere,
    failed in CI)."""
    need_mount_namespaces()
    mount = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ['unshare', '--mount', '--propagation', 'private', 'sh', '-c', mount, 'sh', *command]


@pytest.mark.slow
def test_a_full_shared_memory_outside_the_batches_is_named_with_its_fix(tmp_path):
    """A /dev/shm of 64 kB passes the check of the batches' size at start (32px), then is too small for the
    semaphores of the loader's queues. Before: `error: No space left on device; nothing of it was written (an
    earlier file is as it was)`, the words of a file write, naming no path."""
    data = write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 14)
    command = [sys.executable, str(REPO / 'benchmark.py'), *RUN[len(TINY) :], '--model_name', 'tiny', '--local', data]
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    run = run_process(in_small_shared_memory(command), cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: /dev/shm is full (it holds 0.1 MB): the loader workers' queues and Streaming's shared memory live "
        'there: give the container more shared memory (docker run --shm-size 8g; on Kubernetes an emptyDir of '
        'medium Memory on /dev/shm), or pass fewer --num_workers'
    )
    assert 'Traceback' not in run.stderr
