"""The machine a run settles its values for: whether a CUDA GPU is present, its name, memory and bf16 support, and
the number of processes the launcher started. Asked once, when the flags' own values have been checked: the
question loads torch (seconds), so a mistyped flag is answered before it."""

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bf16: bool
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability: (8, 0) A100, (9, 0) H100 and H200


@functools.cache
def gpu() -> Gpu | None:
    """This process's CUDA device (the first visible one), or None on a machine without one."""
    import torch  # the one heavy import of the settling step; see the module docstring

    if not torch.cuda.is_available():
        return None
    return Gpu(
        torch.cuda.get_device_name(),
        torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        torch.cuda.is_bf16_supported(),
        torch.cuda.get_device_capability(),
    )


def world_size() -> int:
    """The processes training together: WORLD_SIZE as Composer's launcher (or torchrun) sets it, else one, which is
    what composer.utils.dist.get_world_size reads before the process group exists."""
    return int(os.environ.get('WORLD_SIZE', '1'))


def cpu_threads(loader_workers: int) -> tuple[int, str]:
    """PyTorch's threads for a run on the CPU, and why: the cores this process may use (its affinity, shared by the
    launcher's processes on this machine), less one per loader worker and less the cores other work kept busy over
    the last minute (the load average), at least one. PyTorch's default, a thread per core, collapses when other
    work holds those cores: its threads wait for each other at every operation (the tiny model on two busy cores:
    18 to 28 img/s with two threads, 56 with one; benchmarks/results.md). OMP_NUM_THREADS, where set, is taken
    instead."""
    given = os.environ.get('OMP_NUM_THREADS', '')
    if given.isdigit() and int(given) > 0:
        return int(given), f'OMP_NUM_THREADS={given}'
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    processes = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0
    threads = max(1, min(cores // processes - loader_workers, cores - int(load)))
    shared = f' shared by {processes} processes' if processes > 1 else ''
    return threads, (
        f'{cores} cores for this process{shared}, {loader_workers} loader worker(s), load average {load:.2f} over '
        'the last minute'
    )
