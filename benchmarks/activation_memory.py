"""Activation memory per training image: what a model's training step keeps for its backward, counted on the meta
device (no weights, no compute, any model size on any machine), to choose a microbatch before renting GPUs.

    .venv/bin/python benchmarks/activation_memory.py                           # every built-in model, its sizes
    .venv/bin/python benchmarks/activation_memory.py --model_name flux-schnell --image_size 256 512

The step is the model's own (precomputed latents: the UNet or transformer alone, as the encoders' outputs need no
backward), for one image. Every tensor autograd saves for the backward is counted once, but the parameters and
views of them. Attention is counted as a fused kernel keeps it (PyTorch's flash and memory-efficient SDPA, cuDNN):
query, key, value, output and one fp32 log-sum-exp per query, not the attention matrix that the math kernel of
the meta device would keep. Sizes are as in bf16 autocast, two bytes per saved element; autocast runs norms in
fp32, so a GPU holds somewhat more, plus its allocator's slack: measure the peak on the GPU
(`benchmark.py` prints it) before relying on the last gigabytes.
"""

import argparse
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from config import PRESETS  # noqa: E402
from data import SyntheticLatentsDataset  # noqa: E402
from model import DiffusionTransformer, build_model  # noqa: E402
from model_folder import LATENT_DOWNSAMPLE, resolve_model_dir  # noqa: E402
from transformer_model import is_flow_matching  # noqa: E402

# The sizes each built-in model trains at: its preset's, and the larger one of its published recipe.
SIZES = {
    'sd2-base': (256, 512),
    'sd1.5': (512,),
    'sd2-768-v': (768,),
    'sdxl-base': (1024,),
    'flux-schnell': (256, 512),
    'sd3.5-medium': (512, 1024),
    'pixart-sigma': (512, 1024),
}
BYTES_PER_ELEMENT = 2  # bf16 autocast


class FusedAttentionSaves(torch.autograd.Function):
    """Attention with what a fused kernel saves for its backward; the forward only gives the output's shape."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError('counts memory only')


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return FusedAttentionSaves.apply(query, key, value)


def saved_bytes_per_image(model_name: str, image_size: int) -> int:
    """Bytes the training step of one `image_size` image keeps for the backward, as bf16 (see the module docstring)."""
    with torch.device('meta'):
        model = build_model(resolve_model_dir(model_name), precomputed=True)
    shapes = model.precomputed_shapes(image_size // LATENT_DOWNSAMPLE)
    sample = SyntheticLatentsDataset(**shapes, num_samples=1)[0]
    batch = {name: tensor.to('meta') for name, tensor in default_collate([sample]).items()}
    latent = batch['latent_mean'].shape
    batch['noise'] = batch['latent_noise'] = torch.empty(latent, device='meta')
    if isinstance(model, DiffusionTransformer) and is_flow_matching(model.family):
        batch['sigmas'] = torch.empty(1, device='meta')
    else:
        batch['timesteps'] = torch.zeros(1, dtype=torch.long, device='meta')
    parameters = {id(p) for p in model.parameters()}
    saved = {}

    def count(tensor):
        is_weight = id(tensor) in parameters or (tensor._base is not None and id(tensor._base) in parameters)
        if not is_weight:
            size = BYTES_PER_ELEMENT if tensor.is_floating_point() else tensor.element_size()
            saved[id(tensor)] = tensor.numel() * size  # by identity: a tensor saved twice is held once
        return tensor

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = fused_attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            model.loss(model(batch), batch)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return sum(saved.values())


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model_name', nargs='+', default=list(SIZES), help='models (default: every built-in one)')
    parser.add_argument('--image_size', nargs='+', type=int, help="sizes in pixels (default: each model's)")
    args = parser.parse_args(argv)
    rows = []
    print('| model | size | activations per image (bf16) | microbatches in 40 / 80 GB of activations |')
    print('|---|---|---|---|')
    for name in args.model_name:
        preset = PRESETS.get(name)
        sizes = args.image_size or SIZES.get(name) or ((preset.image_size,) if preset else (512,))
        for size in sizes:
            saved = saved_bytes_per_image(name, size)
            fits = ' / '.join(str(int(gigabytes * 1e9 // saved)) for gigabytes in (40, 80))
            print(f'| `{name}` | {size}px | {saved / 1e9:.2f} GB | {fits} |', flush=True)
            rows.append({'model_name': name, 'image_size': size, 'bytes': saved})
    return rows


if __name__ == '__main__':
    main()
