"""What this machine can run of the flags given, checked once the GPU is known (hardware.py): precision, attention
and the kernels past the fast recipe (docs/speed.md), --compile, fp8, pinned memory and FSDP; a flag that needs a
GPU, a package or another flag is refused in one line before anything is built (config.py's settle_speed and
settle_batch)."""

import argparse
import importlib.metadata
import importlib.util
import os
import shutil

from guards.arguments import ConfigError
from settings import hardware
from settings.model_folder import ModelFolder

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


def check_device(flags: argparse.Namespace, model_name: str, folder: ModelFolder, gpu: hardware.Gpu | None) -> None:
    """Flags that need a GPU, or a package, or another flag, on this machine (what needs the batch settled too:
    check_one_microbatch_a_step)."""
    has_gpu = gpu is not None
    if not has_gpu and flags.precision != 'fp32':
        raise ConfigError(
            f'--precision {flags.precision} needs a GPU; on CPU Composer trains in fp32 only: '
            'pass --precision fp32 or leave it unset'
        )
    if has_gpu and flags.precision == 'amp_bf16' and not gpu.bf16:
        raise ConfigError(f'--precision amp_bf16: {gpu.name} has no bf16 support; pass --precision amp_fp16')
    if flags.attention == 'xformers':
        try:
            import xformers  # noqa: F401
        except ImportError:
            raise ConfigError(
                '--attention xformers: xformers is not installed; install it with '
                "pip install 'xformers==0.0.30' (Linux x86_64 with CUDA) or use --attention sdpa"
            )
        if not has_gpu:
            raise ConfigError(
                '--attention xformers: xFormers attention runs on CUDA GPUs only; use --attention sdpa on this machine'
            )
    check_kernels(flags, has_gpu)
    if flags.compile and not has_gpu:
        # Measured: the forward pass compiles, then Inductor's C++ codegen (outer-loop fusion with a local buffer,
        # which GPUs' Triton codegen does not use) fails on the backward graph. Dynamo's tracing is tested on CPU.
        raise ConfigError(
            "--compile: torch 2.7.0's Inductor fails compiling this model's backward pass for CPU "
            '(KeyError in its C++ code generation, after minutes of compiling); use --compile on a GPU'
        )
    if flags.fp8:
        check_fp8(flags, model_name, folder, gpu)
    if flags.pin_memory and not has_gpu:
        raise ConfigError('--pin_memory pins batches for copies to a GPU, and there is none: leave it out')
    if flags.low_precision_norm and flags.precision == 'fp32':
        raise ConfigError(
            '--low_precision_norm runs the norms in the autocast precision: it needs --precision '
            'amp_bf16 or amp_fp16 (a GPU)'
        )
    if flags.fsdp != 'none' and not has_gpu:
        raise ConfigError(
            f'--fsdp {flags.fsdp}: Composer shards with FSDP on CUDA GPUs only; on CPU leave '
            '--fsdp none (each rank holds a full replica, synchronized by DDP over gloo)'
        )
    if flags.fsdp_state_dict_type != 'full' and flags.fsdp == 'none':
        raise ConfigError(
            f'--fsdp_state_dict_type {flags.fsdp_state_dict_type}: applies to --fsdp checkpoints only; '
            'without --fsdp rank 0 writes one file'
        )


def check_kernels(flags: argparse.Namespace, has_gpu: bool) -> None:
    """The kernels past the fast recipe (docs/speed.md): each where it can run, or one line."""
    if flags.attention == 'cudnn':
        if not has_gpu:
            raise ConfigError('--attention cudnn: cuDNN attention runs on CUDA GPUs only; use --attention sdpa here')
        version = importlib.metadata.version('torch').split('+')[0]
        if tuple(int(part) for part in version.split('.')[:2]) < (2, 6):
            raise ConfigError(
                f"--attention cudnn: SDPA's backend priority needs torch 2.6 or newer (this is {version}); "
                'use --attention sdpa'
            )
    if flags.cudnn_benchmark and not has_gpu:
        raise ConfigError('--cudnn_benchmark: cuDNN autotunes GPU convolutions; there is no GPU here')
    if flags.fused_groupnorm:
        if importlib.util.find_spec('triton') is None:
            raise ConfigError('--fused_groupnorm: a Triton kernel, and triton is not installed (pip install triton)')
        if not has_gpu and os.environ.get('TRITON_INTERPRET') != '1':
            raise ConfigError(
                '--fused_groupnorm: a Triton kernel for CUDA GPUs; on a CPU it runs only under TRITON_INTERPRET=1 '
                "(Triton's interpreter: slow, for tests)"
            )


def check_one_microbatch_a_step(microbatch: int | str, device_batch: int, world_size: int) -> None:
    """reduce-overhead's CUDA graphs (Inductor's cudagraph trees) replay each microbatch's forward and backward into
    the same static memory, so with gradient accumulation a microbatch's outputs, its gradients among them, can be
    overwritten by the next one's replay before the step uses them. Untested on a GPU: refused until it is."""
    replays = 'CUDA graphs replay every microbatch into the same memory'
    one_a_step = f'pass --device_train_microbatch_size {device_batch} (one microbatch a step)'
    if microbatch == 'auto':
        raise ConfigError(
            f'--compile reduce-overhead: {replays}, and --device_train_microbatch_size auto lets Composer split the '
            f'device batch of {device_batch} into several: {one_a_step}, or another --compile mode'
        )
    if microbatch < device_batch:
        raise ConfigError(
            f'--compile reduce-overhead: {replays}, and this step accumulates {device_batch // microbatch} '
            f'microbatches of {microbatch} (device batch {device_batch}): {one_a_step} or --batch_size '
            f'{microbatch * world_size} ({microbatch} per device), or another --compile mode'
        )


def check_fp8(flags: argparse.Namespace, model_name: str, folder: ModelFolder, gpu: hardware.Gpu | None) -> None:
    """torchao's float8 training needs the float8 matrix units of compute capability 8.9 and later, bf16 autocast
    around it, and linear layers to convert: a diffusion transformer's."""
    if not folder.is_transformer:
        raise ConfigError(
            f"--fp8: float8 training converts a diffusion transformer's linear layers; {model_name} is a UNet, "
            'mostly convolutions'
        )
    if gpu is None or gpu.capability < FP8_CAPABILITY:
        where = (
            'no GPU here'
            if gpu is None
            else f'{gpu.name} has compute capability {gpu.capability[0]}.{gpu.capability[1]}'
        )
        raise ConfigError(
            f'--fp8 needs float8 matrix units (an H100, H200 or newer: compute capability 8.9 or more); {where}'
        )
    if flags.precision != 'amp_bf16':
        raise ConfigError(
            f'--fp8 trains with bf16 autocast around the float8 matmuls: leave --precision {flags.precision} out'
        )
    if importlib.util.find_spec('torchao') is None:
        raise ConfigError(
            "--fp8: torchao is not installed: pip install 'torchao==0.11.0' (for torch 2.7; see docs/install.md)"
        )


# Where PyTorch's loader workers hand their batches to the main process: shared memory, which a container limits
# (Docker's default 64 MB), and which each worker fills with up to 2 batches ahead (the loader's prefetch_factor).
SHARED_MEMORY = '/dev/shm'
BATCHES_AHEAD_PER_WORKER = 2
# Streaming keeps each epoch's sample order there too, as int64 ids (StreamingDataset._share_work), on every node.
STREAMING_BYTES_PER_SAMPLE = 8
MORE_SHARED_MEMORY = (
    'give the container more shared memory (docker run --shm-size 8g; on Kubernetes an emptyDir of medium Memory on '
    '/dev/shm)'
)


def sample_bytes(image_size: int, precomputed: bool, synthetic: bool) -> int:
    """Bytes of a sample of the batches in flight from the loader workers: uint8 images (random tensors: float32).
    Batches of precomputed latents, a fraction of their images' size, are not counted."""
    return 0 if precomputed else 3 * image_size**2 * (4 if synthetic else 1)


def check_shared_memory(
    location: str | None, num_workers: int, device_batch: int, image_size: int, sample: int, epoch_samples: int | None
) -> None:
    """A /dev/shm too small for Streaming's epoch (its sample order, STREAMING_BYTES_PER_SAMPLE a sample of the
    `epoch_samples`, None for random tensors) and the loader workers' batches (of `sample` bytes a sample) ends the
    run at its first batch with a bus error (the worker's traceback, or a line that does not say shared memory):
    found at start, the fix named."""
    if not os.path.isdir(SHARED_MEMORY):
        return
    total, fix = shutil.disk_usage(SHARED_MEMORY).total, MORE_SHARED_MEMORY
    order = (epoch_samples or 0) * STREAMING_BYTES_PER_SAMPLE
    batches = num_workers * BATCHES_AHEAD_PER_WORKER * device_batch * sample
    if order > total:
        raise ConfigError(
            f'{location}: {SHARED_MEMORY} holds {total / 1e6:.0f} MB, and Streaming keeps the '
            f"epoch's order of its {epoch_samples:,} samples there ({order / 1e6:.0f} MB): {fix}"
        )
    if order + batches > total:
        order_too = f", beside Streaming's {order / 1e6:.0f} MB of sample order" if order >= 1e6 else ''
        raise ConfigError(
            f'--num_workers {num_workers}: {SHARED_MEMORY} holds {total / 1e6:.0f} MB, and the loader workers '
            f'hand over up to {batches / 1e6:.0f} MB of batches there ({BATCHES_AHEAD_PER_WORKER} batches of '
            f'{device_batch} at {image_size}px each{order_too}): {fix}, or pass fewer --num_workers'
        )
