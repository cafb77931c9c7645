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


# The device files a GPU driver makes (NVIDIA's, AMD's for ROCm builds of torch), container runtimes included: where
# none exists there is no GPU, known without loading torch (seconds), so that a bad flag is answered at once.
GPU_DEVICE_FILES = ('/dev/nvidiactl', '/dev/kfd')


@functools.cache
def gpu() -> Gpu | None:
    """This process's CUDA device (the first visible one), or None on a machine without one."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return None
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


# PyTorch's threads on a CPU where none are given: one. The count changes how sums are split, so the weights a run
# trains: one thread trains the same weights on every machine, and never waits for cores that other work holds
# (two threads beside busy processes ran the tiny model several times slower; docs/measurement.md has the figures).
DEFAULT_CPU_THREADS = 1


def cpu_threads() -> tuple[int, bool, str]:
    """PyTorch's threads for a run on the CPU, whether they were given (OMP_NUM_THREADS) rather than the default,
    and why."""
    given = os.environ.get('OMP_NUM_THREADS', '')
    if given.isdigit() and int(given) > 0:
        return int(given), True, f'OMP_NUM_THREADS={given}'
    why = 'the default on a CPU: the same weights on every machine, and no waiting on a busy one'
    if process_cores() > DEFAULT_CPU_THREADS:
        why += f'; on an idle machine of {process_cores()} cores more may run faster, with other numerics'
    return DEFAULT_CPU_THREADS, False, why


def process_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
