"""The tests' fork server (tests/forkserver.py): a command forked from it ends as a plain process would, and its pid
names it until the test has waited for it, as a plain child's does."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from conftest import LAUNCHER, REPO, TINY, start_job, start_process, wait_until

BAD_FLAG = [sys.executable, str(REPO / 'benchmark.py'), '--batch_size', 'many']


def state(pid: int) -> str:
    """The process's state letter in /proc (R, S, Z, ...); '' once it is reaped."""
    try:
        status = Path(f'/proc/{pid}/status').read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone; or going, as it is reaped while the file is read
        return ''
    return next(line.split()[1] for line in status.splitlines() if line.startswith('State:'))


@pytest.mark.slow
def test_a_forked_command_ends_as_a_plain_one_does():
    """The exit status and both outputs of a command refused at its flags, forked and as a new interpreter."""
    forked, plain = (
        start_process(BAD_FLAG, fork=fork, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for fork in (True, False)
    )
    assert isinstance(forked, forkserver.ForkedPopen) and not isinstance(plain, forkserver.ForkedPopen)
    ends = [(process.communicate(timeout=300), process.returncode) for process in (forked, plain)]
    assert ends[0] == ends[1]
    (_, err), status = ends[0]
    assert status == 2 and "argument --batch_size: invalid int value: 'many'" in err, err


@pytest.mark.slow
def test_an_ended_forked_command_keeps_its_pid_until_the_test_has_waited():
    """The server sends a child's exit status leaving it a zombie, and reaps it only once the test has the status: a
    signal the test sends to a job that has just ended reaches no process that the freed pid went to."""
    process = start_process(BAD_FLAG, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert isinstance(process, forkserver.ForkedPopen)
    process.stderr.read()  # to the end: the command has closed its outputs
    # The server has seen it end and sent its status, not yet read here.
    assert select.select([process._connection], [], [], 300)[0], 'no exit status from the fork server'
    assert state(process.pid) == 'Z'
    os.kill(process.pid, signal.SIGTERM)  # reaches the zombie, and so no other process
    assert process.wait(timeout=60) == 2
    wait_until(lambda: state(process.pid) == '', 60, 'the fork server reaped its child')


@pytest.mark.parametrize('end', ['exit 3', 'SIGKILL'])
def test_an_exit_status_reported_unreaped_is_the_one_waitpid_gives(end):
    child = os.fork()
    if child == 0:
        if end == 'exit 3':
            os._exit(3)
        signal.pause()
        os._exit(0)
    if end == 'SIGKILL':
        os.kill(child, signal.SIGKILL)
    info = os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
    _, status = os.waitpid(child, 0)
    assert forkserver.wait_status(info) == status


@pytest.mark.slow
def test_a_forked_launchers_ranks_are_its_children_and_start_as_its_plain_ranks_do(tmp_path):
    """Composer's launcher forked from the server forks its ranks from itself: each is its child, in its session,
    and begins as a plain launcher's rank (a new interpreter) does, with none of what the launcher changed in its
    own process (its logging, its signal handlers, the cleanup of its temporary folder)."""
    ranks = {}
    for fork in (True, False):
        out = tmp_path / ('forked' if fork else 'plain')
        out.mkdir()
        command = [LAUNCHER, '-n', '2', str(REPO / 'tests' / 'two_rank_probe.py'), *TINY, '--image_size', '32']
        command += ['--batch_size', '4', '--max_duration', '1ba']
        with start_job(command, REPO, fork=fork, env={'PROBE_DIR': str(out)}) as launcher:
            stdout, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stdout[-2000:] + stderr[-3000:]
        ranks[fork] = [json.loads((out / f'rank{rank}.json').read_text())['process'] for rank in range(2)]
        for rank in ranks[fork]:
            assert (rank.pop('parent'), rank.pop('session'), rank.pop('group')) == (launcher.pid,) * 3
    assert [rank.pop('started_as') for rank in ranks[True]] == ['forkserver.py'] * 2
    assert [rank.pop('started_as') for rank in ranks[False]] == ['two_rank_probe.py'] * 2
    # What a fork cannot give: a forked rank keeps the fork server's hash seed, a new interpreter draws its own
    # (why the tests of processes also run as plain ones: make test-processes).
    forked_hashes, plain_hashes = ([rank.pop('string_hash') for rank in ranks[fork]] for fork in (True, False))
    assert forked_hashes[0] == forked_hashes[1] and plain_hashes[0] != plain_hashes[1]
    assert ranks[True] == ranks[False]
