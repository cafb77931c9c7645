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
