"""Prompts to images, offline: from a Composer checkpoint of benchmark.py, or from a pipeline folder that
`benchmark.py --export_pipeline` (or Diffusers) saved: Stable Diffusion's (one text encoder), Flux's, SD3's or
PixArt-Sigma's. A T5 model's checkpoint needs its T5 tokenizer folder (--tokenizer); its pipeline folder holds it.

    python generate.py --checkpoint runs/ckpt/latest-rank0.pt --model_name tiny --prompt 'a red circle' --out out/
    python generate.py --pipeline results/pipeline --prompts prompts.txt --out out/ --batch_size 8

Image i is drawn from seed --seed + i, so a prompt list gives the same images with any batch size. The images are
as large as the run's training images (the exported folder and the checkpoint record their size) unless
--image_size says otherwise; grid.png shows them under their prompts. With --clip_model (a local CLIP folder) it
prints the CLIP score of the images against their prompts, and with --fid_reference and --fid_weights the FID
against reference images (docs/quality.md); no weights are downloaded.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import arguments
from arguments import ConfigError
from model_folder import (
    LATENT_DOWNSAMPLE,
    TRANSFORMER_PIPELINE_NAMES,
    UNET_PIPELINE_NAME,
    is_transformer_folder,
    resolve_model_dir,
)
from presets import SAMPLERS

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # never the network: every part is local

# The pipelines export.py builds, which generate() draws with.
PIPELINES = (UNET_PIPELINE_NAME, *TRANSFORMER_PIPELINE_NAMES.values())


class GenerateError(ConfigError):
    """Bad input to generate.py, reported as one line."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(description='Generate images from a trained model, offline and seeded.')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--checkpoint', help="a Composer checkpoint file of benchmark.py (e.g. 'latest-rank0.pt')")
    source.add_argument('--pipeline', help="a Diffusers pipeline folder (--export_pipeline's)")
    parser.add_argument('--model_name', help="with --checkpoint: the run's --model_name (a built-in or a folder)")
    parser.add_argument('--prediction_type', choices=['epsilon', 'v_prediction'], help="with --checkpoint: the run's")
    parser.add_argument('--tokenizer', help="with --checkpoint: the run's --tokenizer folder (T5's for a T5 model)")
    parser.add_argument('--ema', action='store_true', help="with --checkpoint: the run's EMA weights (--use_ema)")
    parser.add_argument('--prompt', action='append', default=[], help='a prompt (repeat the flag for more)')
    parser.add_argument('--prompts', help='a file of prompts, one a line')
    parser.add_argument('--out', required=True, help='a new or empty folder for the PNGs')
    parser.add_argument('--seed', type=int, default=0, help='image i is drawn from seed + i (default: %(default)s)')
    parser.add_argument('--batch_size', type=int, default=4, help='images per pipeline call (default: %(default)s)')
    parser.add_argument('--steps', type=int, default=25, help='sampling steps (default: %(default)s)')
    parser.add_argument('--guidance_scale', type=float, default=7.5, help='(default: %(default)s)')
    parser.add_argument(
        '--scheduler',
        choices=sorted(SAMPLERS),
        help="sampler of a DDPM model (default: ddim, or the folder's); Flux and SD3.5 sample with their flow's",
    )
    parser.add_argument(
        '--image_size',
        type=int,
        help="pixels per side (default: the size the run trained at, else the model's sample size)",
    )
    parser.add_argument('--clip_model', metavar='DIR', help='print the CLIP score with this local CLIP model')
    parser.add_argument('--fid_reference', metavar='DIR', help='print the FID against this MDS split of images')
    parser.add_argument('--fid_weights', metavar='FILE', help="torchvision's Inception v3 weights file, for the FID")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """The prompts, once every flag is checked; GenerateError names the first bad one."""
    prompts = list(args.prompt)
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise GenerateError(f'--prompts {args.prompts}: no such file (one prompt a line)')
        prompts += [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise GenerateError('no prompt: pass --prompt TEXT (repeatable) or --prompts FILE')
    transformer = False  # a diffusion transformer's: images in multiples of 16 pixels (2x2 latent patches)
    if args.checkpoint:
        if not Path(args.checkpoint).is_file():
            raise GenerateError(
                f'--checkpoint {args.checkpoint}: no such file (sharded FSDP checkpoints: not supported)'
            )
        if not args.model_name:
            raise GenerateError("--checkpoint needs --model_name: the run's model (e.g. tiny, sd2-base)")
        try:
            args.model_dir = resolve_model_dir(args.model_name)  # once, for the model and its tokenizer's padding
        except ConfigError as error:
            raise GenerateError(str(error))
        transformer = is_transformer_folder(args.model_dir)
        if transformer:
            if args.tokenizer is None:
                raise GenerateError(
                    f"--tokenizer: {args.model_name} reads prompts with T5: pass the run's --tokenizer folder (T5's)"
                )
            if args.prediction_type:
                raise GenerateError(f'--prediction_type: a UNet option; {args.model_name} is a diffusion transformer')
    else:
        index = Path(args.pipeline) / 'model_index.json'
        if not index.is_file():
            raise GenerateError(f'--pipeline {args.pipeline}: no model_index.json there (not a pipeline folder)')
        try:
            kind = json.loads(index.read_text()).get('_class_name')
        except (ValueError, AttributeError):
            raise GenerateError(f'--pipeline {args.pipeline}: its model_index.json is not a JSON object')
        if kind not in PIPELINES:
            raise GenerateError(f'--pipeline {args.pipeline}: a {kind}; generate.py draws with {", ".join(PIPELINES)}')
        transformer = kind != UNET_PIPELINE_NAME
        given = [flag for flag in ('model_name', 'prediction_type', 'tokenizer', 'ema') if getattr(args, flag)]
        if given:
            raise GenerateError(f'--{given[0]}: applies to --checkpoint only (a pipeline folder holds its own)')
    out = Path(args.out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise GenerateError(
            f'--out {args.out}: is a file or not empty; give a new folder (images are never overwritten)'
        )
    for flag in ('batch_size', 'steps', 'image_size'):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise GenerateError(f'--{flag} {value}: must be positive')
    multiple = LATENT_DOWNSAMPLE * (2 if transformer else 1)
    if args.image_size is not None and args.image_size % multiple:
        raise GenerateError(f'--image_size {args.image_size}: must be a multiple of {multiple}')
    if args.clip_model and not (Path(args.clip_model) / 'config.json').is_file():
        raise GenerateError(f'--clip_model {args.clip_model}: no CLIP model folder (config.json) there')
    if bool(args.fid_reference) != bool(args.fid_weights):
        raise GenerateError('--fid_reference and --fid_weights: the FID needs both (reference images and weights)')
    if args.fid_weights and not Path(args.fid_weights).is_file():
        raise GenerateError(f'--fid_weights {args.fid_weights}: no such file')
    if args.fid_reference and not (Path(args.fid_reference) / 'index.json').is_file():
        raise GenerateError(f'--fid_reference {args.fid_reference}: no MDS split (index.json) there')
    return prompts


def main(args: argparse.Namespace):
    """Checks the flags, then writes the images and prints the scores asked for; returns the images (N, 3, H, W)
    in [0, 1]."""
    prompts = check_args(args)
    # Imported once the flags check out, not at the top: torch and Diffusers take seconds to load, and --help or a
    # bad flag answers without them.
    import drawing

    return drawing.draw(args, prompts)


def cli(argv=None) -> None:
    try:
        main(parse_args(argv))
    except ConfigError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)


if __name__ == '__main__':
    cli()
