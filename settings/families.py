"""The diffusion transformer families, each described once: what its model folder holds, what its batches carry
beside the latents, how it trains by default (the timestep density, loss weighting, output preconditioning, AdamW
and stability options of its published recipe) and the Diffusers pipeline it is drawn with. Other modules ask the
family (FAMILIES[class name]) instead of branching on its name. Facts only (no torch)."""

from dataclasses import dataclass, field

FLUX, SD3, PIXART = 'FluxTransformer2DModel', 'SD3Transformer2DModel', 'PixArtTransformer2DModel'
TIMESTEP_DENSITIES = ('uniform', 'logit_normal', 'mode')
LOSS_WEIGHTINGS = ('none', 'sigma_sqrt', 'cosmap')
# The guidance scale a guidance-distilled transformer (config `guidance_embeds: true`, as Flux.1-dev's) embeds
# while it trains: the default --guidance_scale of Diffusers' Flux training example (train_dreambooth_flux.py).
EMBEDDED_GUIDANCE = 3.5


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
    flux_guidance: float | None = None  # a guidance-distilled transformer's embedded guidance (None: none)
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    grad_clip_norm: float = 1.0
    caption_dropout: float = 0.0


@dataclass(frozen=True)
class Family:
    # Its model folder: transformer/ and these text encoders' folders, in the order its pipeline names them (the
    # pipeline's text_encoder, text_encoder_2, ... and their tokenizer, tokenizer_2, ...): CLIPs first, T5 last.
    text_encoders: tuple[str, ...]
    t5_caption_length: int  # T5's tokens a caption is read as (CLIP's are 77)
    caption_width: str  # the transformer config's field holding the caption embedding's width
    clip_tokens_first: bool  # the text sequence is the CLIPs' 77 tokens, then T5's (SD3's joint sequence)
    caption_extra: str  # beside the text embedding, a batch's 'pooled_text_embedding' or T5's 'text_mask'
    flow_matching: bool  # learns a flow, sampled by its Euler sampler; else DDPM noise
    pipeline: str  # the Diffusers pipeline it is exported as and drawn with
    guidance_keyword: str  # the pipeline's classifier-free guidance argument
    embeds_guidance: bool  # a transformer whose config has guidance_embeds embeds EMBEDDED_GUIDANCE in training
    recipe: Recipe
    drawing_options: dict = field(default_factory=dict)  # the pipeline's other arguments, as training reads captions

    @property
    def tokenizers(self) -> tuple[str, ...]:
        """The pipeline's tokenizer of each text encoder (tokenizer, tokenizer_2, ...), in the same order."""
        return tuple(name.replace('text_encoder', 'tokenizer') for name in self.text_encoders)


FAMILIES = {
    # Flux.1-schnell (black-forest-labs/FLUX.1-schnell): CLIP-L (pooled), T5-XXL of 256 tokens, as MLPerf's flux1
    # benchmark and Diffusers' pipeline; schnell's guidance is the true classifier-free kind. Its recipe is MLPerf
    # Training's flux1 reference: uniform timesteps, no shift (the scheduler's shift is 1), AdamW with beta2 0.95 and
    # weight decay 0.1, gradient norm clipped to 1, captions dropped with probability 0.1.
    FLUX: Family(
        text_encoders=('text_encoder', 'text_encoder_2'),
        t5_caption_length=256,
        caption_width='joint_attention_dim',
        clip_tokens_first=False,
        caption_extra='pooled_text_embedding',
        flow_matching=True,
        pipeline='FluxPipeline',
        guidance_keyword='true_cfg_scale',
        embeds_guidance=True,
        recipe=Recipe(betas=(0.9, 0.95), weight_decay=0.1, caption_dropout=0.1),
    ),
    # SD3.5 medium (stabilityai/stable-diffusion-3.5-medium): CLIP-L, CLIP-G, T5-XXL of 256 tokens (its pipeline's
    # default). The SD3 paper's rectified flow (target noise - x, no preconditioning) with the noise levels and AdamW
    # of Diffusers' SD3 training example: logit-normal (mean 0, std 1) on the shift-3 grid. The example itself also
    # preconditions the outputs by default (precondition_outputs, off here: --precondition_outputs).
    SD3: Family(
        text_encoders=('text_encoder', 'text_encoder_2', 'text_encoder_3'),
        t5_caption_length=256,
        caption_width='joint_attention_dim',
        clip_tokens_first=True,
        caption_extra='pooled_text_embedding',
        flow_matching=True,
        pipeline='StableDiffusion3Pipeline',
        guidance_keyword='guidance_scale',
        embeds_guidance=False,
        recipe=Recipe(timestep_density='logit_normal'),
    ),
    # PixArt-Sigma (PixArt-alpha/PixArt-Sigma-XL-2-1024-MS): T5-XXL of 300 tokens and its padding mask. Diffusers'
    # PixArt example: DDPM timesteps uniformly, its AdamW. Drawn without resizing to its aspect-ratio bins or
    # rewriting captions, as training reads them.
    PIXART: Family(
        text_encoders=('text_encoder',),
        t5_caption_length=300,
        caption_width='caption_channels',
        clip_tokens_first=False,
        caption_extra='text_mask',
        flow_matching=False,
        pipeline='PixArtSigmaPipeline',
        guidance_keyword='guidance_scale',
        embeds_guidance=False,
        recipe=Recipe(),
        drawing_options={'use_resolution_binning': False, 'clean_caption': False},
    ),
}


def is_flow_matching(class_name: str) -> bool:
    return class_name in FAMILIES and FAMILIES[class_name].flow_matching
