"""The diffusion transformers' families and how each trains by default: the timestep density, loss weighting, output
preconditioning, AdamW and stability options of its published recipe. Facts only (no torch), read by config.py to
settle a run's flags and by diffusion_transformer.py to train."""

from dataclasses import dataclass

FLUX, SD3, PIXART = 'FluxTransformer2DModel', 'SD3Transformer2DModel', 'PixArtTransformer2DModel'
TIMESTEP_DENSITIES = ('uniform', 'logit_normal', 'mode')
LOSS_WEIGHTINGS = ('none', 'sigma_sqrt', 'cosmap')
# The guidance scale a guidance-distilled Flux (transformer config `guidance_embeds: true`, as Flux.1-dev's) embeds
# while it trains: the default --guidance_scale of Diffusers' Flux training example (train_dreambooth_flux.py).
FLUX_GUIDANCE = 3.5


@dataclass(frozen=True)
class Recipe:
    """How a family trains by default: the noise levels drawn, the loss weighting, AdamW and the stability options
    (each a flag's default when the flag is not given)."""

    timestep_density: str = 'uniform'  # flow matching only; PixArt draws DDPM timesteps uniformly
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    loss_weighting: str = 'none'
    # Flow matching only: the loss on `noisy - sigma * prediction` against the latents (an estimate of the image,
    # as Diffusers' SD3 example by default) instead of the prediction against the velocity `noise - latents`.
    precondition_outputs: bool = False
    flux_guidance: float | None = None  # a guidance-distilled Flux's embedded guidance (None: FLUX_GUIDANCE)
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    grad_clip_norm: float = 1.0
    caption_dropout: float = 0.0


RECIPES = {
    # MLPerf Training's flux1 reference: uniform timesteps, no shift (the scheduler's shift is 1), AdamW with beta2
    # 0.95 and weight decay 0.1, gradient norm clipped to 1, captions dropped with probability 0.1.
    FLUX: Recipe(betas=(0.9, 0.95), weight_decay=0.1, caption_dropout=0.1),
    # The SD3 paper's rectified flow (target noise - x, no preconditioning) with the noise levels and AdamW of
    # Diffusers' SD3 training example: logit-normal (mean 0, std 1) on the shift-3 grid. The example itself also
    # preconditions the outputs by default (precondition_outputs, off here: --precondition_outputs).
    SD3: Recipe(timestep_density='logit_normal'),
    # Diffusers' PixArt example: DDPM timesteps uniformly, its AdamW.
    PIXART: Recipe(),
}


def is_flow_matching(class_name: str) -> bool:
    return class_name in (FLUX, SD3)
