"""The kernels past the fast recipe, turned on for a run by their flags (docs/speed.md): cuDNN's fused attention
first among SDPA's backends (--attention cudnn), cuDNN's autotuning of the convolutions (--cudnn_benchmark), and
a UNet's GroupNorm + SiLU as one Triton kernel (--fused_groupnorm, fused_groupnorm.py). NVIDIA's MLPerf
Training submissions for Stable Diffusion run on kernels of these kinds; none is in a recipe until the GPU
campaign measures it against the fast recipe. device_checks.py checks where each can run."""

import contextlib

import torch

from models.fused_groupnorm import use_fused_groupnorm_silu
from settings.run_sections import SpeedSection


def use_kernels(speed: SpeedSection, model) -> list[str]:
    """Turns on the kernels the run's flags ask for that change the model or the process; the lines saying so."""
    lines = []
    if speed.fused_groupnorm:
        fused = use_fused_groupnorm_silu(model.denoiser)
        lines.append(f'fused_groupnorm: {fused} GroupNorm + SiLU pairs of the UNet run as one Triton kernel')
    if speed.cudnn_benchmark:
        # Each new convolution shape is tried with cuDNN's algorithms once: the first batch (left out of the
        # throughput windows) and the first validation batch pay for it.
        torch.backends.cudnn.benchmark = True
        lines.append("cudnn_benchmark: cuDNN picks each convolution shape's fastest algorithm on its first use")
    return lines


def attention_backends(attention: str) -> contextlib.AbstractContextManager:
    """With --attention cudnn, SDPA tries cuDNN's fused attention first, then flash, memory-efficient and math
    attention, each where the inputs allow it (torch's priority order; the context restores the one before)."""
    if attention != 'cudnn':
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)
