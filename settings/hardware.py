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


def cpu_threads(loader_workers: int) -> tuple[int, bool, str]:
    """PyTorch's threads for a run on the CPU, whether they were given (OMP_NUM_THREADS) rather than chosen, and
    why. Chosen from what this process is given and nothing else: the cores of its affinity (shared by the
    launcher's processes on this machine) less one per loader worker, at least one. Never from the machine's load:
    the thread count changes how sums are split, so the weights a run trains; one command must train the same
    weights on a busy machine and a quiet one. A busy machine gets a hint instead, as more threads than free cores
    wait for each other at every operation (the tiny model on two busy cores: 18 to 28 img/s with two threads, 56
    with one; benchmarks/results.md)."""
    given = os.environ.get('OMP_NUM_THREADS', '')
    if given.isdigit() and int(given) > 0:
        return int(given), True, f'OMP_NUM_THREADS={given}'
    cores = process_cores()
    processes = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    threads = max(1, cores // processes - loader_workers)
    shared = f' shared by {processes} processes' if processes > 1 else ''
    why = f'{cores} cores for this process{shared}, {loader_workers} loader worker(s)'
    load = load_average()
    free = max(1, cores - int(load))
    if free < threads:
        why += (
            f'; load average {load:.2f}: other work holds {cores - free} of the cores, and fewer threads may run '
            f'faster here (--cpu_threads {free}), with other numerics'
        )
    return threads, False, why


def process_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def load_average() -> float:
    """The machine's load average over the last minute: runnable processes, this one's own included."""
    return os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0
