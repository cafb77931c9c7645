"""Host work before a GPU: how many operations one microbatch's training step launches, and the microbatch above
which a GPU, rather than the host issuing its kernels, sets the step's pace.

    .venv/bin/python benchmarks/host_overhead.py                               # every built-in model, its size
    .venv/bin/python benchmarks/host_overhead.py --model_name sd2-base --launch_us 14 --gpu H100

Eager PyTorch launches each operation from the host: at a few to tens of microseconds of host time each (14 us is
what the first H100 runs imply: 137 ms for SD2 base's microbatch of 4), a step of ~10,000 operations costs the
host ~0.1 s at nearly any microbatch, while the GPU's work grows with it. The step is host-bound below

    microbatch* = operations x launch time x GPU FLOP/s / training FLOPs per image

and compute-bound above. Counted on the meta device (launch_counts.py), per microbatch from precomputed latents:
the fp32 eager operations, bf16 autocast's casts added (estimated: each Linear and Conv2d weight and bias cast per
call, and its gradient back), with activation checkpointing (the blocks' forward again in the backward), and the
optimizer step (AdamW's foreach kernels: one launch per parameter tensor and kernel, counted once per step, not
per microbatch, so not here). CUDA graphs replay a captured step as one launch, and Inductor fuses operations:
neither is counted here (the GPU campaign's profile measures launches for real).
"""

import argparse
import os

from costs.results import PEAK_FLOPS
from guards.arguments import ConfigError
from settings.model_folder import resolve_model_dir
from settings.presets import PRESETS

os.environ.setdefault('HF_HUB_OFFLINE', '1')

MODELS = ('sd2-base', 'sd1.5', 'sd2-768-v', 'sdxl-base', 'flux-schnell', 'sd3.5-medium', 'pixart-sigma')
H100_LAUNCH_US = 14.0  # 137 ms per microbatch of 4 for ~9,500 operations on the first H100 runs (docs/speed.md)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--model_name', nargs='+', default=list(MODELS), help='models (default: every built-in one)')
    parser.add_argument('--image_size', type=int, help="pixels per side (default: each model's preset)")
    parser.add_argument('--microbatch', type=int, default=4, help='images counted per step (default: %(default)s)')
    parser.add_argument(
        '--launch_us', type=float, default=H100_LAUNCH_US, help='host time per operation (default: %(default)s)'
    )
    parser.add_argument(
        '--gpu', choices=sorted(PEAK_FLOPS), default='H100', help='its dense bf16 peak FLOP/s (default: %(default)s)'
    )
    parser.add_argument(
        '--efficiency',
        type=float,
        default=0.5,
        help='the share of that peak the GPU reaches on the step once compute-bound (default: %(default)s)',
    )
    args = parser.parse_args(argv)
    for flag in ('microbatch', 'launch_us', 'efficiency'):
        if not getattr(args, flag) > 0:
            parser.error(f'--{flag} {getattr(args, flag)}: must be positive')
    if args.image_size is not None and (args.image_size <= 0 or args.image_size % 16):
        parser.error(f'--image_size {args.image_size}: must be a positive multiple of 16')
    for name in args.model_name:
        try:
            resolve_model_dir(name)
        except ConfigError as error:
            parser.error(str(error))
    # Loaded once the flags are checked: --help and a bad flag answer without torch.
    from benchmarks.launch_counts import step_ops

    flops_per_sec = PEAK_FLOPS[args.gpu] * args.efficiency
    print(
        f'| model | size | operations per microbatch: fp32 / bf16 autocast / + activation checkpointing | host ms '
        f'per microbatch at {args.launch_us:g} us | compute-bound above (images, {args.gpu} at {args.efficiency:.0%}) |'
    )
    print('|---|---|---|---|---|')
    rows = []
    for name in args.model_name:
        size = args.image_size or (PRESETS[name].image_size if name in PRESETS else 512)
        counts = step_ops(name, size, args.microbatch)
        checkpointed = step_ops(name, size, args.microbatch, activation_checkpointing=True)
        autocast = counts['eager_fp32'] + counts['autocast_casts']
        recomputed = checkpointed['eager_fp32'] + checkpointed['autocast_casts']
        host_seconds = autocast * args.launch_us * 1e-6
        bound = host_seconds * flops_per_sec / counts['trained_flops_per_image']
        print(
            f'| `{name}` | {size}px | {counts["eager_fp32"]:,} / {autocast:,} / {recomputed:,} | '
            f'{host_seconds * 1e3:.0f} | {bound:.0f} |',
            flush=True,
        )
        rows.append({'model_name': name, 'image_size': size, **counts, 'checkpointed': recomputed, 'bound': bound})
    return rows


if __name__ == '__main__':
    main()
