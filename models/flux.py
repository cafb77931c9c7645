"""Flux.1 (FluxTransformer2DModel): what its transformer reads and how it is run. The facts the settling reads
without torch (its folder's encoders, caption lengths, recipe, pipeline) are settings/families.py's FLUX."""

import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from settings.model_folder import LATENT_DOWNSAMPLE


def encode_text(text_encoders: list[torch.nn.Module], batch: dict) -> dict[str, torch.Tensor]:
    """T5's tokens as the text sequence, beside CLIP-L's pooled output."""
    clip, t5 = text_encoders
    return {
        'text_embedding': t5(batch['input_ids_2'])[0].float(),
        'pooled_text_embedding': clip(batch['input_ids']).pooler_output.float(),
    }


def run_transformer(
    transformer, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, guidance: float | None
) -> torch.Tensor:
    """Flux reads 2x2 latent patches as a sequence, with (0, row, column) position ids, and timesteps in [0, 1]; a
    guidance-distilled Flux (Flux.1-dev) also the guidance scale it embeds."""
    batch, channels, height, width = noisy.shape
    packed = FluxPipeline._pack_latents(noisy, batch, channels, height, width)
    image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, noisy.device, noisy.dtype)
    text_states = text['text_embedding']
    text_ids = torch.zeros(text_states.shape[1], 3, device=noisy.device, dtype=noisy.dtype)
    output = transformer(
        hidden_states=packed,
        timestep=timesteps / 1000,
        pooled_projections=text['pooled_text_embedding'],
        encoder_hidden_states=text_states,
        txt_ids=text_ids,
        img_ids=image_ids,
        guidance=None if guidance is None else torch.full((batch,), guidance, device=noisy.device),
        return_dict=False,
    )[0]
    pixels = (height * LATENT_DOWNSAMPLE, width * LATENT_DOWNSAMPLE)
    return FluxPipeline._unpack_latents(output, *pixels, LATENT_DOWNSAMPLE)
