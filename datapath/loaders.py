"""The DataLoader of a job that a signal may stop (stopping.py): its workers leave a job-wide Ctrl-C or SIGTERM to
the main process, which handles it and shuts them down; and a stop that comes while it starts its workers waits
until they have started, as a loader stopped halfway through starting them prints PyTorch's traceback
(`'_MultiProcessingDataLoaderIter' object has no attribute '_workers'`) when it is collected.

A worker that dies or stops for good ends the run in one line (loader_failure) within loader_timeout()."""

import os
import re
import threading
import time

import psutil
from torch.utils.data import DataLoader

from guards.stopping import quiet_loader_worker, stops_held

# How long the run waits for a loader worker's next batch before it ends: far above a batch's worst honest wait
# (a shard's download, tried 3 times against a hung server, about a minute), so that only a worker that stopped
# for good or hangs on a dead filesystem reaches it. LOADER_TIMEOUT_SECONDS in the environment sets another.
LOADER_TIMEOUT_SECONDS = 600.0


def loader_timeout() -> float:
    return float(os.environ.get('LOADER_TIMEOUT_SECONDS') or LOADER_TIMEOUT_SECONDS)


# The workers a watchdog killed because they were stopped (SIGSTOP, a debugger), by pid: their end reads as a
# kill in PyTorch's error, and loader_failure says what happened instead.
stopped_workers_killed: set[int] = set()


def loader_failure(error: RuntimeError, timeout: float) -> str | None:
    """One line for PyTorch's RuntimeError of a loader worker that died or went silent (its message holds a
    worker's traceback or a paragraph of advice), None for any other error."""
    text = str(error)
    if 'DataLoader timed out' in text:
        return (
            f'a loader worker sent no batch in {timeout:.0f} s (stopped, or hung on a filesystem or a remote): the run '
            'ends rather than wait for it; LOADER_TIMEOUT_SECONDS sets the wait'
        )
    if 'out of shared memory' in text or 'Bus error' in text:
        return (
            'a loader worker ran out of shared memory (/dev/shm) for its batches: give the container more (docker '
            "run --shm-size 8g, Kubernetes' emptyDir medium Memory on /dev/shm), or pass fewer --num_workers"
        )
    named = re.search(
        r'DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (is killed by signal: ([^.]+)|exited unexpectedly)', text
    )
    if not named:
        return None
    pids = named.group(1)
    if any(int(pid) in stopped_workers_killed for pid in pids.split(',')):
        return (
            f'a loader worker (pid {pids}) was stopped (SIGSTOP?) and sent no batch in {timeout:.0f} s: killed, '
            'and the run ends rather than wait for it; LOADER_TIMEOUT_SECONDS sets the wait'
        )
    if named.group(3):
        return (
            f'a loader worker (pid {pids}) was killed by signal {named.group(3)} (the kernel ends processes with '
            'SIGKILL when memory runs out): pass fewer --num_workers, or give the machine more memory'
        )
    return f'a loader worker (pid {pids}) exited unexpectedly (killed?); the run cannot go on without it'


class StoppableDataLoader(DataLoader):
    """Also waits at most loader_timeout() for a worker's batch (PyTorch waits forever on a stopped worker by
    default); its error, and that of a worker that died, raised anywhere in the main process by PyTorch's SIGCHLD
    handler, is made one line by loader_failure where the run reports its errors."""

    def __init__(self, *args, **kwargs):
        if kwargs.get('num_workers', 0) > 0:
            kwargs.setdefault('timeout', loader_timeout())
        super().__init__(*args, worker_init_fn=quiet_loader_worker, **kwargs)

    def _get_iterator(self):
        with stops_held():
            return super()._get_iterator()

    def __iter__(self):
        batches = super().__iter__()
        if not self.num_workers:
            yield from batches
            return
        fed, done = threading.Event(), threading.Event()
        watchdog = threading.Thread(target=kill_stopped_workers, args=(batches, self.timeout, fed, done), daemon=True)
        watchdog.start()
        try:
            for batch in batches:
                fed.set()
                yield batch
        finally:
            done.set()


def kill_stopped_workers(batches, timeout: float, fed: threading.Event, done: threading.Event) -> None:
    """Each time `timeout` passes without a batch, kills the loader's workers that are stopped. PyTorch's own
    timeout covers a wait on the queue of batches, not a batch already taken from it: unpickling its tensors asks
    the worker that made them for their shared memory, and against a stopped worker that wait has no end (seen:
    the run hung at 0% CPU)."""
    last_batch = time.monotonic()
    while not done.wait(1.0):
        if fed.is_set():
            fed.clear()
            last_batch = time.monotonic()
        if time.monotonic() - last_batch < timeout:
            continue
        last_batch = time.monotonic()
        for worker in getattr(batches, '_workers', []):
            try:
                if psutil.Process(worker.pid).status() == psutil.STATUS_STOPPED:
                    stopped_workers_killed.add(worker.pid)
                    worker.kill()
            except (psutil.Error, ValueError):  # gone already
                pass
