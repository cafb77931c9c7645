"""SD3 and SD3.5 (SD3Transformer2DModel): what its transformer reads and how it is run. The facts the settling reads
without torch (its folder's encoders, caption lengths, recipe, pipeline) are settings/families.py's SD3."""

import torch


def encode_text(text_encoders: list[torch.nn.Module], batch: dict) -> dict[str, torch.Tensor]:
    """CLIP-L's and CLIP-G's penultimate states side by side, zero-padded to T5's width, followed by T5's tokens;
    both CLIPs' projected pooled outputs side by side."""
    clip_l, clip_g, t5 = text_encoders
    first = clip_l(batch['input_ids'], output_hidden_states=True)
    second = clip_g(batch['input_ids_2'], output_hidden_states=True)
    t5_states = t5(batch['input_ids_3'])[0].float()
    clip_states = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1).float()
    clip_states = torch.nn.functional.pad(clip_states, (0, t5_states.shape[-1] - clip_states.shape[-1]))
    return {
        'text_embedding': torch.cat([clip_states, t5_states], dim=-2),
        'pooled_text_embedding': torch.cat([first.text_embeds, second.text_embeds], dim=-1).float(),
    }


def run_transformer(
    transformer, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, guidance: float | None
) -> torch.Tensor:
    return transformer(
        hidden_states=noisy,
        timestep=timesteps,
        encoder_hidden_states=text['text_embedding'],
        pooled_projections=text['pooled_text_embedding'],
        return_dict=False,
    )[0]
