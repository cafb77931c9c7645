"""A trained model as a Diffusers pipeline: for the sample grids drawn during a run (SampleGrid, labeled as
generate.py's grid: labeled_grid), for generate.py, and saved whole by `--export_pipeline DIR` with the run's
description (the image size it trained at), so that the pipeline's class loads it offline: StableDiffusionPipeline
for the UNets (one text encoder), FluxPipeline, StableDiffusion3Pipeline and PixArtSigmaPipeline for the diffusion
transformers (`DiffusionPipeline.from_pretrained(DIR)` picks the class from the folder).

An exported pipeline's tokenizer gives the ids the model was trained on (tokenizer.CaptionTokenizer): the built-in
CLIP tokenizer with CLIP's caption cleaning moved inside it (lowercase, whitespace collapsed: prompts arrive raw)
and OpenCLIP's padding id 0, or the run's --tokenizer folder. One difference, as in SD2's own tokenizer folder:
its padding token is '!', so a '!' in a prompt reads as padding. `generate` encodes prompts with CaptionTokenizer
itself, as in training. A diffusion transformer's pipeline holds the built-in CLIP tokenizer the same way for its
CLIP encoders and the run's T5 tokenizer folder (--tokenizer) for T5; `generate` cleans prompts as training cleans
captions and lets the pipeline tokenize them.
"""

import contextlib
import functools
from pathlib import Path

import diffusers
import numpy as np
import torch
from composer.core import Callback, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from composer.utils import dist
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, StableDiffusionPipeline
from PIL import Image, ImageDraw, ImageFont
from tokenizers import Regex, Tokenizer, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ema import EMA, full_unet
from guards.outputs import staged_file, staged_folder
from models.diffusion_transformer import DiffusionTransformer
from models.stable_diffusion import DiffusionModel, StableDiffusion
from runs.checkpoints import RunDescription
from settings.families import EMBEDDED_GUIDANCE, FAMILIES, is_flow_matching
from settings.model_folder import CAPTION_LENGTH, CLIP_PAD_ID, LATENT_DOWNSAMPLE, caption_pad_ids
from settings.presets import SAMPLE_SEEDS, SAMPLERS
from settings.run_record import write_run_description
from settings.run_sections import DataSection, EvaluationSection, ModelSection
from settings.tokenizer import CLIP_END, CLIP_START, CaptionTokenizer, build_clip_tokenizer, clean_caption

# Samplers by flag name, built from the training noise schedule (betas, prediction type).
SCHEDULERS = {name: getattr(diffusers, scheduler) for name, scheduler in SAMPLERS.items()}
# White pixels between and around a grid's images.
GRID_SPACING = 2
# A grid column's least width in pixels: a label's first words, however small the images (32px: 'a yello...').
LABEL_WIDTH = 96


def pipeline_tokenizer(folder: str | None = None, pad_id: int = CLIP_PAD_ID):
    """A Transformers tokenizer giving CaptionTokenizer's ids for raw prompts, padded to 77 positions with the
    text encoder's pad id (tokenizer.caption_pad_ids)."""
    if folder is not None:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        # The generic class around the `tokenizers` object, saved and loaded as it is: Transformers' CLIP class
        # rebuilds the tokenizer on load in 5.x (with a normalizer that changes ids). The padding is id 0 ('!'),
        # OpenCLIP's (SD2's own tokenizer folder sets the same), or OpenAI CLIP's end of text.
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=prompt_backend(),  # copied
            bos_token=CLIP_START,
            eos_token=CLIP_END,
            unk_token=CLIP_END,
            pad_token='!' if pad_id == CLIP_PAD_ID else CLIP_END,
        )
    tokenizer.model_max_length = CAPTION_LENGTH
    return tokenizer


@functools.cache
def prompt_backend() -> Tokenizer:
    """The built-in CLIP tokenizer for raw prompts: whitespace collapsed and lowercased as clean_caption does. Built
    once per process (from 49k merges); each pipeline's tokenizer holds a copy."""
    backend = build_clip_tokenizer()
    backend.normalizer = normalizers.Sequence(
        [normalizers.Replace(Regex(r'\s+'), ' '), normalizers.Strip(), normalizers.Lowercase()]
    )
    return backend


def build_pipeline(
    model: DiffusionModel, scheduler: str = 'ddim', tokenizer: str | None = None, denoiser=None
) -> DiffusionPipeline:
    """The model's parts in a pipeline (sharing their weights; `denoiser` replaces the model's UNet or transformer),
    with a sampler `scheduler` of its DDPM noise schedule (the flow-matching models sample with their own)."""
    if model.vae is None:
        raise ValueError('a pipeline needs the VAE and text encoder: this model trains on precomputed latents')
    if model.family is not None:  # a diffusion transformer: its family's pipeline
        return transformer_pipeline(model, scheduler, tokenizer, denoiser)
    return StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=pipeline_tokenizer(tokenizer, model_pad_id(model)),
        unet=model.unet if denoiser is None else denoiser,
        scheduler=SCHEDULERS[scheduler].from_config(model.noise_scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def transformer_pipeline(
    model: DiffusionTransformer, scheduler: str, t5_tokenizer: str | None, transformer=None
) -> DiffusionPipeline:
    """A diffusion transformer family's pipeline (families.py): its text encoders under their folders' names, each
    CLIP's tokenizer as the UNets' (the training ids, with its encoder's padding), T5's from the run's --tokenizer
    folder, cut at the length T5 was trained on."""
    if t5_tokenizer is None:
        raise ValueError("a diffusion transformer's pipeline needs T5's tokenizer: pass its folder (--tokenizer)")
    family = FAMILIES[model.family]
    t5 = AutoTokenizer.from_pretrained(t5_tokenizer)
    t5.model_max_length = family.t5_caption_length
    transformer = model.transformer if transformer is None else transformer
    if is_flow_matching(model.family):
        sampler = FlowMatchEulerDiscreteScheduler.from_config(model.noise_scheduler.config)
    else:
        sampler = SCHEDULERS[scheduler].from_config(model.noise_scheduler.config)
    encoders = dict(zip(family.text_encoders, model.text_encoders))
    clip_pads = caption_pad_ids(model.model_folder)
    tokenizers = {name: pipeline_tokenizer(None, pad) for name, pad in zip(family.tokenizers[:-1], clip_pads)}
    tokenizers[family.tokenizers[-1]] = t5  # T5 last
    pipeline_class = getattr(diffusers, family.pipeline)
    return pipeline_class(vae=model.vae, transformer=transformer, scheduler=sampler, **encoders, **tokenizers)


def model_pad_id(model: StableDiffusion) -> int:
    """The pad id the model's text encoder was trained with (OpenCLIP's 0 unless its folder says otherwise)."""
    return caption_pad_ids(model.model_folder)[0] if model.model_folder is not None else CLIP_PAD_ID


@torch.no_grad()
def generate(
    pipeline: DiffusionPipeline,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance_scale: float,
    image_size: int,
    tokenizer: CaptionTokenizer | None = None,
    flux_guidance: float | None = None,
) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1], one per prompt and seed: prompts encoded with the training tokenizer and
    the pipeline's text encoder, initial latents drawn from each seed, so an image depends on its prompt and seed
    only. Classifier-free guidance against the empty prompt (`guidance_scale` above 1). A diffusion transformer's
    pipeline tokenizes the prompts itself (`tokenizer` unused); a guidance-distilled Flux embeds `flux_guidance`, the
    scale it trained at (families.EMBEDDED_GUIDANCE where not given)."""
    if not isinstance(pipeline, StableDiffusionPipeline):
        return transformer_images(pipeline, prompts, seeds, steps, guidance_scale, image_size, flux_guidance)
    device = pipeline.unet.device
    encoder = pipeline.text_encoder

    def embed(captions):
        return encoder(torch.stack([tokenizer(caption) for caption in captions]).to(encoder.device))[0]

    return pipeline(
        prompt_embeds=embed(prompts),
        negative_prompt_embeds=embed([''] * len(prompts)),
        height=image_size,
        width=image_size,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        generator=[torch.Generator(device).manual_seed(seed) for seed in seeds],
        output_type='pt',
    ).images


def transformer_images(
    pipeline: DiffusionPipeline,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance_scale: float,
    size: int,
    flux_guidance: float | None = None,
) -> torch.Tensor:
    """generate() for a diffusion transformer family's pipeline: the prompts cleaned as training cleans captions,
    T5 reading as many tokens as in training, classifier-free guidance under the pipeline's name for it (Flux-schnell
    has no guidance embedding: its guidance is the true classifier-free kind), and a guidance-distilled
    transformer's embedded scale as it trained."""
    family = next(family for family in FAMILIES.values() if family.pipeline == type(pipeline).__name__)
    t5 = getattr(pipeline, family.tokenizers[-1])  # as exported, or as the folder's pipeline saved it
    denoiser = pipeline.transformer
    arguments = dict(
        prompt=[clean_caption(prompt, lowercase=False) for prompt in prompts],
        negative_prompt=[''] * len(prompts),
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=[torch.Generator(denoiser.device).manual_seed(seed) for seed in seeds],
        output_type='pt',
        max_sequence_length=t5.model_max_length,
        **{family.guidance_keyword: guidance_scale},
        **family.drawing_options,
    )
    if family.embeds_guidance and denoiser.config.get('guidance_embeds'):  # Flux.1-dev: the scale it trained at
        arguments.update(guidance_scale=EMBEDDED_GUIDANCE if flux_guidance is None else flux_guidance)
    return pipeline(**arguments).images


def export_pipeline(
    trainer, out_dir: str | Path, scheduler: str = 'ddim', tokenizer: str | None = None, again: str = 'run again'
) -> str:
    """Saves the trained model as a pipeline folder (rank 0), with the averaged denoiser when the run has an EMA,
    and the run's description (run_record.py: generate.py draws at the size the run trained at); returns the
    pipeline's class name. The folder appears whole or not at all: a failed write (a full disk) removes what was
    written and raises outputs.WriteFailed, whose fix ends in `again`."""
    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    ema = next((a for a in trainer.state.algorithms if isinstance(a, EMA)), None)
    description = next((c.state_dict() for c in trainer.state.callbacks if isinstance(c, RunDescription)), None)
    with ema.ema_weights() if ema is not None else contextlib.nullcontext():
        denoiser = full_unet(model.denoiser)  # a collective under FSDP
        if denoiser is not None:
            pipeline = build_pipeline(model, scheduler, tokenizer, denoiser)
            if isinstance(pipeline, StableDiffusionPipeline) and description is not None:
                # The size the pipeline draws when called without one: the run's, not the config's. Only a UNet's
                # sample_size is that alone (a transformer's also sets its position embedding's scale).
                denoiser.register_to_config(sample_size=description['image_size'] // LATENT_DOWNSAMPLE)
            with staged_folder(out_dir, f'--export_pipeline {out_dir}', again) as partial:
                pipeline.save_pretrained(partial, safe_serialization=True)
                if description is not None:
                    write_run_description(partial, description)
    dist.barrier()
    return pipeline_class(model)


def pipeline_class(model: DiffusionModel) -> str:
    """The Diffusers pipeline class of a model's exports."""
    return StableDiffusionPipeline.__name__ if model.family is None else FAMILIES[model.family].pipeline


def labeled_grid(
    images: torch.Tensor, labels: list[str], columns: int, title: str = '', row_labels: list[str] | None = None
) -> Image.Image:
    """Images (N, 3, H, W) in [0, 1] in rows of `columns` on white, each under its label (one per image; a row whose
    labels are all empty has no band of labels), in columns at least LABEL_WIDTH wide so that small images keep
    readable labels; with a title line above all, and a label left of each row."""
    count, _, height, width = images.shape
    font = ImageFont.load_default(max(10, width // 20))  # Pillow's own font, grown with the images
    line_height = font.getbbox('Ag')[3] + 2
    cell = max(width, LABEL_WIDTH)
    lines = [label_lines(label, font, cell) for label in labels]
    rows = [range(start, min(start + columns, count)) for start in range(0, count, columns)]
    bands = [line_height * max(len(lines[i]) for i in row) for row in rows]
    margin = max((round(font.getlength(label)) + GRID_SPACING for label in row_labels or []), default=0)
    heading = line_height if title else 0
    step = GRID_SPACING + cell
    grid = Image.new(
        'RGB',
        (
            margin + columns * step + GRID_SPACING,
            heading + sum(bands) + len(rows) * (height + GRID_SPACING) + GRID_SPACING,
        ),
        'white',
    )
    draw = ImageDraw.Draw(grid)
    if title:
        draw.text((GRID_SPACING, GRID_SPACING), title, fill='black', font=font)
    pixels = (images.float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    top = heading + GRID_SPACING
    for number, (row, band) in enumerate(zip(rows, bands)):
        if row_labels and number < len(row_labels):
            draw.text(
                (GRID_SPACING, top + band + (height - line_height) // 2), row_labels[number], fill='black', font=font
            )
        for column, i in enumerate(row):
            left = margin + GRID_SPACING + column * step
            for n, line in enumerate(lines[i]):
                draw.text((left, top + n * line_height), line, fill='black', font=font)
            grid.paste(Image.fromarray(pixels[i]), (left + (cell - width) // 2, top + band))
        top += band + height + GRID_SPACING
    return grid


def label_lines(text: str, font: ImageFont.ImageFont, width: int, most: int = 2) -> list[str]:
    """The text in at most `most` lines of `width` pixels, broken between words where a word fits, and ending
    in '...' where it is cut short."""
    rest, lines = ' '.join(text.split()), []
    while rest and len(lines) < most:
        end = len(rest)
        while end > 1 and font.getlength(rest[:end]) > width:
            end -= 1
        if end < len(rest) and rest[end] != ' ' and ' ' in rest[:end]:
            end = rest.rindex(' ', 0, end)  # the last whole word that fits
        lines.append(rest[:end].rstrip())
        rest = rest[end:].lstrip()
    if rest:
        last = lines[-1]
        while last and font.getlength(last + '...') > width:
            last = last[:-1]
        lines[-1] = last.rstrip() + '...'
    return lines


class SampleGrid(Callback):
    """Draws the grid of prompts (columns, labeled above the first row) and seeds (rows) at the start of a 'samples'
    evaluator, with the model's current weights (the averaged ones under 'samples_ema'); rank 0 saves it as PNG and
    logs it to W&B. Every rank generates, so that FSDP's collectives match; the grid is a few images."""

    def __init__(
        self, evaluation: EvaluationSection, data: DataSection, model: ModelSection, flux_guidance: float | None
    ):
        self.drawing, self.data, self.flux_guidance = evaluation, data, flux_guidance
        # The UNets' prompts are tokenized here, as training does; a diffusion transformer's pipeline tokenizes its own.
        pad_id = model.caption_inputs.pad_ids[0]
        transformer = model.model_folder.is_transformer
        self.tokenize = None if transformer else CaptionTokenizer(data.tokenizer, pad_id)
        self.saved: list[Path] = []

    def eval_start(self, state: State, logger: Logger) -> None:
        if not str(state.dataloader_label).startswith('samples'):
            return
        model = state.model.module if hasattr(state.model, 'module') else state.model
        drawing = self.drawing
        pipeline = build_pipeline(model, drawing.sample_scheduler, self.data.tokenizer)
        pipeline.set_progress_bar_config(disable=True)
        prompts = [prompt for _ in SAMPLE_SEEDS for prompt in drawing.sample_prompts]  # a row of the grid per seed
        seeds = [seed for seed in SAMPLE_SEEDS for _ in drawing.sample_prompts]
        with get_precision_context(state.precision, state.precision_config):
            images = generate(
                pipeline,
                prompts,
                seeds,
                drawing.sample_steps,
                drawing.guidance_scale,
                self.data.image_size,
                self.tokenize,
                self.flux_guidance,
            )
        if dist.get_global_rank() != 0:
            return
        columns = len(drawing.sample_prompts)
        labels = [*drawing.sample_prompts, *[''] * (len(prompts) - columns)]  # above the first row only
        weights = 'ema-' if state.dataloader_label.endswith('_ema') else ''
        title = f'batch {int(state.timestamp.batch)}, {"EMA" if weights else "trained"} weights'
        grid = labeled_grid(images, labels, columns, title, [f'seed {seed}' for seed in SAMPLE_SEEDS])
        path = Path(drawing.sample_dir) / f'samples-{weights}ba{int(state.timestamp.batch):06d}.png'
        # Whole or not at all: a grid cut short by a full disk would look like a drawing of broken weights.
        with staged_file(path, f'--sample_dir {drawing.sample_dir}', 'run again') as partial:
            grid.save(partial)
        self.saved.append(path)
        # As media, not in a table (Composer's default), whose images wandb keeps in its artifact staging folder,
        # outside the run's folder that `wandb sync` uploads: an offline run would lose them.
        logger.log_images(np.asarray(grid), name=f'samples/{weights or "trained"}', channels_last=True, use_table=False)
