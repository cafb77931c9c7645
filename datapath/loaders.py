"""The DataLoader of a job that a signal may stop (stopping.py): its workers leave a job-wide Ctrl-C or SIGTERM to
the main process, which handles it and shuts them down; and a stop that comes while it starts its workers waits
until they have started, as a loader stopped halfway through starting them prints PyTorch's traceback
(`'_MultiProcessingDataLoaderIter' object has no attribute '_workers'`) when it is collected.

A worker that dies or stops for good ends the run in one line (loader_failure) within loader_timeout(), and a
/dev/shm too full for the loader's queues or Streaming's blocks says so (shared_memory_full)."""

import os
import re
import shutil
import signal
import threading
import time
import traceback

from torch.utils.data import DataLoader

from guards.outputs import DISK_FULL
from guards.stopping import STOPS, quiet_loader_worker
from settings.device_checks import MORE_SHARED_MEMORY, SHARED_MEMORY

# How long the run waits for a loader worker's next batch before it ends: far above a batch's worst honest wait
# (a shard's download, tried 3 times against a hung server, about a minute), so that only a worker that stopped
# for good or hangs on a dead filesystem reaches it. LOADER_TIMEOUT_SECONDS in the environment sets another.
LOADER_TIMEOUT_SECONDS = 600.0


def loader_timeout() -> float:
    return float(os.environ.get('LOADER_TIMEOUT_SECONDS') or LOADER_TIMEOUT_SECONDS)


# The workers the watchdog killed for sending nothing (silent_worker_watchdog), by pid: their end reads as a death
# in PyTorch's error, and loader_failure says what happened instead.
silent_workers_killed: set[int] = set()


def loader_failure(error: RuntimeError, timeout: float) -> str | None:
    """One line for PyTorch's RuntimeError of a loader worker that died or went silent (its message holds a
    worker's traceback or a paragraph of advice), None for any other error."""
    text = str(error)
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
    if any(int(pid) in silent_workers_killed for pid in pids.split(',')):
        return (
            f'a loader worker (pid {pids}) sent no batch in {timeout:.0f} s (stopped, or hung on a filesystem or a '
            'remote): killed, and the run ends rather than wait for it; LOADER_TIMEOUT_SECONDS sets the wait'
        )
    if named.group(3):
        return (
            f'a loader worker (pid {pids}) was killed by signal {named.group(3)} (the kernel ends processes with '
            'SIGKILL when memory runs out): pass fewer --num_workers, or give the machine more memory'
        )
    return f'a loader worker (pid {pids}) exited unexpectedly (killed?); the run cannot go on without it'


# Where a full /dev/shm is met in the main process: the semaphores of the loader's queues (POSIX named semaphores
# live there) and Streaming's shared-memory blocks. Their OSError names no file, and read as a full output disk.
SHARED_MEMORY_CODE = ('/multiprocessing/synchronize.py', '/multiprocessing/shared_memory.py', '/streaming/base/shared/')


def shared_memory_full(error: OSError) -> str | None:
    """One line for a full /dev/shm met while the loader or Streaming set up their shared memory, None for any
    other OSError."""
    if error.errno not in DISK_FULL or error.filename:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not any(code in frame.filename for frame in frames for code in SHARED_MEMORY_CODE):
        return None
    held = f' (it holds {shutil.disk_usage(SHARED_MEMORY).total / 1e6:.1f} MB)' if os.path.isdir(SHARED_MEMORY) else ''
    return (
        f"{SHARED_MEMORY} is full{held}: the loader workers' queues and Streaming's shared memory live there: "
        f'{MORE_SHARED_MEMORY}, or pass fewer --num_workers'
    )


class StoppableDataLoader(DataLoader):
    """Also ends, in a RuntimeError that loader_failure makes one line, a run whose worker died or sent nothing for
    loader_timeout() while the run waited for it, and raises it where the run asks for a batch. PyTorch's own
    handler of a worker's death (SIGCHLD) raises wherever the main thread happens to be, mid-step or mid-way
    through reporting another error, and its own timeout covers the queue of batches, not a batch taken from it:
    unpickling a batch asks the worker that made it for its shared memory, and against a stopped worker that wait
    has no end (seen: the run hung at 0% CPU). Here PyTorch's check of its workers every few seconds, and a watchdog
    that kills a worker the run has waited on too long, raise in the main thread as it waits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, worker_init_fn=quiet_loader_worker, **kwargs)

    def _get_iterator(self):
        with STOPS.holding():
            iterator = super()._get_iterator()
        main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers are set
        if self.num_workers and main_thread and signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, None):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # PyTorch's handler, set once per process
        return iterator

    def __iter__(self):
        batches = super().__iter__()
        if not self.num_workers:
            yield from batches
            return
        waiting, done = [None], threading.Event()  # since when the run has waited for a batch (monotonic)
        watchdog = threading.Thread(
            target=silent_worker_watchdog, args=(batches, loader_timeout(), waiting, done), daemon=True
        )
        watchdog.start()
        try:
            while True:
                waiting[0] = time.monotonic()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except (OSError, EOFError) as error:  # a batch's transfer cut by its worker's death
                    raise dead_workers_error(batches) or error
                except RuntimeError as error:  # PyTorch's check found one dead: say how it ended, where it can
                    if 'exited unexpectedly' not in str(error):
                        raise
                    raise dead_workers_error(batches) or error from None
                finally:
                    waiting[0] = None
                yield batch
        finally:
            done.set()


def dead_workers_error(batches, wait: float = 5.0) -> RuntimeError | None:
    """PyTorch's words for the loader's workers that have ended, None where all are still alive after `wait`
    seconds: a worker's connections close as it dies, a moment before it can be seen to have ended."""
    deadline = time.monotonic() + wait
    while not (dead := [worker for worker in getattr(batches, '_workers', []) if not worker.is_alive()]):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    if len(dead) == 1 and dead[0].exitcode is not None and dead[0].exitcode < 0:
        return RuntimeError(
            f'DataLoader worker (pid {dead[0].pid}) is killed by signal: {signal.strsignal(-dead[0].exitcode)}.'
        )
    return RuntimeError(
        f'DataLoader worker (pid(s) {", ".join(str(worker.pid) for worker in dead)}) exited unexpectedly'
    )


def silent_worker_watchdog(batches, timeout: float, waiting: list, done: threading.Event) -> None:
    """Kills the loader's live workers once the run has waited `timeout` seconds for a batch: PyTorch then finds
    them dead at its next check, and the run ends in a line naming the wait."""
    while not done.wait(1.0):
        since = waiting[0]
        if since is None or time.monotonic() - since < timeout:
            continue
        for worker in getattr(batches, '_workers', []):
            if worker.is_alive():
                silent_workers_killed.add(worker.pid)
                worker.kill()
        waiting[0] = None
