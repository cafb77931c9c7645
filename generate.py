"""Prompts to images, offline: from a Composer checkpoint of benchmark.py, or from a pipeline folder that
`benchmark.py --export_pipeline` (or Diffusers) saved: Stable Diffusion's (one text encoder), Flux's, SD3's or
PixArt-Sigma's. A T5 model's checkpoint needs its T5 tokenizer folder (--tokenizer); its pipeline folder holds it.

    python generate.py --checkpoint runs/ckpt/latest-rank0.pt --model_name tiny --prompt 'a red circle' --out out/
    python generate.py --pipeline results/pipeline --prompts prompts.txt --out out/ --batch_size 8

Image i is drawn from seed --seed + i, so a prompt list gives the same images with any batch size. With
--clip_model (a local CLIP folder) it prints the CLIP score of the images against their prompts, and with
--fid_reference and --fid_weights the FID against reference images (docs/quality.md); no weights are downloaded.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # never the network: every part is local

import torch  # noqa: E402
from composer.utils import reproducibility  # noqa: E402
from diffusers import DiffusionPipeline, StableDiffusionPipeline  # noqa: E402
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

import arguments  # noqa: E402
from arguments import ConfigError  # noqa: E402
from evaluation import ValidationSplit  # noqa: E402
from export import SCHEDULERS, TRANSFORMER_PIPELINES, build_pipeline, generate  # noqa: E402
from model import build_model  # noqa: E402
from model_folder import LATENT_DOWNSAMPLE, is_transformer_folder, resolve_model_dir  # noqa: E402
from tokenizer import CaptionTokenizer, caption_pad_ids  # noqa: E402
from transformer_model import DiffusionTransformer, is_flow_matching  # noqa: E402

FID_WEIGHTS_NEEDED = (
    "FID: not computed; it needs --fid_weights FILE (torchvision's Inception v3 weights, "
    'inception_v3_google-0cc3c7bd.pth) and --fid_reference DIR (an MDS split of reference images)'
)
CLIP_WEIGHTS_NEEDED = 'CLIP score: not computed; it needs --clip_model DIR (a local Transformers CLIP model folder)'


# The pipelines export.py builds, which generate() draws with.
PIPELINES = tuple(kind.__name__ for kind in (StableDiffusionPipeline, *TRANSFORMER_PIPELINES.values()))


class GenerateError(ValueError):
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
        choices=sorted(SCHEDULERS),
        help="sampler of a DDPM model (default: ddim, or the folder's); Flux and SD3.5 sample with their flow's",
    )
    parser.add_argument('--image_size', type=int, help="pixels per side (default: the model's sample size)")
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
        transformer = kind != StableDiffusionPipeline.__name__
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


def load_pipeline(args: argparse.Namespace) -> DiffusionPipeline:
    if args.pipeline:
        pipeline = DiffusionPipeline.from_pretrained(args.pipeline, local_files_only=True)
        if args.scheduler:
            if 'FlowMatch' in type(pipeline.scheduler).__name__:
                raise GenerateError(
                    f'--scheduler {args.scheduler}: {args.pipeline} holds a flow-matching model, which samples with '
                    'its own Euler sampler'
                )
            pipeline.scheduler = SCHEDULERS[args.scheduler].from_config(pipeline.scheduler.config)
        return pipeline
    model_dir = args.model_dir
    if (model_dir / 'text_encoder_2').is_dir() and not is_transformer_folder(model_dir):
        raise GenerateError(
            f"--model_name {args.model_name}: SDXL's two text encoders need Diffusers' StableDiffusionXLPipeline, "
            'which generate.py does not build'
        )
    model = build_model(model_dir, args.prediction_type)
    if args.scheduler and isinstance(model, DiffusionTransformer) and is_flow_matching(model.family):
        raise GenerateError(
            f'--scheduler {args.scheduler}: {args.model_name} is a flow-matching model, which samples with its own '
            'Euler sampler'
        )
    state = torch.load(args.checkpoint, map_location='cpu', weights_only=False)['state']
    try:
        model.load_state_dict(state['model'])
        if args.ema:
            ema = dict(state.get('algorithms') or []).get('EMA')
            if not ema or ema.get('ema') is None:
                raise GenerateError(f'--ema: {args.checkpoint} holds no EMA average (the run had no --use_ema)')
            model.load_state_dict(ema['ema'], strict=False)
    except RuntimeError as error:  # missing keys or other shapes
        reason = str(error).strip().splitlines()[0]
        raise GenerateError(f'--checkpoint {args.checkpoint}: does not fit --model_name {args.model_name} ({reason})')
    return build_pipeline(model, args.scheduler or 'ddim', args.tokenizer)


def main(args: argparse.Namespace) -> torch.Tensor:
    """Writes the images, prints the scores asked for; returns the images (N, 3, H, W) in [0, 1]."""
    prompts = check_args(args)
    reproducibility.seed_all(args.seed)
    pipeline = load_pipeline(args)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    if not isinstance(pipeline, StableDiffusionPipeline):
        tokenizer = None  # a diffusion transformer's pipeline holds the training tokenizers and uses them
    elif args.checkpoint:  # the training tokenizer, padded as the model's text encoder was trained
        tokenizer = CaptionTokenizer(args.tokenizer, caption_pad_ids(args.model_dir)[0])
    else:
        tokenizer = CaptionTokenizer(str(Path(args.pipeline) / 'tokenizer'))
    size = args.image_size or default_image_size(pipeline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for start in tqdm(range(0, len(prompts), args.batch_size), desc='generating', unit='batch'):
        batch = prompts[start : start + args.batch_size]
        seeds = [args.seed + start + i for i in range(len(batch))]
        images.append(generate(pipeline, batch, seeds, args.steps, args.guidance_scale, size, tokenizer).float().cpu())
        for i, image in enumerate(images[-1]):
            array = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            Image.fromarray(array).save(out / f'{start + i:04d}.png')
    images = torch.cat(images)
    (out / 'prompts.txt').write_text(''.join(f'{i:04d}.png\t{args.seed + i}\t{p}\n' for i, p in enumerate(prompts)))
    print(f'{len(prompts)} image(s) of {size}x{size} written to {out}')
    print(clip_score(images, prompts, args.clip_model) if args.clip_model else CLIP_WEIGHTS_NEEDED)
    print(fid(images, args.fid_reference, args.fid_weights, size) if args.fid_weights else FID_WEIGHTS_NEEDED)
    return images


def default_image_size(pipeline: DiffusionPipeline) -> int:
    """The size the pipeline draws when given none: its denoiser's sample size in latents, times the VAE's 8."""
    if isinstance(pipeline, StableDiffusionPipeline):
        return pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    latents = getattr(pipeline, 'default_sample_size', None) or pipeline.transformer.config.sample_size
    return latents * pipeline.vae_scale_factor


def clip_score(images: torch.Tensor, prompts: list[str], folder: str) -> str:
    from torchmetrics.multimodal.clip_score import CLIPScore
    from transformers import CLIPModel, CLIPProcessor

    def local_clip():  # torchmetrics takes hub names, or a function giving the model and its processor
        return CLIPModel.from_pretrained(folder, local_files_only=True), CLIPProcessor.from_pretrained(folder)

    metric = CLIPScore(model_name_or_path=local_clip)
    metric.update((images * 255).round().byte(), prompts)
    return f'CLIP score: {float(metric.compute()):.3f} ({len(prompts)} images, {folder})'


def fid(images: torch.Tensor, reference: str, weights: str, size: int) -> str:
    """FID against an MDS split's images, with Inception v3 features from a local torchvision weights file."""
    import torchvision
    from torchmetrics.image.fid import FrechetInceptionDistance

    inception = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False)
    inception.load_state_dict(torch.load(weights, map_location='cpu'))
    inception.fc = torch.nn.Identity()  # the 2048 pooled features
    metric = FrechetInceptionDistance(feature=InceptionFeatures(inception))
    split = ValidationSplit(reference, (4, 1, 1), size)
    real = torch.stack([split[i]['image'] for i in range(len(split)) if split[i]['valid']])
    metric.update(real.float() / 255, real=True)
    metric.update(images, real=False)
    return f'FID: {float(metric.compute()):.2f} ({len(images)} generated, {len(real)} reference images of {reference})'


class InceptionFeatures(torch.nn.Module):
    """torchvision's Inception v3 as torchmetrics' FID feature extractor: [0, 1] images -> 2048 features."""

    def __init__(self, inception: torch.nn.Module):
        super().__init__()
        self.inception = inception.eval()
        self.num_features = 2048

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float() / 255 if images.dtype == torch.uint8 else images
        images = torch.nn.functional.interpolate(images, size=(299, 299), mode='bilinear', align_corners=False)
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        return self.inception((images - mean) / std)


def cli(argv=None) -> None:
    try:
        main(parse_args(argv))
    except GenerateError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)


if __name__ == '__main__':
    cli()
