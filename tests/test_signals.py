"""Ctrl-C and SIGTERM sent to every process of a job at once (Slurm's scancel, a deleted Kubernetes pod, Ctrl-C in a
terminal, which signals the whole foreground group): benchmark.py, precompute.py and convert.py each end with one
`error:` line and the signal's exit status, with no traceback from any process, loader workers included, and
leave nothing half-written that looks whole."""

import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, free_port, good_samples, jpeg, settled, start_job, wait_until, write_dataset

import convert
import precompute
from datapath import convert_inputs
from guards.stopping import Stopped, quiet_loader_worker, without_hangups_of_a_stopped_parent
from guards.writer_lock import LOCK_FILE
from runs import precomputing
from runs.interrupts import StopOnSignal
from settings.config import resolve_config
from settings.flags import parse_args

# Every test here is of processes: CI runs them apart, each command a new interpreter (make test-processes).
pytestmark = pytest.mark.process

NAMES = {signal.SIGINT: 'Ctrl-C (SIGINT)', signal.SIGTERM: 'SIGTERM'}


def live_members(group: int, started_by: int) -> list[int]:
    """The processes of a process group still running (zombies waiting for their reaper are done) that started by
    `started_by` (clock_ticks() once its leader was reaped): once every member has ended, the kernel may give the
    group's id to a new process, whose group is not this one."""
    members = []
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            fields = stat.read_text().rsplit(')', 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        if int(fields[2]) == group and fields[0] != 'Z' and int(fields[19]) <= started_by:
            members.append(int(stat.parent.name))
    return members


def clock_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives a process's start in."""
    return math.ceil(float(Path('/proc/uptime').read_text().split()[0]) * os.sysconf('SC_CLK_TCK')) + 1


def signals_pending(pid: int) -> bool:
    """Whether a signal sent to the process waits to be taken (its shared pending set, /proc's ShdPnd); one it
    ignores is dropped when sent, and one a thread takes with sigtimedwait leaves the set as it is taken."""
    status = Path(f'/proc/{pid}/status').read_text()
    return int(re.search(r'^ShdPnd:\s*([0-9a-f]+)', status, re.MULTILINE).group(1), 16) != 0


def assert_one_line(err: str, line: str) -> None:
    """The signal's line is the one error, and the last line; no process printed a traceback."""
    assert 'Traceback' not in err and 'killed by signal' not in err, err[-3000:]
    assert [each for each in err.splitlines() if each.startswith('error:')] == [f'error: {line}'], err[-3000:]
    assert err.strip().splitlines()[-1] == f'error: {line}'


# ------------------------------------------------------------------------------------------ benchmark.py


@pytest.mark.slow
@pytest.mark.parametrize('signum, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=['SIGTERM', 'SIGINT'])
def test_a_signal_to_every_process_of_a_run_checkpoints_the_batch_reached(tmp_path, signum, status):
    """scancel's SIGTERM, or Ctrl-C, to the main process and its 2 loader workers at once: the workers leave the
    signal to the main process, which finishes the batch, writes its checkpoint, shuts them down and ends in one
    line; before, the workers died of the SIGTERM and the run ended in `DataLoader worker (pid ...) is killed by
    signal: Terminated`, exit status 1."""
    data = write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 12)
    folder = tmp_path / 'ckpt'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '400ba']
    flags += ['--local', data, '--num_workers', '2', '--save_folder', str(folder), '--run_name', 'r']
    run = start_job([sys.executable, str(REPO / 'benchmark.py'), *flags], tmp_path)
    for line in run.stdout:  # progress lines every 20 batches
        if line.startswith('batch 20 of 400'):
            break
    os.killpg(run.pid, signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == status, err[-3000:]
    checkpoint = (folder / 'latest-rank0.pt').resolve()
    reached = int(re.fullmatch(r'ep\d+-ba(\d+)-rank0\.pt', checkpoint.name).group(1))
    assert 20 <= reached < 400 and zipfile.is_zipfile(checkpoint)
    assert_one_line(
        err,
        f'{NAMES[signum]}: stopped at batch {reached} of 400; checkpoint {checkpoint.name} written in {folder}; '
        'rerun the same command with --autoresume to continue',
    )
    reaped = clock_ticks()
    wait_until(lambda: not live_members(run.pid, reaped), 30, 'every process of the run ended, loader workers included')
    assert not (folder / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_signal_to_every_process_of_a_run_saving_to_s3_uploads_the_batch_reached(s3, tmp_path):
    """With an s3:// save folder, Composer uploads from processes it spawns, which a job-wide SIGTERM reached too:
    the pool broke (`BrokenProcessPool` traceback, exit status 1) and the checkpoint of the batch reached was lost.
    They leave the signal to the run now, which uploads that checkpoint, points the latest link at it, and ends in
    one line; --autoresume goes on from there."""
    from conftest import s3_client

    data = write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 12)
    folder = 's3://bucket/signalled'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--local', data]
    flags += ['--num_workers', '2', '--save_folder', folder, '--run_name', 'r']
    run = start_job([sys.executable, str(REPO / 'benchmark.py'), *flags, '--max_duration', '400ba'], tmp_path)
    for line in run.stdout:  # an epoch is 6 batches: checkpoints at 6, 12 and 18 on their way
        if line.startswith('batch 20 of 400'):
            break
    os.killpg(run.pid, signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-3000:]
    link = s3_client(s3).get_object(Bucket='bucket', Key='signalled/latest-rank0.pt.symlink')['Body'].read().decode()
    reached = int(re.fullmatch(r'signalled/ep\d+-ba(\d+)-rank0\.pt', link.strip()).group(1))
    assert 20 <= reached < 400
    assert_one_line(
        err,
        f'SIGTERM: stopped at batch {reached} of 400; its checkpoint uploaded to {folder}, which the latest link '
        'there names; rerun the same command with --autoresume to continue',
    )
    reaped = clock_ticks()
    wait_until(lambda: not live_members(run.pid, reaped), 30, "every process of the run ended, the uploader's too")
    flags += ['--max_duration', f'{reached + 2}ba', '--autoresume']
    resumed = start_job([sys.executable, str(REPO / 'benchmark.py'), *flags], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed run 'r' from the latest in {folder} (batch {reached} of {reached + 2})" in out, out[-3000:]


# benchmark.py whose ranks, once batch 14 is trained, say so (rank 0) and wait for the signal.
PAUSED_AT_BATCH_14 = """
import time
from composer import Callback
from composer.utils import dist
from runs.run import main_reporting_errors
from settings.config import resolve_config
from settings.flags import parse_args

class Pause(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 14:
            if dist.get_global_rank() == 0:
                print('paused at batch 14', flush=True)
            while True:
                time.sleep(0.05)

main_reporting_errors(resolve_config(parse_args()), (Pause(),))
"""


@pytest.mark.slow
def test_a_signal_to_every_process_under_composers_launcher_names_the_checkpoint_the_rerun_resumes(tmp_path):
    """scancel or Ctrl-C to a job of two ranks under Composer's launcher (runs.launcher, as the launch files and the
    Makefile start it): the launcher, both ranks and their loader workers are signalled at once (and each rank again
    by the launcher). A rank of several does not checkpoint the batch reached (each would have to reach the same
    batch first): each ends in the one line naming the newest whole checkpoint, the job's status is the signal's,
    no process prints a traceback, and the same command with --autoresume goes on from there."""
    data = write_dataset(tmp_path / 'mds', good_samples(48), size_limit=1 << 12)
    folder = tmp_path / 'ckpt'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '8', '--max_duration', '24ba']
    flags += ['--local', data, '--num_workers', '2', '--save_folder', str(folder), '--run_name', 'r']
    launcher = [sys.executable, '-m', 'runs.launcher', '-n', '2', '--master_port']
    paused = tmp_path / 'paused_at_batch_14.py'  # the signal finds both ranks there, not training on
    paused.write_text(PAUSED_AT_BATCH_14)
    run = start_job([*launcher, str(free_port()), str(paused), *flags], tmp_path)
    for line in run.stdout:  # an epoch is 6 batches: checkpoints at 6 and 12
        if line.startswith('paused at batch 14'):
            break
    os.killpg(run.pid, signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-3000:]
    newest = max(folder.glob('ep*-ba*-rank0.pt'), key=lambda path: int(path.stem.split('-ba')[1].split('-')[0]))
    assert newest.name == 'ep2-ba12-rank0.pt'
    line = r'error: SIGTERM: stopped at batch \d+ of 24; ' + re.escape(
        f'the newest checkpoint is {newest.name} in {folder}; rerun the same command with --autoresume to continue'
    )
    assert re.search(line, err), err[-3000:]  # rank 0's; the launcher shows another rank's output when it fails first
    assert not re.search(r'exited with code (?!143\b)', err), err[-3000:]  # every rank ended by the signal
    assert 'Traceback' not in err and 'killed by signal' not in err, err[-3000:]
    reaped = clock_ticks()
    wait_until(lambda: not live_members(run.pid, reaped), 30, 'every process of the job ended, loader workers included')
    resumed = start_job([*launcher, str(free_port()), str(REPO / 'benchmark.py'), *flags, '--autoresume'], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    resumed_at = int(newest.stem.split('-ba')[1].split('-')[0])
    assert f"resumed run 'r' from {newest.name} (batch {resumed_at} of 24)" in out, out[-3000:]


SIGNALLED_WHILE_EXITING = """
import atexit, os, signal, sys
import composer.core.engine  # its handlers: SIGTERM and SIGINT raise SystemExit wherever the main thread is
from guards.arguments import stop

def close_trainer():  # registered first, run last: as Composer's Engine._close, registered when a Trainer is built
    os.kill(os.getpid(), int(sys.argv[1]))  # handled at the next bytecode, inside this callback
    print('closed', flush=True)

atexit.register(close_trainer)
stop(143, 'SIGTERM: stopped at batch 14 of 24')
"""


@pytest.mark.parametrize('signum, closed', [(signal.SIGTERM, True), (signal.SIGINT, False)], ids=['SIGTERM', 'SIGINT'])
def test_a_signal_while_a_stopped_run_exits_ends_it_without_a_traceback(tmp_path, signum, closed):
    """A rank under Composer's launcher gets the job's SIGTERM, prints its line, and gets the launcher's SIGTERM
    while Composer closes its trainer at exit: the close goes on, no traceback. A second Ctrl-C ends it at once."""
    script = tmp_path / 'rank.py'
    script.write_text(SIGNALLED_WHILE_EXITING)
    run = subprocess.run([sys.executable, str(script), str(int(signum))], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 143 and run.stderr == 'error: SIGTERM: stopped at batch 14 of 24\n', run.stderr[-3000:]
    assert (run.stdout == 'closed\n') is closed, run.stdout


RANK_UNTIL_SIGNALLED = """
import os, signal, time
for signum in (signal.SIGINT, signal.SIGTERM):  # the group's signal, then the launcher's SIGTERM: the first counts
    signal.signal(signum, lambda signum, frame: os._exit(128 + signum))
print('waiting', flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize('signum, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=['SIGTERM', 'SIGINT'])
def test_composers_launcher_signalled_ends_with_its_ranks_status_and_no_traceback(tmp_path, signum, status):
    """Plain `composer` prints the SystemExit of its own signal handler as a traceback; runs.launcher does not."""
    script = tmp_path / 'rank.py'
    script.write_text(RANK_UNTIL_SIGNALLED)
    run = start_job(
        [sys.executable, '-m', 'runs.launcher', '-n', '1', '--master_port', str(free_port()), str(script)], tmp_path
    )
    assert run.stdout.readline() == 'waiting\n'
    os.killpg(run.pid, signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == status and 'Traceback' not in err, err[-3000:]


@pytest.mark.parametrize('signum, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=['SIGTERM', 'SIGINT'])
def test_torchrun_signalled_ends_with_the_signals_status_and_no_traceback(tmp_path, signum, status):
    """torchrun itself raises its SignalException as a traceback and exits 1; runs.torchrun exits 143 or 130."""
    script = tmp_path / 'rank.py'
    script.write_text(RANK_UNTIL_SIGNALLED)
    command = [sys.executable, '-m', 'runs.torchrun', '--nproc_per_node', '1', '--master_port', str(free_port())]
    run = start_job([*command, '--', str(script)], tmp_path)
    assert run.stdout.readline() == 'waiting\n'
    os.killpg(run.pid, signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == status and 'Traceback' not in err, err[-3000:]


def test_torchrun_with_a_failed_rank_ends_with_its_status_and_one_line(tmp_path):
    script = tmp_path / 'rank.py'
    script.write_text('import sys\nprint("error: --local /data: no such folder", file=sys.stderr)\nsys.exit(2)\n')
    command = [sys.executable, '-m', 'runs.torchrun', '--nproc_per_node', '1', '--master_port', str(free_port())]
    run = subprocess.run([*command, '--', str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2 and 'Traceback' not in run.stderr, run.stderr[-3000:]
    assert 'error: --local /data: no such folder' in run.stderr
    assert run.stderr.strip().splitlines()[-1] == 'torchrun: rank 0 exited with status 2 (its output above says why)'


def test_a_second_signal_while_the_checkpoint_is_written_sets_the_file_aside(tmp_path):
    """Ctrl-C twice: the first asks for a checkpoint after the batch, the second comes while torch.save writes it
    and stops at once. torch.save, interrupted, still closes its zip archive, so the cut file would pass for a whole
    checkpoint: it is set aside as NAME.incomplete, and the latest link names the newest whole one."""
    folder = tmp_path / 'ckpt'
    config = resolve_config(
        parse_args([*TINY, '--save_folder', str(folder), '--run_name', 'r', '--max_duration', '9ba'])
    )
    folder.mkdir()
    torch.save({'state': {}}, folder / 'ep0-ba4-rank0.pt')
    (folder / 'latest-rank0.pt').symlink_to('ep0-ba4-rank0.pt')
    stopper = StopOnSignal(config.outputs, config.batch)
    stopper.fit_start(types.SimpleNamespace(timestamp=types.SimpleNamespace(batch=6)), None)

    class SecondCtrlC:
        def __reduce__(self):
            stopper.handle(signal.SIGINT)  # arrives while torch.save pickles the state

    def save_checkpoint():
        with open(folder / 'ep0-ba6-rank0.pt', 'wb') as file:
            torch.save({'state': {'weights': torch.zeros(64), 'callbacks': SecondCtrlC()}}, file)
        (folder / 'latest-rank0.pt').unlink()
        (folder / 'latest-rank0.pt').symlink_to('ep0-ba6-rank0.pt')

    stopper.save_checkpoint = save_checkpoint
    stopper.handle(signal.SIGINT)  # the first: a checkpoint after this batch
    with pytest.raises(Stopped) as stopped:
        stopper.batch_end(None, None)
    assert stopped.value.exit_status == 130
    assert str(stopped.value) == (
        'Ctrl-C (SIGINT): stopped at batch 6 of 9, while writing its checkpoint: ep0-ba6-rank0.pt set aside as '
        f'ep0-ba6-rank0.pt.incomplete; the newest checkpoint is ep0-ba4-rank0.pt in {folder}; rerun the same command '
        'with --autoresume to continue'
    )
    assert zipfile.is_zipfile(folder / 'ep0-ba6-rank0.pt.incomplete')  # what would have passed for whole
    assert sorted(path.name for path in folder.iterdir()) == [
        'ep0-ba4-rank0.pt',
        'ep0-ba6-rank0.pt.incomplete',
        'latest-rank0.pt',
    ]
    assert (folder / 'latest-rank0.pt').readlink().name == 'ep0-ba4-rank0.pt'


def sleeping_worker(ready) -> None:
    quiet_loader_worker(0)
    ready.set()
    time.sleep(60)


def test_a_loader_worker_leaves_a_job_wide_signal_to_the_main_process_and_ends_on_its_parents():
    """Without this, PyTorch's worker dies of a SIGTERM from anyone but its parent. With it, a SIGTERM or Ctrl-C
    that another process sends (scancel, the terminal) leaves it running; its parent's SIGTERM (multiprocessing's
    terminate, at the main process's exit) still ends it, quietly, as PyTorch's own handler would."""
    context = multiprocessing.get_context('fork')  # as DataLoader's workers start on Linux
    ready = context.Event()
    worker = context.Process(target=sleeping_worker, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        for name in ('TERM', 'INT'):
            subprocess.run(['kill', f'-{name}', str(worker.pid)], check=True)  # sent by another process
        wait_until(lambda: not signals_pending(worker.pid), 30, 'the worker took the signals')
        assert worker.is_alive()
        worker.terminate()
        worker.join(30)
        assert worker.exitcode == 0
    finally:
        worker.kill()


# ------------------------------------------------------------------------------------------ precompute.py


PARENT_OF_A_QUIET_CHILD = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from guards.stopping import leave_signals_to_parent

def child():
    leave_signals_to_parent()
    time.sleep(120)

if __name__ == '__main__':
    process = multiprocessing.get_context('spawn').Process(target=child)  # as Composer's uploaders start
    process.start()
    print(process.pid, flush=True)
    time.sleep(120)
"""


def test_a_child_that_leaves_signals_to_its_parent_ends_once_its_parent_is_killed_outright(tmp_path):
    """SIGTERM blocked, a child whose parent died of a SIGKILL (the OOM killer, say) would wait for ever."""
    script = tmp_path / 'parent.py'
    script.write_text(PARENT_OF_A_QUIET_CHILD)
    parent = start_job([sys.executable, str(script), str(REPO)], tmp_path)
    child = int(parent.stdout.readline())
    wait_until(lambda: len(os.listdir(f'/proc/{child}/task')) == 2, 30, "the child's thread started")
    os.kill(child, signal.SIGTERM)  # from another process: left to the parent
    wait_until(lambda: not signals_pending(child), 30, 'the child took the signal')
    assert Path(f'/proc/{child}').exists()
    parent.kill()
    parent.communicate(timeout=30)
    reaped = clock_ticks()
    wait_until(lambda: child not in live_members(parent.pid, reaped), 10, 'the child ended after its parent')


def precompute_flags(source: str, out: Path) -> list[str]:
    flags = ['--local', source, '--out', str(out), '--model_name', 'tiny', '--image_size', '32']
    return [*flags, '--part_size', '8', '--batch_size', '4']


def parts(out: Path) -> dict[str, int | None]:
    """Each part folder and the samples its index.json lists (None: no index.json)."""
    found = {}
    for part in sorted(out.glob('part-*')):
        index = part / 'index.json'
        found[part.name] = (
            sum(s['samples'] for s in json.loads(index.read_text())['shards']) if index.is_file() else None
        )
    return found


def test_precompute_stopped_by_a_signal_keeps_finished_parts_only_and_the_rerun_loses_nothing(tmp_path, monkeypatch):
    """SIGTERM in the middle of a part: Streaming's writer, left at an error, finishes the part and writes its
    index.json, and the rerun would skip a part of half its samples. The part in progress is removed instead, the
    finished ones stay, and the same command again precomputes every sample."""
    source = write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 12)
    out = tmp_path / 'latents'
    encode, batches = precomputing.encode, []

    def encode_then_sigterm(*args, **kwargs):
        batches.append(1)
        if len(batches) == 4:  # the second batch of the second part of 8
            os.kill(os.getpid(), signal.SIGTERM)
        return encode(*args, **kwargs)

    monkeypatch.setattr(precomputing, 'encode', encode_then_sigterm)
    with pytest.raises(Stopped) as stopped:
        precompute.main(precompute_flags(source, out))
    assert stopped.value.exit_status == 143
    assert str(stopped.value) == (
        f'SIGTERM: precompute stopped; {out} keeps the parts finished, not the one in progress: the same command '
        'again finishes the rest'
    )
    assert parts(out) == {'part-00000': 8}
    assert not (out / 'index.json').exists() and not (out / LOCK_FILE).exists()
    monkeypatch.setattr(precomputing, 'encode', encode)
    done = precompute.main(precompute_flags(source, out))
    assert done['skipped_parts'] == 1 and parts(out) == {'part-00000': 8, 'part-00001': 8, 'part-00002': 8}
    assert sum(s['samples'] for s in json.loads((out / 'index.json').read_text())['shards']) == 24


# A precompute.py whose encoding pauses once the second part has begun: it writes the file sys.argv[1] and waits,
# encoding no more, until a signal ends it, so that the signal always finds the first part finished and the second
# in progress. Patched as precompute.py imports it, not before: importing Composer first would install its signal
# handlers before precompute.py's, where the command itself imports it after (and its handlers exit without a line).
PAUSED_PRECOMPUTE = """
import builtins, pathlib, runpy, sys, time
paused, out = pathlib.Path(sys.argv.pop(1)), pathlib.Path(sys.argv[sys.argv.index('--out') + 1])
real_import = builtins.__import__
def pause_in_the_second_part(encode):
    def encode_or_pause(*args, **kwargs):
        if (out / 'part-00001').is_dir():
            paused.touch()
            while True:
                time.sleep(0.05)
        return encode(*args, **kwargs)
    return encode_or_pause
def import_then_pause_the_encoding(name, *args, **kwargs):
    module = real_import(name, *args, **kwargs)
    precomputing = sys.modules.get('runs.precomputing')
    if precomputing is not None and hasattr(precomputing, 'encode') and not hasattr(precomputing, 'paused'):
        precomputing.encode, precomputing.paused = pause_in_the_second_part(precomputing.encode), True
    return module
builtins.__import__ = import_then_pause_the_encoding
sys.argv[0] = 'precompute.py'
runpy.run_path('precompute.py', run_name='__main__')
"""


@pytest.mark.slow
def test_precompute_stopped_by_a_signal_to_every_process_ends_in_one_line(tmp_path):
    """SIGTERM to precompute.py and its 2 loader workers at once: one line, exit status 143, finished parts only."""
    source = write_dataset(tmp_path / 'mds', good_samples(48), size_limit=1 << 12)
    out, paused = tmp_path / 'latents', tmp_path / 'paused'
    command = [sys.executable, '-c', PAUSED_PRECOMPUTE, str(paused), *precompute_flags(source, out)]
    run = start_job([*command, '--num_workers', '2'], REPO)
    wait_until(paused.exists, 120, 'the first part finished, the second begun')
    os.killpg(run.pid, signal.SIGTERM)
    out_text, err = run.communicate(timeout=60)
    assert run.returncode == 143, err[-3000:]
    assert_one_line(
        err,
        f'SIGTERM: precompute stopped; {out} keeps the parts finished, not the one in progress: the same command '
        'again finishes the rest',
    )
    assert parts(out) == {'part-00000': 8}
    reaped = clock_ticks()
    wait_until(lambda: not live_members(run.pid, reaped), 30, 'every process ended, loader workers included')


def test_a_workers_hangup_from_a_parent_stopped_while_taking_a_batch_prints_no_traceback(capfd):
    """Multiprocessing's resource sharer, serving a batch's shared memory to a main process that a signal stopped
    meanwhile, finds the connection gone and reports it through sys.excepthook: in a loader worker
    (quiet_loader_worker) that says nothing; any other error, a broken pipe elsewhere too, is reported."""
    from multiprocessing import resource_sharer

    class Connection:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def recv(self):
            return None  # the sharer's own word to end

    class GoneThenDone:
        """A listener whose first connection the main process broke off; its second asks the sharer to end."""

        def __init__(self):
            self.accepted = 0

        def accept(self):
            self.accepted += 1
            if self.accepted == 1:
                raise BrokenPipeError(32, 'Broken pipe')
            return Connection()

    sharer = object.__new__(resource_sharer._ResourceSharer)
    sharer._listener, sharer._cache = GoneThenDone(), {}
    before = sys.excepthook
    sys.excepthook = without_hangups_of_a_stopped_parent(before)
    try:
        serving = threading.Thread(target=sharer._serve)
        serving.start()
        serving.join(timeout=60)
        assert not serving.is_alive() and sharer._listener.accepted == 2
        try:
            raise BrokenPipeError(32, 'a pipe of the run itself')
        except BrokenPipeError:
            sys.excepthook(*sys.exc_info())
    finally:
        sys.excepthook = before
    err = capfd.readouterr().err
    assert 'resource_sharer' not in err and 'a pipe of the run itself' in err, err


# ------------------------------------------------------------------------------------------ convert.py


def photo_folder(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f'{i:03d}.jpg').write_bytes(jpeg(i))
        (folder / f'{i:03d}.txt').write_text(f'photo number {i}')
    return folder


def listing(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_convert_stopped_by_a_signal_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    """SIGTERM part way, over an earlier output (--overwrite) and into a new folder: the earlier dataset is as it
    was, the new folder is not made, no staging folder or lock is left, and the line says so."""
    photos = photo_folder(tmp_path / 'photos', 6)
    earlier = tmp_path / 'out'
    handler = signal.getsignal(signal.SIGTERM)
    convert.main([str(photos), str(earlier)])
    before = listing(earlier)
    samples = convert_inputs.folder_samples

    def samples_then_sigterm(*args, **kwargs):
        for number, sample in enumerate(samples(*args, **kwargs)):
            if number == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # scancel, with shards of this conversion staged
            yield sample

    monkeypatch.setattr(convert_inputs, 'folder_samples', samples_then_sigterm)
    for out in (earlier, tmp_path / 'new'):
        with pytest.raises(Stopped) as stopped:
            convert.main([str(photos), str(out), '--overwrite', '--size_limit', '1kb'])
        assert stopped.value.exit_status == 143
        assert (
            str(stopped.value)
            == f'SIGTERM: conversion stopped; {out} is left as it was (nothing of this conversion kept)'
        )
    assert listing(earlier) == before
    assert not (tmp_path / 'new').exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # the handler before is back


# A convert.py that takes 50 ms a sample, so that a signal finds it part way.
SLOW_CONVERT = """
import runpy, sys, time
from datapath import sample_checks
check_image = sample_checks.check_image  # every route's one check of a sample: 0.05 s more each
sample_checks.check_image = lambda *args, **kwargs: (time.sleep(0.05), check_image(*args, **kwargs))[1]
sys.argv[0] = 'convert.py'
runpy.run_path('convert.py', run_name='__main__')
"""


@pytest.mark.slow
def test_convert_stopped_by_ctrl_c_ends_in_one_line(tmp_path):
    photos = photo_folder(tmp_path / 'photos', 200)
    out = tmp_path / 'out'
    run = start_job([sys.executable, '-c', SLOW_CONVERT, str(photos), str(out), '--size_limit', '1kb'], REPO)
    wait_until(lambda: any((out / convert.STAGING).rglob('*.mds')), 60, 'shards staged')  # in a worker's part-NNNNN
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err[-3000:]
    assert_one_line(
        err, f'Ctrl-C (SIGINT): conversion stopped; {out} is left as it was (nothing of this conversion kept)'
    )
    assert not out.exists()


# ------------------------------------------------------------------------------------------ generate.py


@pytest.mark.slow
def test_generate_stopped_by_a_signal_says_so_and_writes_nothing(tmp_path):
    """Importing Composer installs its own handlers, which exit 143 with no line: generate.py, stopped while it
    draws, ends in one line and leaves no folder."""
    from conftest import TINY

    from runs.run import main

    folder = tmp_path / 'ckpt'
    main(
        settled(
            [
                *TINY,
                '--image_size',
                '32',
                '--batch_size',
                '2',
                '--max_duration',
                '1ba',
                '--run_name',
                'g',
                '--save_folder',
                str(folder),
                '--save_interval',
                '1ba',
            ]
        )
    )
    out = tmp_path / 'images'
    prompts = [flag for i in range(64) for flag in ('--prompt', f'a red circle {i}')]
    command = [sys.executable, 'generate.py', '--checkpoint', str(folder / 'latest-rank0.pt'), '--out', str(out)]
    run = start_job([*command, *prompts, '--steps', '50', '--batch_size', '1'], REPO)
    lines = iter(run.stdout.readline, '')
    assert any(line.startswith('generating 64 image(s)') for line in lines)  # the drawing has begun
    os.killpg(run.pid, signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-3000:]
    assert_one_line(err, f'SIGTERM: generate stopped; nothing was written to {out}')
    assert not out.exists()


# ------------------------------------------------------------------------------------------ report.py, mcloud.py


def wait_for_a_reader(fifo: Path) -> int:
    """Opens a FIFO for writing once a process has opened it for reading (O_NONBLOCK: ENXIO until then), so the
    reader is known to be blocked reading it."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f'no process opened {fifo} for reading within 120 s')
            time.sleep(0.02)


@pytest.mark.parametrize('signum, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=['SIGTERM', 'SIGINT'])
def test_report_stopped_by_a_signal_ends_in_one_line_and_writes_nothing(tmp_path, signum, status):
    """report.py stopped while it reads its inputs (a results file that is a pipe no one writes yet)."""
    fifo, csv = tmp_path / 'results.json', tmp_path / 'report.csv'
    os.mkfifo(fifo)
    run = start_job([sys.executable, 'report.py', str(fifo), '--csv', str(csv)], REPO)
    writer = wait_for_a_reader(fifo)
    try:
        os.killpg(run.pid, signum)
        _, err = run.communicate(timeout=120)
    finally:
        os.close(writer)
    assert run.returncode == status, err[-3000:]
    assert_one_line(err, f'{NAMES[signum]}: report stopped; --csv and --plot files are left as they were')
    assert not csv.exists()


SUBMIT_UNTIL_STOPPED = """
import runpy, sys, threading
import mcli

def create_run(config):  # the platform taking its time: the test signals once this line is out
    print(f'submitting {config.name}', flush=True)
    threading.Event().wait()

mcli.create_run = create_run
sys.argv = ['mcloud.py', 'sweep', '--gpus', '8', '16', '--submit']
runpy.run_path('mcloud.py', run_name='__main__')
"""


def test_mcloud_stopped_while_submitting_ends_in_one_line(tmp_path):
    run = start_job([sys.executable, '-c', SUBMIT_UNTIL_STOPPED], REPO)
    lines = iter(run.stdout.readline, '')
    assert any(line.startswith('submitting sd2-benchmark-8x') for line in lines), run.stderr.read()[-3000:]
    os.killpg(run.pid, signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-3000:]
    assert_one_line(
        err,
        'SIGTERM: mcloud.py stopped; runs printed as submitted above were submitted, and one being submitted when '
        'it stopped may have been: `mcli get runs` lists them',
    )
    assert 'submitting sd2-benchmark-16x' not in out
