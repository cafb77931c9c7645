"""Prompts to images with a trained model (generate.py's work, once its flags check out): its Diffusers pipeline,
loaded from a pipeline folder or built from a Composer checkpoint (export.build_pipeline), images drawn in batches
from one seed per image at the size the run trained at, written as PNGs and as a grid labeled with their prompts,
and their CLIP score and FID where the local weights are given.
"""

import pickle
from pathlib import Path

import torch
from composer.utils import reproducibility
from diffusers import DiffusionPipeline, StableDiffusionPipeline
from diffusers.utils import is_accelerate_available
from PIL import Image
from tqdm import tqdm

from guards.arguments import ConfigError
from guards.outputs import staged_folder
from models.stable_diffusion import build_model
from runs.checkpoints import RunDescription, load_checkpoint_file
from runs.evaluation import ValidationSplit
from runs.export import SCHEDULERS, build_pipeline, generate, labeled_grid
from settings.families import is_flow_matching
from settings.generate_settings import GenerateSettings
from settings.model_folder import caption_pad_ids
from settings.run_record import RUN_DESCRIPTION_FILE, exported_run
from settings.tokenizer import CaptionTokenizer

# grid.png: the first images in rows of 8, each under its prompt (a grid of thousands would be too big to look at).
GRID_IMAGES, GRID_COLUMNS = 64, 8


def draw(args: GenerateSettings, prompts: list[str]) -> torch.Tensor:
    """Writes the images of generate.py's checked flags, prints the scores asked for; returns the images
    (N, 3, H, W) in [0, 1]."""
    reproducibility.seed_all(args.seed)
    pipeline, description = load_pipeline(args)
    trained_size = description.get('image_size')
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    if not isinstance(pipeline, StableDiffusionPipeline):
        tokenizer = None  # a diffusion transformer's pipeline holds the training tokenizers and uses them
    elif args.checkpoint:  # the training tokenizer, padded as the model's text encoder was trained
        tokenizer = CaptionTokenizer(args.tokenizer, caption_pad_ids(args.model_folder)[0])
    else:
        tokenizer = CaptionTokenizer(str(Path(args.pipeline) / 'tokenizer'))
    if args.image_size:
        size, origin = args.image_size, '--image_size'
    elif trained_size:
        size, origin = trained_size, 'the size the run trained at'
    else:
        size = default_image_size(pipeline)
        origin = f"the model's sample size; {args.pipeline or args.checkpoint} records no training size"
    print(f'generating {len(prompts)} image(s) of {size}x{size} ({origin})')
    out = Path(args.out)
    # The folder appears whole or not at all: a full disk part way removes the images drawn (WriteFailed).
    with staged_folder(out, f'--out {args.out}', 'run again') as partial:
        images = []
        for start in tqdm(range(0, len(prompts), args.batch_size), desc='generating', unit='batch'):
            batch = prompts[start : start + args.batch_size]
            seeds = [args.seed + start + i for i in range(len(batch))]
            flux_guidance = description.get('flux_guidance')
            drawn = generate(pipeline, batch, seeds, args.steps, args.guidance_scale, size, tokenizer, flux_guidance)
            images.append(drawn.float().cpu())
            for i, image in enumerate(images[-1]):
                array = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
                Image.fromarray(array).save(partial / f'{start + i:04d}.png')
        images = torch.cat(images)
        listing = ''.join(f'{i:04d}.png\t{args.seed + i}\t{p}\n' for i, p in enumerate(prompts))
        (partial / 'prompts.txt').write_text(listing)
        shown = min(len(prompts), GRID_IMAGES)
        labeled_grid(images[:shown], prompts[:shown], min(shown, GRID_COLUMNS)).save(partial / 'grid.png')
    print(f'{len(prompts)} image(s) of {size}x{size} written to {out} (grid.png: {shown} with their prompts)')
    if args.clip_model:
        print(clip_score(images, prompts, args.clip_model))
    if args.fid_weights:
        print(fid(images, args.fid_reference, args.fid_weights, size))
    return images


def load_pipeline(args: GenerateSettings) -> tuple[DiffusionPipeline, dict]:
    """The pipeline of --pipeline or --checkpoint, and its run's description (checkpoints.run_description: the
    image size it trained at, a guidance-distilled Flux's guidance), empty where neither records it: a pipeline
    folder that Diffusers saved, a checkpoint of an older version."""
    if args.pipeline:
        # Diffusers' default low_cpu_mem_usage needs the accelerate package, which this stack does not install, and
        # warns that it falls back to False; a pipeline loaded whole from a local folder onto one device needs
        # nothing more.
        try:
            pipeline = DiffusionPipeline.from_pretrained(
                args.pipeline, local_files_only=True, low_cpu_mem_usage=is_accelerate_available()
            )
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as error:  # what the checks cannot foresee
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f'--pipeline {args.pipeline}: Diffusers cannot load it ({reason})')
        if args.scheduler:
            if 'FlowMatch' in type(pipeline.scheduler).__name__:
                raise ConfigError(
                    f'--scheduler {args.scheduler}: {args.pipeline} holds a flow-matching model, which samples with '
                    'its own Euler sampler'
                )
            pipeline.scheduler = SCHEDULERS[args.scheduler].from_config(pipeline.scheduler.config)
        return pipeline, recorded_description(Path(args.pipeline) / RUN_DESCRIPTION_FILE)
    folder = args.model_folder
    if folder.is_sdxl:
        raise ConfigError(
            f"--model_name {args.model_name}: SDXL's two text encoders need Diffusers' StableDiffusionXLPipeline, "
            'which generate.py does not build'
        )
    model = build_model(folder, args.prediction_type)
    if args.scheduler and folder.is_transformer and is_flow_matching(folder.family):
        raise ConfigError(
            f'--scheduler {args.scheduler}: {args.model_name} is a flow-matching model, which samples with its own '
            'Euler sampler'
        )
    state = load_checkpoint_state(args.checkpoint, args.trust_checkpoint)
    try:
        model.load_state_dict(state['model'])
        if args.ema:
            ema = dict(state.get('algorithms') or []).get('EMA')
            if not ema or ema.get('ema') is None:
                raise ConfigError(f'--ema: {args.checkpoint} holds no EMA average (the run had no --use_ema)')
            model.load_state_dict(ema['ema'], strict=False)
    except RuntimeError as error:  # missing keys or other shapes
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f'--checkpoint {args.checkpoint}: does not fit --model_name {args.model_name} ({reason})')
    description = state.get('callbacks', {}).get(RunDescription.__name__) or {}  # checkpoints.RunDescription's
    return build_pipeline(model, args.scheduler or 'ddim', args.tokenizer), description


def recorded_in(checkpoint: str, trust: bool) -> dict:
    """The run description inside a checkpoint (checkpoints.RunDescription's), {} where it holds none (an older
    version's); read memory-mapped, so that only the small parts are read from disk."""
    state = load_checkpoint_state(checkpoint, trust, mmap=True)
    description = state.get('callbacks', {}).get(RunDescription.__name__)
    return description if isinstance(description, dict) else {}


def load_checkpoint_state(checkpoint: str, trust: bool = False, mmap: bool = False) -> dict:
    """A Composer checkpoint's state, read weights-only unless trusted; ConfigError naming the file where it names
    code that loading would run, cannot be read (a damaged archive whose directory is whole,
    run_record.not_a_checkpoint having refused the rest) or is not Composer's."""
    try:
        saved = load_checkpoint_file(checkpoint, trust=trust, mmap=mmap)
    except ConfigError:
        raise
    except Exception as error:  # torch raises RuntimeError, pickle's errors, EOFError, ... on a damaged file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f'--checkpoint {checkpoint}: cannot be read, damaged? ({reason}); give a whole checkpoint')
    if not isinstance(saved, dict) or not isinstance(saved.get('state'), dict):
        raise ConfigError(
            f"--checkpoint {checkpoint}: a torch file without Composer's 'state', not a checkpoint of benchmark.py"
        )
    return saved['state']


def recorded_description(record: Path) -> dict:
    """An exported pipeline's run description (model_folder.RUN_DESCRIPTION_FILE), if it has one."""
    return exported_run(record.parent, 'pass --image_size')


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
        model = CLIPModel.from_pretrained(folder, local_files_only=True)
        return CLIPFeatures(model), CLIPProcessor.from_pretrained(folder)

    metric = CLIPScore(model_name_or_path=local_clip)
    metric.update((images * 255).round().byte(), prompts)
    return f'CLIP score: {float(metric.compute()):.3f} ({len(prompts)} images, {folder})'


class CLIPFeatures(torch.nn.Module):
    """A CLIP model whose image and text features are tensors on every Transformers. torchmetrics (1.7 and 1.9) takes
    get_image_features' and get_text_features' results as the projected features; Transformers 5 returns a
    BaseModelOutputWithPooling, whose pooler_output holds them, and the CLIP score failed (no attribute 'norm')."""

    def __init__(self, clip: torch.nn.Module):
        super().__init__()
        self.clip, self.config = clip, clip.config

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return projected(self.clip.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return projected(self.clip.get_text_features(*args, **kwargs))


def projected(features) -> torch.Tensor:
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def fid(images: torch.Tensor, reference: str, weights: str, size: int) -> str:
    """FID against an MDS split's images, with Inception v3 features from a local torchvision weights file."""
    import torchvision
    from torchmetrics.image.fid import FrechetInceptionDistance

    inception = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False)
    try:
        inception.load_state_dict(torch.load(weights, map_location='cpu', weights_only=True))
    except pickle.UnpicklingError:
        raise ConfigError(
            f'--fid_weights {weights}: refused, it names code that loading would run (not a weights file)'
        )
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
