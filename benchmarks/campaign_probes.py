"""The GPU campaign's measurements that are not benchmark.py runs, each run by benchmarks/gpu_campaign.py in a
process of its own and printing one JSON line last:

    python -m benchmarks.campaign_probes environment
    python -m benchmarks.campaign_probes checks
    python -m benchmarks.campaign_probes transformer_step --model_name flux-schnell --image_size 256 [--fp8] [--compile]
    python -m benchmarks.campaign_probes launches --model_name sd2-base --image_size 512 --microbatch 32

environment: the device, driver and versions, and two measured ceilings: a bf16 matrix multiply's FLOP/s (fp32 on
a CPU) and a device-to-device copy's bytes per second. checks: the correctness of the paths past the fast recipe,
run before their speed is measured (the fused GroupNorm+SiLU against PyTorch's, cuDNN attention picked and equal
to math attention, an fp8 step's loss against bf16's), each passed, failed or skipped with its error and bound.
transformer_step: a denoiser's forward and backward per image
from precomputed latents in bf16, weights and gradients on the device, no optimizer (one GPU holds Flux's weights,
not its AdamW state), with its training FLOPs, for MLPerf flux1's per-GPU rows; --compile compiles the model's
transformer's repeated blocks, each block's code compiled once (Diffusers' regional compilation where the model
declares its blocks, else torch.compile on each block of its block lists), so a compile costs a block's, not the
whole model's (torchao's float8 is made to run compiled: Inductor fuses its scaling and casts).
launches: the operations one microbatch's step dispatches, counted on the meta device, with and without
--fused_groupnorm.
"""

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch
from torch.utils.data import default_collate

from benchmarks.launch_counts import step_ops
from costs.results import cpu_name, package_versions
from data import SyntheticLatentsDataset
from models import fused_groupnorm
from models.diffusion_transformer import convert_to_float8
from models.groupnorm_silu_kernels import triton_available
from models.stable_diffusion import build_model
from settings.model_folder import LATENT_DOWNSAMPLE, resolve_model_dir

COMPILE_BACKEND = 'inductor'  # torch.compile's backend for --compile; the CPU tests trace with aot_eager
MEASURES = 'the transformer forward and backward only (no optimizer step, no encoders)'


def timed(step, device: torch.device, repeats: int, warmups: int = 1) -> float:
    """Median seconds of `step` over `repeats` calls after `warmups` calls, the device synchronized around each."""
    for _ in range(warmups):
        step()
    seconds = []
    for _ in range(repeats):
        if device.type == 'cuda':
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == 'cuda':
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def environment() -> dict:
    on_gpu = torch.cuda.is_available()
    device = torch.device('cuda' if on_gpu else 'cpu')
    size, dtype = (8192, torch.bfloat16) if on_gpu else (1024, torch.float32)
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    matmul = timed(lambda: a @ b, device, 10)
    source = torch.empty(2**28 if on_gpu else 2**24, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = timed(lambda: target.copy_(source), device, 10)
    return {
        'device': torch.cuda.get_device_name() if on_gpu else cpu_name(),
        'driver': torch.cuda.driver_version() if on_gpu and hasattr(torch.cuda, 'driver_version') else None,
        'cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version() if on_gpu else None,
        'python': platform.python_version(),
        'versions': package_versions(),
        'memory_gb': torch.cuda.get_device_properties(0).total_memory / 1e9 if on_gpu else None,
        'matmul_tflops': 2 * size**3 / matmul / 1e12,
        'matmul_dtype': str(dtype).removeprefix('torch.'),
        'copy_gb_s': 2 * source.numel() / copy / 1e9,  # read and written
    }


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """‖out − reference‖ / ‖reference‖ in float64; NaN anywhere never passes."""
    out, reference = out.double(), reference.double()
    error = (torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)).item()
    return error if out.isfinite().all() else float('inf')


def verdict(error: float, bound: float) -> dict:
    return {'passed': error <= bound, 'error': error, 'bound': bound}


def check_fused_groupnorm(device: torch.device) -> dict:
    """The fused GroupNorm+SiLU's Triton kernels against PyTorch's GroupNorm and SiLU in float64, bf16 inputs at
    SD2's widths, fresh random data, channels-last as the UNet's activations can be."""
    if not triton_available(device):
        return {'skipped': 'no Triton kernels on this device'}
    x = torch.randn(4, 320, 32, 32, device=device, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    weight, bias = torch.randn(320, device=device), torch.randn(320, device=device)
    out = fused_groupnorm.group_norm_silu(x, weight, bias, 32)
    reference = torch.nn.functional.silu(torch.nn.functional.group_norm(x.double(), 32, weight.double(), bias.double()))
    return verdict(relative_error(out, reference), 1e-2)  # bf16 output: between 1e-3 and 1e-2


def check_attention_cudnn(device: torch.device) -> dict:
    """cuDNN's fused attention, the only backend allowed (so an error if SDPA cannot pick it), against math
    attention on the same bf16 inputs upcast to float64's reference."""
    if device.type != 'cuda':
        return {'skipped': 'cuDNN attention runs on CUDA GPUs only'}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 10, 1024, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    except RuntimeError as error:
        return {'passed': False, 'error': float('inf'), 'bound': 1e-2, 'reason': str(error).splitlines()[0][:200]}
    reference = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return verdict(relative_error(out, reference), 1e-2)


def check_fp8(device: torch.device) -> dict:
    """A linear stack's loss trained one step in torchao's float8 against the same step in bf16 (fp32 on a CPU,
    the float8 casts emulated there): within 5%, float8's e4m3 forward keeping 3 bits of mantissa."""
    if device.type == 'cuda' and torch.cuda.get_device_capability() < (8, 9):
        return {'skipped': 'float8 matmuls need compute capability 8.9 (an H100, H200 or newer)'}
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    plain = plain.to(device, dtype)
    fp8 = copy.deepcopy(plain)
    convert_to_float8(fp8, emulate=device.type != 'cuda')
    x, target = torch.randn(64, 256, device=device, dtype=dtype), torch.randn(64, 256, device=device, dtype=dtype)
    losses = [torch.nn.functional.mse_loss(model(x).float(), target.float()) for model in (plain, fp8)]
    return verdict(abs(losses[1].item() - losses[0].item()) / losses[0].item(), 5e-2)


def checks() -> dict:
    """The checks, with the stack they ran on (the loan's first row: no environment row before it)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device('cuda' if on_gpu else 'cpu')
    return {
        'fused_groupnorm': check_fused_groupnorm(device),
        'attention_cudnn': check_attention_cudnn(device),
        'fp8': check_fp8(device),
        'driver': torch.cuda.driver_version() if on_gpu and hasattr(torch.cuda, 'driver_version') else None,
        'cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version() if on_gpu else None,
    }


def compile_blocks(denoiser: torch.nn.Module) -> int:
    """Compiles the denoiser's repeated blocks, each class's code once (Dynamo reuses it for every block of that
    class): Diffusers' compile_repeated_blocks where the model declares its blocks, else each module of its block
    lists (ModuleLists of one class). Returns how many blocks were compiled."""
    options = {'backend': COMPILE_BACKEND, 'dynamic': False}
    if getattr(denoiser, '_repeated_blocks', None):
        denoiser.compile_repeated_blocks(**options)
        names = set(denoiser._repeated_blocks)
        return sum(type(module).__name__ in names for module in denoiser.modules())
    blocks = [
        block
        for module in denoiser.modules()
        if isinstance(module, torch.nn.ModuleList) and len({type(block) for block in module}) == 1
        for block in module
    ]
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def transformer_step(model_name: str, image_size: int, microbatch: int, fp8: bool, compiled: bool = False) -> dict:
    on_gpu = torch.cuda.is_available()
    device = torch.device('cuda' if on_gpu else 'cpu')
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = build_model(resolve_model_dir(model_name), precomputed=True, init_device=device).to(dtype)
    if fp8:
        convert_to_float8(model.denoiser, emulate=not on_gpu)
    # Static shapes, as training.compile_config gives a run; AOT autograd compiles each block's backward.
    blocks = compile_blocks(model.denoiser) if compiled else 0
    shapes = model.precomputed_shapes(image_size // LATENT_DOWNSAMPLE)
    samples = SyntheticLatentsDataset(**shapes, num_samples=microbatch)
    batch = {
        name: tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
        for name, tensor in default_collate(list(samples)).items()
    }

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(model(batch), batch).backward()

    # Compiled: the first call compiles, the second runs any recompile or autotuning left, outside the timing.
    seconds = timed(step, device, 5, warmups=2 if compiled else 1)
    flops = model.trained_flops_per_image(image_size, image_size)
    return {
        'model_name': model_name,
        'image_size': image_size,
        'microbatch': microbatch,
        'fp8': fp8,
        'compiled': compiled,
        'compiled_blocks': blocks,
        'measures': MEASURES,
        'seconds_per_image': seconds / microbatch,
        'img_per_sec': microbatch / seconds,
        'trained_flops_per_image': flops,
        'trained_parameters': sum(p.numel() for p in model.denoiser.parameters()),
        'tflops': flops * microbatch / seconds / 1e12,
        'peak_gpu_memory_gb': torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None,
        'device': torch.cuda.get_device_name() if on_gpu else cpu_name(),
        'on_gpu': on_gpu,
    }


def launches(model_name: str, image_size: int, microbatch: int) -> dict:
    """The operations one microbatch's step dispatches from the host (benchmarks/launch_counts.py, on the meta
    device), with and without --fused_groupnorm: what the fused kernel saves the host."""
    plain = step_ops(model_name, image_size, microbatch)['eager_fp32']
    fused = step_ops(model_name, image_size, microbatch, fused_groupnorm=True)['eager_fp32']
    return {
        'model_name': model_name,
        'image_size': image_size,
        'microbatch': microbatch,
        'ops': plain,
        'ops_fused': fused,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('probe', choices=['environment', 'checks', 'transformer_step', 'launches'])
    parser.add_argument('--model_name', default='flux-schnell')
    parser.add_argument('--image_size', type=int, default=256)
    parser.add_argument('--microbatch', type=int, default=1)
    parser.add_argument('--fp8', action='store_true', help="torchao's float8 training of the linear layers")
    parser.add_argument('--compile', action='store_true', help="torch.compile the transformer's blocks (Inductor)")
    args = parser.parse_args(argv)
    if args.probe == 'environment':
        measured = environment()
    elif args.probe == 'checks':
        measured = checks()
    elif args.probe == 'launches':
        measured = launches(args.model_name, args.image_size, args.microbatch)
    else:
        measured = transformer_step(args.model_name, args.image_size, args.microbatch, args.fp8, args.compile)
    print(json.dumps(measured), flush=True)
    return measured


if __name__ == '__main__':
    sys.exit(0 if main() else 1)
