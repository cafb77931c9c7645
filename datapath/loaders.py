"""The DataLoader of a job that a signal may stop (stopping.py): its workers leave a job-wide Ctrl-C or SIGTERM to
the main process, which handles it and shuts them down; and a stop that comes while it starts its workers waits
until they have started, as a loader stopped halfway through starting them prints PyTorch's traceback
(`'_MultiProcessingDataLoaderIter' object has no attribute '_workers'`) when it is collected."""

import os
import re

from torch.utils.data import DataLoader

from guards.stopping import quiet_loader_worker, stops_held

# How long the run waits for a loader worker's next batch before it ends: far above a batch's worst honest wait
# (a shard's download, tried 3 times against a hung server, about a minute), so that only a worker that stopped
# for good or hangs on a dead filesystem reaches it. LOADER_TIMEOUT_SECONDS in the environment sets another.
LOADER_TIMEOUT_SECONDS = 600.0


def loader_timeout() -> float:
    return float(os.environ.get('LOADER_TIMEOUT_SECONDS') or LOADER_TIMEOUT_SECONDS)


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
    killed = re.search(r'DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)', text)
    if killed:
        return (
            f'a loader worker (pid {killed.group(1)}) was killed by signal {killed.group(2)} (the kernel ends '
            'processes with SIGKILL when memory runs out): pass fewer --num_workers, or give the machine more memory'
        )
    exited = re.search(r'DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly', text)
    if exited:
        return f'a loader worker (pid {exited.group(1)}) exited unexpectedly (killed?); the run cannot go on without it'
    return None


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
