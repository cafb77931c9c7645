"""Two writers on one output: two runs on one --save_folder, two precompute.py or two convert.py onto one folder.
The second is refused in one line before it writes (exit status 2), naming the folder, the writer holding it and
the fix, never a folder of both writers' files; a writer killed outright frees its folder, so a requeued
--autoresume takes it over."""

import atexit
import contextlib
import io
import os
import re
import signal
import socket
import sys

import pytest
from conftest import LAUNCHER, REPO, TINY, good_samples, jpeg, run_process, start_job, wait_until, write_dataset

import convert
import precompute
from guards.arguments import ConfigError, stop
from guards.writer_lock import LOCK_FILE, WRITE_CHECK_PREFIX, FolderBusy, one_writer
from settings.config import resolve_config
from settings.flags import parse_args

# Every test here is of processes: CI runs them apart, each command a new interpreter (make test-processes).
pytestmark = pytest.mark.process

HOST = socket.gethostname()
RUN = [*TINY, '--image_size', '32', '--batch_size', '4', '--run_name', 'r']
RUN_FIX = 'wait for it to end or stop it (then --autoresume continues its run), or pass another --save_folder'

# A process that holds a folder's lock until killed: another writer, as this machine sees it.
HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from guards.writer_lock import one_writer
with one_writer(sys.argv[1], sys.argv[1], 'fix'):
    print('held', flush=True)
    time.sleep(600)
"""


# ------------------------------------------------------------------------------------------ the lock


def test_a_second_writer_is_refused_and_the_lock_goes_with_the_first(tmp_path):
    folder = tmp_path / 'out'
    with one_writer(folder, f'--out {folder}', 'choose another --out'):
        assert (folder / LOCK_FILE).read_text() == f'{os.getpid()} {HOST}\n'
        with pytest.raises(FolderBusy) as refused:
            with one_writer(folder, f'--out {folder}', 'choose another --out'):
                pass
        assert (
            str(refused.value)
            == f'--out {folder}: another process (pid {os.getpid()} on {HOST}) is writing it; choose another --out'
        )
        (folder / 'shard.mds').write_bytes(b'written')
    assert sorted(path.name for path in folder.iterdir()) == ['shard.mds']  # the lock file goes with its holder
    with one_writer(folder, 'out', 'fix'):  # free again
        pass
    (folder / 'shard.mds').unlink()
    with one_writer(tmp_path / 'never-written', 'out', 'fix'):
        pass
    assert not (tmp_path / 'never-written').exists()  # made for the lock, and removed with it: nothing was written


def test_a_writer_killed_outright_frees_its_folder(tmp_path):
    """SIGKILL leaves the lock file, but the kernel drops the lock with the process: the next writer takes it."""
    folder = tmp_path / 'out'
    holder = start_job([sys.executable, '-c', HOLDER, str(folder), str(REPO)], tmp_path)
    try:
        assert holder.stdout.readline() == 'held\n'
        with pytest.raises(
            FolderBusy, match=rf'^out: another process \(pid {holder.pid} on {re.escape(HOST)}\) is writing'
        ):
            with one_writer(folder, 'out', 'fix'):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert (folder / LOCK_FILE).read_text().split()[0] == str(holder.pid)  # left behind, and no longer held
    with one_writer(folder, 'out', 'fix'):
        assert (folder / LOCK_FILE).read_text() == f'{os.getpid()} {HOST}\n'


FORKING_HOLDER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from guards.writer_lock import one_writer
with one_writer(sys.argv[1], sys.argv[1], 'fix'):
    child = os.fork()  # as a loader worker is, while the lock is held
    # Each line in one write: print makes two where PYTHONUNBUFFERED is set, and the two processes' would interleave.
    if child == 0:
        os.write(1, b'forked\\n')  # os.fork has returned here: the child's fork hooks have run
        time.sleep(600)
        os._exit(0)
    os.write(1, f'{child}\\n'.encode())
    time.sleep(600)
"""


def test_a_killed_writers_folder_is_free_while_a_child_it_forked_lives_on(tmp_path):
    """A child forked while the lock is held (a loader worker, which outlives a killed parent for a while) does
    not hold it: the writer killed outright, the next one takes the folder at once."""
    folder = tmp_path / 'out'
    holder = start_job([sys.executable, '-c', FORKING_HOLDER, str(folder), str(REPO)], tmp_path)
    child = None
    try:
        lines = {holder.stdout.readline().strip() for _ in range(2)}  # the child's pid, and the child's word
        ended = '' in lines  # its output closed: the holder and its child are gone, and say why on stderr
        assert not ended and 'forked' in lines, (lines, holder.stderr.read() if ended else '')
        # The child itself, by a descriptor: its pid, once the holder is reaped, could come to name another process.
        child = os.pidfd_open(int(next(line for line in lines if line != 'forked')))
        holder.kill()
        holder.wait(timeout=30)
        signal.pidfd_send_signal(child, 0)  # still there
        with one_writer(folder, 'out', 'fix'):
            assert (folder / LOCK_FILE).read_text() == f'{os.getpid()} {HOST}\n'
    finally:
        if holder.returncode is None:  # not reaped: its group's id is still its own
            os.killpg(holder.pid, signal.SIGKILL)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(child, signal.SIGKILL)
            os.close(child)


def test_a_lock_file_a_killed_writer_left_is_not_an_earlier_output(tmp_path):
    """A run killed before its first checkpoint leaves only the lock file: the same command runs again, without
    --autoresume, as in a folder it never wrote; so does a conversion."""
    folder = tmp_path / 'ckpt'
    folder.mkdir()
    (folder / LOCK_FILE).write_text('4242 elsewhere\n')
    resolve_config(parse_args([*RUN, '--save_folder', str(folder), '--max_duration', '2ba']))
    (tmp_path / 'photos').mkdir()
    (tmp_path / 'photos' / 'a.jpg').write_bytes(jpeg(0))
    (tmp_path / 'photos' / 'a.txt').write_text('a photo')
    convert.main([str(tmp_path / 'photos'), str(folder)])
    assert sorted(path.name for path in folder.iterdir()) == ['index.json', 'shard.00000.mds']


def test_another_ranks_writability_check_in_a_new_save_folder_is_not_an_earlier_output(tmp_path):
    """Every rank tries the save folder for writing with a scratch folder it makes and removes; one rank's, seen by
    another while it looks, refused a two-rank job on a new folder as `is not empty`. Anything else still counts."""
    folder = tmp_path / 'ckpt'
    (folder / f'{WRITE_CHECK_PREFIX}rank1').mkdir(parents=True)  # rank 1's scratch, made while rank 0 looks
    resolve_config(parse_args([*RUN, '--save_folder', str(folder), '--max_duration', '2ba']))
    (folder / 'ep0-ba2-rank0.pt').write_bytes(b'a checkpoint')
    with pytest.raises(ConfigError, match=re.escape(f'--save_folder {folder}: is not empty; give a new folder')):
        resolve_config(parse_args([*RUN, '--save_folder', str(folder), '--max_duration', '2ba']))


# ------------------------------------------------------------------------------------------ convert.py, precompute.py


def test_a_second_conversion_into_a_folder_is_refused_before_it_writes(tmp_path):
    photos = tmp_path / 'photos'
    photos.mkdir()
    for i in range(3):
        (photos / f'{i}.jpg').write_bytes(jpeg(i))
        (photos / f'{i}.txt').write_text(f'photo {i}')
    out = tmp_path / 'out'
    convert.main([str(photos), str(out)])
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with one_writer(out, str(out), 'fix'):  # another conversion into it, still running
        with pytest.raises(FolderBusy) as refused:
            convert.main([str(photos), str(out), '--overwrite'])
    assert str(refused.value) == (
        f'{out}: another process (pid {os.getpid()} on {HOST}) is writing it; wait for it to end or stop it, or give '
        'another output folder'
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_a_second_precompute_onto_an_output_is_refused_before_it_writes(tmp_path):
    source = write_dataset(tmp_path / 'mds', good_samples(8), size_limit=1 << 12)
    out = tmp_path / 'latents'
    flags = ['--local', source, '--out', str(out), '--model_name', 'tiny', '--image_size', '32', '--part_size', '8']
    with one_writer(out, str(out), 'fix'):  # another precompute.py onto it, still running
        with pytest.raises(FolderBusy) as refused:
            precompute.main(flags)
        assert [path.name for path in out.iterdir()] == [LOCK_FILE]  # nothing written: no settings, no part
    assert str(refused.value) == (
        f'--out {out}: another process (pid {os.getpid()} on {HOST}) is writing it; wait for it to end or stop it, '
        'or choose another --out'
    )
    assert precompute.main(flags)['encoded'] == 8  # free again once the other has ended
    assert not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------------------------------ benchmark.py


@pytest.mark.slow
def test_a_second_run_on_a_save_folder_is_refused_while_the_first_trains(tmp_path):
    """Two runs on one --save_folder and --run_name, both started before either checkpoints (different seeds):
    the second is refused before it builds its model, and the folder holds the first run's checkpoints alone."""
    folder = tmp_path / 'ckpt'
    # Far more batches than the test takes, and no periodic checkpoint: the first run is still training at the end.
    flags = [*RUN, '--max_duration', '1000000ba', '--save_interval', '1000000ba', '--save_folder', str(folder)]
    first = start_job([sys.executable, str(REPO / 'benchmark.py'), *flags, '--seed', '1'], tmp_path)
    try:
        wait_until(lambda: (folder / LOCK_FILE).is_file(), 180, 'the first run holds the folder')
        assert any(re.match(r'batch \d+ of 1000000 ', line) for line in first.stdout), 'the first run never trained'
        second = run_process(
            [sys.executable, str(REPO / 'benchmark.py'), *flags, '--seed', '2'],
            cwd=tmp_path,
            timeout=180,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.strip() == (
            f'error: --save_folder {folder}: another process (pid {first.pid} on {HOST}) is writing it; {RUN_FIX}'
        )
        assert 'model ' not in second.stdout and 'batch 1 ' not in second.stdout  # refused before it built anything
        os.killpg(first.pid, signal.SIGTERM)  # preempted: its checkpoint of the batch reached, and exit 143
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 143, err[-2000:]
    written = sorted(path.name for path in folder.iterdir())
    assert len(written) == 3 and written[1:] == ['latest-rank0.pt', 'run_description.json'], written  # the first's


@pytest.mark.slow
def test_a_requeued_autoresume_takes_over_the_folder_of_a_killed_run(tmp_path):
    """A job killed outright (SIGKILL: its lock file stays) and requeued with the same command: the requeued run
    takes the folder over and trains on from the killed run's newest checkpoint."""
    folder = tmp_path / 'ckpt'
    flags = [*RUN, '--save_folder', str(folder), '--autoresume', '--save_interval', '10ba']
    killed = start_job([sys.executable, str(REPO / 'benchmark.py'), *flags, '--max_duration', '400ba'], tmp_path)
    for line in killed.stdout:  # progress lines every 20 batches
        if line.startswith('batch 20 of 400'):
            break
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    assert (folder / LOCK_FILE).read_text().split()[0] == str(killed.pid)
    requeued = run_process(
        [sys.executable, str(REPO / 'benchmark.py'), *flags, '--max_duration', '30ba'],
        cwd=tmp_path,
        timeout=300,
    )
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert re.search(r"resumed run 'r' from ep0-ba(10|20)-rank0\.pt", requeued.stdout), requeued.stdout[-2000:]
    assert not (folder / LOCK_FILE).exists()


@pytest.mark.slow
def test_every_rank_of_a_refused_job_stops_in_one_line(tmp_path):
    """Under Composer's launcher rank 0 alone takes the lock and hands its refusal to every rank, so that none waits
    for the others at a collective: both end with the line, and the launcher returns."""
    folder = tmp_path / 'ckpt'
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'OMP_NUM_THREADS': '1'}
    flags = [*RUN, '--max_duration', '4ba', '--save_folder', str(folder)]
    with one_writer(folder, 'ckpt', 'fix'):  # another run, writing there
        job = run_process(
            [LAUNCHER, '-n', '2', '--stderr', 'rank{rank}.err', str(REPO / 'benchmark.py'), *flags],
            cwd=tmp_path,
            env=env,
            timeout=300,
        )
        assert sorted(path.name for path in folder.iterdir()) == [LOCK_FILE]  # the other writer's, nothing else
    assert job.returncode != 0
    line = f'error: --save_folder {folder}: another process (pid {os.getpid()} on {HOST}) is writing it; {RUN_FIX}'
    assert line in job.stderr.splitlines(), job.stderr[-3000:]  # rank 0's, through the launcher
    assert line in (tmp_path / 'rank1.err').read_text().splitlines()  # rank 1 told, not left waiting and killed


def test_a_ranks_error_line_is_one_write(monkeypatch):
    """Where PYTHONUNBUFFERED is set (many container images), print writes a line's newline apart: ranks sharing a
    stderr (torchrun's) would interleave their lines. The line, with its newline, goes in one write."""
    writes = []

    class Stderr(io.TextIOBase):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, 'stderr', Stderr())
    monkeypatch.setattr(atexit, 'register', lambda *args: None)  # the exit's quiet handling: not this process's
    with pytest.raises(SystemExit) as exited:
        stop(2, '--save_folder ckpt: another process (pid 412 on node3) is writing it')
    assert exited.value.code == 2
    assert writes == ['error: --save_folder ckpt: another process (pid 412 on node3) is writing it\n']


def test_a_new_run_onto_an_s3_save_folder_holding_checkpoints_is_refused_before_it_trains(s3):
    """Composer would train up to its first checkpoint, then stop on `Object ... already exists` in two lines."""
    from conftest import s3_client

    client = s3_client(s3)
    client.put_object(Bucket='bucket', Key='used/ep1-ba6-rank0.pt', Body=b'a checkpoint')
    client.put_object(Bucket='bucket', Key='used/latest-rank0.pt.symlink', Body=b'used/ep1-ba6-rank0.pt')
    client.put_object(Bucket='bucket', Key='fresh/.credentials_validated_successfully', Body=b'')
    with pytest.raises(
        ConfigError,
        match=re.escape(
            '--save_folder s3://bucket/used: holds checkpoints (ep1-ba6-rank0.pt, latest-rank0.pt.symlink); give a new '
            "folder (checkpoints are never overwritten), or pass --autoresume with the earlier run's --run_name"
        ),
    ):
        resolve_config(parse_args([*RUN, '--use_synth_data', '--save_folder', 's3://bucket/used']))
    resolve_config(parse_args([*RUN, '--use_synth_data', '--save_folder', 's3://bucket/used', '--autoresume']))
    resolve_config(parse_args([*RUN, '--use_synth_data', '--save_folder', 's3://bucket/fresh']))  # no checkpoint in it
