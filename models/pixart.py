"""PixArt-Sigma (PixArtTransformer2DModel): what its transformer reads and how it is run. The facts the settling reads
without torch (its folder's encoder, caption length, pipeline) are settings/families.py's PIXART."""

import torch

from settings.model_folder import LATENT_DOWNSAMPLE, T5_PAD_ID


def encode_text(text_encoders: list[torch.nn.Module], batch: dict) -> dict[str, torch.Tensor]:
    """T5's tokens with their padding masked, and the mask."""
    (t5,) = text_encoders
    mask = (batch['input_ids'] != T5_PAD_ID).long()
    return {'text_embedding': t5(batch['input_ids'], attention_mask=mask)[0].float(), 'text_mask': mask}


def run_transformer(
    transformer, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, guidance: float | None
) -> torch.Tensor:
    """The predicted noise: the first half of the output channels where the rest is the learned variance."""
    batch, channels, height, width = noisy.shape
    size = (height * LATENT_DOWNSAMPLE, width * LATENT_DOWNSAMPLE)
    conditions = {'resolution': None, 'aspect_ratio': None}
    if transformer.use_additional_conditions:  # PixArt-alpha's 1024px models: the image's size and aspect ratio
        conditions = {
            'resolution': torch.tensor([size], dtype=noisy.dtype, device=noisy.device).expand(batch, 2),
            'aspect_ratio': torch.tensor([[size[0] / size[1]]], dtype=noisy.dtype, device=noisy.device).expand(
                batch, 1
            ),
        }
    output = transformer(
        noisy,
        encoder_hidden_states=text['text_embedding'],
        encoder_attention_mask=text.get('text_mask'),
        timestep=timesteps,
        added_cond_kwargs=conditions,
        return_dict=False,
    )[0]
    if output.shape[1] == 2 * channels:  # learned variance beside the noise: the loss takes the noise
        output = output[:, :channels]
    return output
