"""The measurements behind benchmarks/ema_update.py: one EMA update of the SD2 base UNet, ours (ema.py) against
Composer's, timed, with the memory each holds and allocates; on a GPU, an SD2 training step for scale."""

import gc
import os
import statistics
import time

import psutil
import torch
from composer.algorithms.ema.ema import EMAParameters, compute_ema
from diffusers import UNet2DConditionModel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from costs.results import cpu_name
from ema import EMAWeights
from models.stable_diffusion import build_model
from settings.model_folder import CONFIGS_DIR

SMOOTHING = 2 ** -(1 / 1000)  # half life 1000ba, updated every batch: the published run


class AllocationCounter(TorchDispatchMode):
    """Bytes of new tensors made by out-of-place ops; `peak` is the most made between two in-place writes."""

    def __init__(self):
        super().__init__()
        self.total = self.peak = self._since_write = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.endswith('_'):
            self._since_write = 0
        elif not func.is_view:
            made = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.total += made
            self._since_write += made
            self.peak = max(self.peak, self._since_write)
        return out


def build_unet(device: torch.device) -> UNet2DConditionModel:
    config = UNet2DConditionModel.load_config(CONFIGS_DIR / 'sd2-base', subfolder='unet')
    with torch.device('meta'):
        unet = UNet2DConditionModel.from_config(config)
    unet.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in unet.parameters():
            param.normal_(0, 0.02, generator=generator)  # values do not matter for timing, only that they vary
    return unet


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def used_bytes(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == 'cuda' else psutil.Process().memory_info().rss


def state_bytes(state) -> int:
    """Bytes of the averaged tensors: ema.py's flat buffer, or Composer's per-name copies."""
    if isinstance(state, EMAWeights):
        return state.num_bytes
    tensors = [*state.named_parameters_dict.values(), *state.named_buffers_dict.values()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def measure(name, make, update, device, repeats, finish=lambda state: None):
    """make() -> state holding the average; update(state) runs one update. Returns a result row."""
    gc.collect()
    before_host, before_device = psutil.Process().memory_info().rss, used_bytes(device)
    state = make()
    update(state)  # warm-up, and touches every page of the state
    finish(state)
    sync(device)
    held_host = psutil.Process().memory_info().rss - before_host
    held_device = used_bytes(device) - before_device if device.type == 'cuda' else None
    times, blocking = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        update(state)
        blocking.append(time.perf_counter() - start)
        finish(state)
        sync(device)
        times.append(time.perf_counter() - start)
    with AllocationCounter() as counter:
        update(state)
        finish(state)
    row = {
        'name': name,
        'seconds': statistics.median(times),
        'blocking': statistics.median(blocking),
        'state_bytes': state_bytes(state),
        'host_bytes': held_host,
        'device_bytes': held_device,
        'temp_total': counter.total,
        'temp_peak': counter.peak,
    }
    del state
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.empty_cache()
    return row


def step_seconds(device, steps=5) -> tuple[float, float]:
    """Median fwd+bwd time of one microbatch of 4 at 512px and of one AdamW step, SD2 base, bf16 autocast."""
    model = build_model(CONFIGS_DIR / 'sd2-base', init_device=device)
    optimizer = torch.optim.AdamW(model.unet.parameters(), lr=1e-4, weight_decay=1e-3)
    batch = {
        'image': torch.rand(4, 3, 512, 512, device=device) * 2 - 1,
        'input_ids': torch.randint(0, 49408, (4, 77), device=device),
    }
    micro, opt = [], []
    for _ in range(steps + 1):
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()
        sync(device)
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        micro.append(middle - start)
        opt.append(time.perf_counter() - middle)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(micro[1:]), statistics.median(opt[1:])


def compare(device_name: str | None, repeats: int, time_step: bool = True) -> None:
    """Measures both implementations on `device_name` (default: cuda when there is a GPU, else cpu) and prints
    the table; on a GPU, with `time_step`, also EMA's share of an SD2 training step."""
    device = torch.device(device_name or ('cuda' if torch.cuda.is_available() else 'cpu'))
    unet = build_unet(device)
    numel = sum(p.numel() for p in unet.parameters())
    weight = 1 - SMOOTHING

    rows = [
        measure(
            'composer.algorithms.EMA',
            lambda: EMAParameters(unet),
            lambda ema: compute_ema(unet, ema, smoothing=SMOOTHING),
            device,
            repeats,
        ),
        measure('ema.py', lambda: _reset(EMAWeights(unet)), lambda ema: ema.update(weight), device, repeats),
    ]
    if device.type == 'cuda':
        rows.append(
            measure(
                'ema.py --ema_offload',
                lambda: _reset(EMAWeights(unet, offload=True)),
                lambda ema: ema.update(weight),
                device,
                repeats,
                finish=lambda ema: ema.join(),
            )
        )

    where = torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{cpu_name()}, {os.cpu_count()} cores'
    print(
        f'\nEMA update, SD2 base UNet: {numel:,} trainable fp32 parameters = {4 * numel / 1e9:.3f} GB; '
        f'{where}; torch {torch.__version__}, {torch.get_num_threads()} threads; median of {repeats}'
    )
    print(
        f'{"implementation":<24} {"s/update":>9} {"speedup":>8} {"state GB":>9} {"RSS +GB":>8} '
        f'{"GPU +GB":>8} {"temp GB/upd":>12} {"temp peak GB":>13}'
    )
    base = rows[0]['seconds']
    for row in rows:
        device_gb = '-' if row['device_bytes'] is None else f'{row["device_bytes"] / 1e9:.3f}'
        print(
            f'{row["name"]:<24} {row["seconds"]:>9.3f} {base / row["seconds"]:>7.2f}x {row["state_bytes"] / 1e9:>9.3f} '
            f'{row["host_bytes"] / 1e9:>8.3f} {device_gb:>8} {row["temp_total"] / 1e9:>12.3f} '
            f'{row["temp_peak"] / 1e9:>13.3f}'
        )
    print(
        'state GB: the averaged tensors (both keep the trainable parameters only; Composer also keeps every buffer,'
        ' none in the UNet). RSS/GPU +GB: memory the state added. temp: bytes allocated by one update.'
    )
    if device.type == 'cuda':
        offload = rows[-1]
        print(
            f'offload: the training thread is blocked {offload["blocking"] * 1e3:.1f} ms per update; the host-side '
            f'average takes {offload["seconds"]:.3f} s in the background'
        )
        if time_step:
            del unet
            gc.collect()
            torch.cuda.empty_cache()
            micro, opt = step_seconds(device)
            # Published run: global batch 2048 = 8 GPUs x microbatch 4 x 64 accumulation steps.
            step = 64 * micro + opt
            for row in rows:
                print(
                    f'{row["name"]:<24} EMA / training step: {row["seconds"] / step:.2%} of a published step '
                    f'({step:.2f} s = 64 x {micro:.3f} s + AdamW {opt:.3f} s), '
                    f'{row["seconds"] / (micro + opt):.2%} of a single-microbatch step'
                )


def _reset(weights: EMAWeights) -> EMAWeights:
    weights.reset()
    weights.join()
    return weights
