"""The operations one microbatch's training step dispatches, counted on the meta device (no weights, no compute,
any model on any machine): the measurement behind benchmarks/host_overhead.py (whose docstring says how to read
it)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import default_collate

from data import SyntheticLatentsDataset
from models.fused_groupnorm import use_fused_groupnorm_silu
from models.stable_diffusion import build_model
from settings.model_folder import LATENT_DOWNSAMPLE, resolve_model_dir

# Modules whose weights autocast casts to the half precision in the forward (and whose gradients it casts back).
AUTOCAST_MODULES = (torch.nn.Linear, torch.nn.Conv2d)


class CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it: on a GPU, one or more kernel launches each."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def step_ops(
    model_name: str,
    image_size: int,
    microbatch: int,
    activation_checkpointing: bool = False,
    fused_groupnorm: bool = False,
) -> dict:
    """One microbatch's forward and backward from precomputed latents: the operations dispatched in fp32 eager
    mode, and the casts bf16 autocast adds (a forward cast of each Linear and Conv2d weight and bias per call, and
    the cast of its gradient back: estimated from the calls, as the meta device runs no autocast). fused_groupnorm:
    a UNet's GroupNorm + SiLU pairs as fused_groupnorm.py's one operation each way."""
    with torch.device('meta'):
        model = build_model(resolve_model_dir(model_name), precomputed=True)
    if activation_checkpointing:
        model.denoiser.enable_gradient_checkpointing()
    if fused_groupnorm:
        use_fused_groupnorm_silu(model.denoiser)
    shapes = model.precomputed_shapes(image_size // LATENT_DOWNSAMPLE)
    dataset = SyntheticLatentsDataset(**shapes, num_samples=microbatch)
    batch = {name: tensor.to('meta') for name, tensor in default_collate(list(dataset)).items()}
    casts = [0]

    def count_casts(module, inputs):
        casts[0] += 2 * sum(1 for parameter in (module.weight, module.bias) if parameter is not None)

    hooks = [m.register_forward_pre_hook(count_casts) for m in model.modules() if isinstance(m, AUTOCAST_MODULES)]
    counter = CountOps()
    try:
        with counter:
            model.loss(model(batch), batch).backward()
    finally:
        for hook in hooks:
            hook.remove()
    return {
        'eager_fp32': counter.count,
        'autocast_casts': casts[0],
        'trained_flops_per_image': model.trained_flops_per_image(image_size, image_size),
    }
