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

from guards.arguments import ConfigError
from settings.model_folder import LATENT_DOWNSAMPLE, resolve_model_dir
from settings.presets import PRESETS

os.environ.setdefault('HF_HUB_OFFLINE', '1')

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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--model_name', nargs='+', default=list(SIZES), help='models (default: every built-in one)')
    parser.add_argument('--image_size', nargs='+', type=int, help="sizes in pixels (default: each model's)")
    args = parser.parse_args(argv)
    for size in args.image_size or ():
        if size <= 0 or size % LATENT_DOWNSAMPLE:
            parser.error(f'--image_size {size}: must be a positive multiple of 8 (the VAE downsamples 8x)')
    for name in args.model_name:
        try:
            resolve_model_dir(name)
        except ConfigError as error:
            parser.error(str(error))
    # Loaded once the flags are checked: --help and a bad flag answer without torch.
    from benchmarks.saved_activations import saved_bytes_per_image

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
