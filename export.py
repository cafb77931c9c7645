"""A trained model as a Diffusers StableDiffusionPipeline: for the sample grids (evaluation.py), for generate.py,
and saved whole by `--export_pipeline DIR`, so that `StableDiffusionPipeline.from_pretrained(DIR)` loads it offline.

An exported pipeline's tokenizer gives the ids the model was trained on (tokenizer.CaptionTokenizer): the built-in
CLIP tokenizer with CLIP's caption cleaning moved inside it (lowercase, whitespace collapsed: prompts arrive raw)
and OpenCLIP's padding id 0, or the run's --tokenizer folder. One difference, as in SD2's own tokenizer folder:
its padding token is '!', so a '!' in a prompt reads as padding. `generate` encodes prompts with CaptionTokenizer
itself, as in training.
"""

import contextlib
from pathlib import Path

import torch
from composer.utils import dist
from diffusers import DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline
from tokenizers import Regex, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ema import EMA, full_unet
from model import StableDiffusion
from tokenizer import (
    CAPTION_LENGTH,
    CLIP_END,
    CLIP_PAD_ID,
    CLIP_START,
    CaptionTokenizer,
    build_clip_tokenizer,
    caption_pad_ids,
)

# Samplers by flag name, built from the training noise schedule (betas, prediction type).
SCHEDULERS = {'ddim': DDIMScheduler, 'euler': EulerDiscreteScheduler}


def pipeline_tokenizer(folder: str | None = None, pad_id: int = CLIP_PAD_ID):
    """A Transformers tokenizer giving CaptionTokenizer's ids for raw prompts, padded to 77 positions with the
    text encoder's pad id (tokenizer.caption_pad_ids)."""
    if folder is not None:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        backend = build_clip_tokenizer()
        backend.normalizer = normalizers.Sequence(
            [normalizers.Replace(Regex(r'\s+'), ' '), normalizers.Strip(), normalizers.Lowercase()]
        )
        # The generic class around the `tokenizers` object, saved and loaded as it is: Transformers' CLIP class
        # rebuilds the tokenizer on load in 5.x (with a normalizer that changes ids). The padding is id 0 ('!'),
        # OpenCLIP's (SD2's own tokenizer folder sets the same), or OpenAI CLIP's end of text.
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=CLIP_START,
            eos_token=CLIP_END,
            unk_token=CLIP_END,
            pad_token='!' if pad_id == CLIP_PAD_ID else CLIP_END,
        )
    tokenizer.model_max_length = CAPTION_LENGTH
    return tokenizer


def build_pipeline(
    model: StableDiffusion, scheduler: str = 'ddim', tokenizer: str | None = None, unet=None
) -> StableDiffusionPipeline:
    """The model's parts in a pipeline (sharing their weights; `unet` replaces the model's), with a sampler
    `scheduler` of its noise schedule."""
    if model.vae is None:
        raise ValueError('a pipeline needs the VAE and text encoder: this model trains on precomputed latents')
    return StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=pipeline_tokenizer(tokenizer, model_pad_id(model)),
        unet=model.unet if unet is None else unet,
        scheduler=SCHEDULERS[scheduler].from_config(model.noise_scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def model_pad_id(model: StableDiffusion) -> int:
    """The pad id the model's text encoder was trained with (OpenCLIP's 0 unless its folder says otherwise)."""
    return caption_pad_ids(model.model_dir)[0] if model.model_dir is not None else CLIP_PAD_ID


@torch.no_grad()
def generate(
    pipeline: StableDiffusionPipeline,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance_scale: float,
    image_size: int,
    tokenizer: CaptionTokenizer,
) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1], one per prompt and seed: prompts encoded with the training tokenizer and
    the pipeline's text encoder, initial latents drawn from each seed, so an image depends on its prompt and seed
    only."""
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


def export_pipeline(trainer, out_dir: str | Path, scheduler: str = 'ddim', tokenizer: str | None = None) -> Path:
    """Saves the trained model as a pipeline folder (rank 0), with the averaged UNet when the run has an EMA."""
    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    ema = next((a for a in trainer.state.algorithms if isinstance(a, EMA)), None)
    with ema.ema_weights() if ema is not None else contextlib.nullcontext():
        unet = full_unet(model.unet)  # a collective under FSDP
        if unet is not None:
            build_pipeline(model, scheduler, tokenizer, unet).save_pretrained(out_dir, safe_serialization=True)
    dist.barrier()
    return Path(out_dir)
