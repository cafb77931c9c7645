"""Diffusion transformers as a Composer model: Flux.1, SD3.5 and PixArt-Sigma, built from a model folder with a
transformer/ in place of a UNet, trained as Diffusers' training examples train each family, with their training
FLOPs.

Flux and SD3 learn a flow: latents normalized with the VAE's shift and scale, a noise level sigma in [0, 1] drawn
from a timestep density (uniform, logit-normal or "mode") on the scheduler's shifted grid, noisy latents
`(1 - sigma) x + sigma noise`, and the target `noise - x` (the rectified flow of the SD3 paper), the loss optionally
weighted per sigma; or, with the recipe's precondition_outputs (Diffusers' SD3 example's default), the output turned
into an estimate of x, `noisy - sigma prediction`, against x: the same error scaled by sigma. Flux reads its latents
as a sequence of 2x2 patches with (0, row, column) position ids and its text as T5 tokens beside a pooled CLIP
embedding, and a guidance-distilled Flux (Flux.1-dev) also a guidance scale; SD3 reads CLIP-L and CLIP-G
penultimate states (side by side, zero-padded to T5's width) followed by T5's tokens, and both CLIPs' pooled
embeddings. PixArt-Sigma predicts DDPM noise (epsilon, or v where its scheduler's prediction_type says so) from T5
tokens with their padding masked, of which the loss takes the first half of the output channels (the rest is the
learned variance, left untrained as in Diffusers' PixArt example); where its config asks for it (PixArt-alpha's
1024px models) it is also conditioned on the image's resolution and aspect ratio.
"""

from functools import partial

import torch
from diffusers import AutoencoderKL, DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import flux, pixart, sd3
from models.parts import (
    FrozenEncodersModel,
    build_frozen_encoders,
    build_part,
    counted_once,
    latent_distribution,
    per_sample_mse,
    standard_normal_like,
    validation_timesteps,
)
from settings.families import EMBEDDED_GUIDANCE, FAMILIES, FLUX, PIXART, SD3, Recipe, is_flow_matching
from settings.model_folder import (
    CAPTION_LENGTH,
    DDPM_TARGETS,
    LATENT_DOWNSAMPLE,
    ModelFolder,
    text_shapes,
)
from settings.presets import VALIDATION_TIMESTEPS


class DiffusionTransformer(FrozenEncodersModel):
    """Trains a diffusion transformer on its family's objective (see the module docstring), with the VAE and text
    encoders frozen: in eval mode, without gradients, outside the optimizer, and run online every step. Without them
    (precomputed) it trains from batches of 'latent_mean', 'latent_logvar', 'text_embedding' (what the transformer
    reads as encoder_hidden_states), for Flux and SD3 'pooled_text_embedding', and for PixArt optionally
    'text_mask'. A batch may carry 'noise', 'latent_noise' and 'sigmas' (flow matching) or 'timesteps' (PixArt) to
    make a step deterministic; otherwise each is drawn at random.
    """

    denoiser_name = 'transformer'

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: AutoencoderKL | None,
        text_encoders: list[torch.nn.Module],
        noise_scheduler,
        vae_config: dict,
        recipe: Recipe | None = None,
    ):
        super().__init__()
        self.transformer = transformer
        self.family = type(transformer).__name__
        self.recipe = recipe or FAMILIES[self.family].recipe
        self.vae = None if vae is None else vae.requires_grad_(False).eval()
        # Registered as submodules (moved, cast and checkpointed with the model) under their folder names.
        self.text_encoder_names = FAMILIES[self.family].text_encoders[: len(text_encoders)]
        for name, encoder in zip(self.text_encoder_names, text_encoders):
            setattr(self, name, encoder.requires_grad_(False).eval())
        self.noise_scheduler = noise_scheduler
        if not is_flow_matching(self.family) and noise_scheduler.config.prediction_type not in DDPM_TARGETS:
            raise ValueError(f'prediction_type {noise_scheduler.config.prediction_type!r}: one of {DDPM_TARGETS}')
        if not is_flow_matching(self.family) and self.recipe.precondition_outputs:
            raise ValueError(f'precondition_outputs: a flow matching option; {self.family} learns DDPM noise')
        # A guidance-distilled Flux embeds a guidance scale beside the timestep: trained at the recipe's.
        self.guidance = None
        if transformer.config.get('guidance_embeds'):
            self.guidance = EMBEDDED_GUIDANCE if self.recipe.flux_guidance is None else self.recipe.flux_guidance
        self.latent_channels = vae_config['latent_channels']
        self.latent_shift = vae_config.get('shift_factor') or 0.0
        self.latent_scale = vae_config['scaling_factor']
        self._forward_flops: dict[tuple, dict[str, int]] = {}
        self.weights_loaded: list[str] = []

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.transformer

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return [getattr(self, name) for name in self.text_encoder_names]

    def parts(self) -> dict[str, torch.nn.Module]:
        named = {'transformer': self.transformer, 'vae': self.vae}
        named.update(zip(self.text_encoder_names, self.text_encoders))
        return {name: part for name, part in named.items() if part is not None}

    def frozen_encoders(self) -> list[torch.nn.Module]:
        return ([self.vae] if self.vae is not None else []) + self.text_encoders

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        """FSDP's units inside the transformer: one per block (Flux: its double- and single-stream blocks)."""
        return [*self.transformer.transformer_blocks, *getattr(self.transformer, 'single_transformer_blocks', [])]

    def precomputed_shapes(self, latent_size: int) -> dict:
        """What a precomputed sample holds at a latent size (data.SyntheticLatentsDataset's arguments)."""
        shapes = text_shapes(self.family, self.transformer.config, FAMILIES[self.family].t5_caption_length)
        (caption_length, embedding_dim) = shapes['text_embedding']
        pooled = shapes.get('pooled_text_embedding')
        return {
            'latent_channels': self.latent_channels,
            'latent_size': latent_size,
            'embedding_dim': embedding_dim,
            'caption_length': caption_length,
            'pooled_dim': pooled[0] if pooled else None,
        }

    # ------------------------------------------------------------------------------------------- training

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        latents, text = self.encode(batch)
        noise = batch.get('noise')
        if noise is None:
            noise = standard_normal_like(latents)
        if is_flow_matching(self.family):
            sigmas = batch.get('sigmas')
            if sigmas is None:
                sigmas = self.draw_sigmas(latents.shape[0]).to(latents.device)
            return self.predict(latents, text, noise, sigmas, self.recipe.precondition_outputs)
        timesteps = batch.get('timesteps')
        if timesteps is None:  # uniform over all training steps
            steps = self.noise_scheduler.config.num_train_timesteps
            timesteps = torch.randint(0, steps, (latents.shape[0],), device=latents.device)
        return self.predict(latents, text, noise, timesteps)

    def draw_sigmas(self, count: int) -> torch.Tensor:
        """Noise levels from the recipe's timestep density, on the scheduler's (shifted) grid of training sigmas,
        as Diffusers' Flux and SD3 training examples draw them."""
        recipe = self.recipe
        u = compute_density_for_timestep_sampling(
            recipe.timestep_density, count, recipe.logit_mean, recipe.logit_std, recipe.mode_scale
        )
        steps = self.noise_scheduler.config.num_train_timesteps
        indices = (u * steps).long().clamp(max=steps - 1)
        return self.noise_scheduler.sigmas[indices].float()

    def predict(
        self, latents: torch.Tensor, text: dict, noise: torch.Tensor, levels: torch.Tensor, precondition: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The transformer's prediction for latents noised to `levels` (sigmas for flow matching, DDPM timesteps for
        PixArt), its training target, and each sample's loss weight. precondition (flow matching): the prediction
        turned into an estimate of the latents, `noisy - sigma prediction`, and the latents as the target."""
        if is_flow_matching(self.family):
            sigma = levels.view(-1, 1, 1, 1)
            noisy = (1 - sigma) * latents + sigma * noise
            target = noise - latents
            weights = compute_loss_weighting_for_sd3(self.recipe.loss_weighting, levels).float()
            timesteps = levels * self.noise_scheduler.config.num_train_timesteps
        else:
            noisy = self.noise_scheduler.add_noise(latents, noise, levels)
            target = noise
            if self.noise_scheduler.config.prediction_type == 'v_prediction':
                target = self.noise_scheduler.get_velocity(latents, noise, levels)
            weights = torch.ones_like(levels, dtype=torch.float32)
            timesteps = levels
        prediction = run_transformer(self.transformer, self.family, noisy, timesteps, text, self.guidance)
        if precondition:
            return noisy - sigma * prediction, latents, weights
        return prediction, target, weights

    @torch.no_grad()
    def encode(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Normalized latents sampled from the VAE's latent distribution, and the text conditioning: computed by the
        frozen encoders, or read from a precomputed batch. In fp32, whatever the encoders hold."""
        mean, std = latent_distribution(batch, self.vae)
        if 'latent_mean' in batch:
            text = {name: batch[name].float() for name in ('text_embedding', 'pooled_text_embedding') if name in batch}
            if 'text_mask' in batch:
                text['text_mask'] = batch['text_mask']
        else:
            text = encode_text(self.family, self.text_encoders, batch)
        latent_noise = batch.get('latent_noise')
        if latent_noise is None:
            latent_noise = standard_normal_like(mean)
        return (mean + std * latent_noise - self.latent_shift) * self.latent_scale, text

    def loss(self, outputs, batch) -> torch.Tensor:
        prediction, target, weights = outputs
        return (per_sample_mse(prediction, target) * weights).mean()

    # ------------------------------------------------------------------------------------------- evaluation

    def validation_levels(self, device) -> torch.Tensor:
        """Flow matching: MLPerf flux1's 8 equidistant timesteps 0, 1/8, ..., 7/8 as sigmas. PixArt: the midpoints
        of 8 equal bins of its DDPM schedule, as the UNets'."""
        if is_flow_matching(self.family):
            return torch.arange(VALIDATION_TIMESTEPS, device=device) / VALIDATION_TIMESTEPS
        return validation_timesteps(self.noise_scheduler.config.num_train_timesteps).to(device)

    def validation_losses(self, batch: dict) -> torch.Tensor:
        """Each sample's loss, the mean over the fixed noise levels with the sample's fixed draws (the batch's
        'latent_noise' and 'noise', one per level), unweighted."""
        latents, text = self.encode(batch)
        losses = []
        for k, level in enumerate(self.validation_levels(latents.device)):
            prediction, target, _ = self.predict(latents, text, batch['noise'][:, k], level.expand(latents.shape[0]))
            losses.append(per_sample_mse(prediction, target))
        return torch.stack(losses, dim=1).mean(dim=1)

    # ------------------------------------------------------------------------------------------- FLOPs

    def flops_per_batch(self, batch: dict) -> int:
        """Training FLOPs of this batch, for Composer's SpeedMonitor (FLOP/s and MFU)."""
        if 'latent_mean' in batch:
            latents = batch['latent_mean']
            count, height, width = latents.shape[0], *(LATENT_DOWNSAMPLE * side for side in latents.shape[-2:])
        else:
            count, height, width = batch['image'].shape[0], *batch['image'].shape[-2:]
        return count * self.flops_per_image(height, width)

    def flops_per_image(self, height: int, width: int, caption_length: int | None = None) -> int:
        """Training FLOPs per image: the transformer's forward and backward (3x its forward) and the frozen
        encoders' forward. caption_length: T5's (the family's by default)."""
        parts = self.forward_flops(height, width, caption_length)
        return 3 * parts['transformer'] + sum(flops for part, flops in parts.items() if part != 'transformer')

    def trained_flops_per_image(self, height: int, width: int, caption_length: int | None = None) -> int:
        return 3 * self.forward_flops(height, width, caption_length)['transformer']

    def forward_flops(self, height: int, width: int, caption_length: int | None = None) -> dict[str, int]:
        key = (height, width, caption_length or FAMILIES[self.family].t5_caption_length)
        if key not in self._forward_flops:
            parts, sizes = (self.transformer, self.vae, *self.text_encoders), (*key, self.latent_channels)
            count = partial(count_forward_flops, self.transformer, self.vae, self.text_encoders, *sizes)
            self._forward_flops[key] = counted_once(parts, sizes, count)
        return self._forward_flops[key]


# ----------------------------------------------------------------------------------- the families' inputs


# Each family's module: what its transformer reads of the captions' encoders, and how it is run on noisy latents.
FAMILY_MODULES = {FLUX: flux, SD3: sd3, PIXART: pixart}


def encode_text(family: str, text_encoders: list[torch.nn.Module], batch: dict) -> dict[str, torch.Tensor]:
    """What a family's transformer reads, from caption token ids (one column per encoder, in folder order):
    'text_embedding' (its encoder_hidden_states), 'pooled_text_embedding' (Flux: CLIP-L's pooled output; SD3: both
    CLIPs' projected ones side by side) and for PixArt 'text_mask' (T5's padding masked)."""
    return FAMILY_MODULES[family].encode_text(text_encoders, batch)


def run_transformer(
    transformer, family: str, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, guidance: float | None = None
) -> torch.Tensor:
    """The output of a transformer of `family` for noisy latents (batch, channels, height, width), in the same
    layout. The family is given: under FSDP the module is a FullyShardedDataParallel wrapper. guidance: the scale a
    guidance-distilled Flux embeds (None for the others)."""
    return FAMILY_MODULES[family].run_transformer(transformer, noisy, timesteps, text, guidance)


# ----------------------------------------------------------------------------------- FLOPs


def count_forward_flops(
    transformer: torch.nn.Module,
    vae: AutoencoderKL | None,
    text_encoders: list[torch.nn.Module],
    height: int,
    width: int,
    t5_length: int,
    latent_channels: int,
) -> dict[str, int]:
    """Forward FLOPs per image of each part ('transformer', 'vae_encoder', 'text_encoder', ...): matmuls,
    attention included, counted by PyTorch's FlopCounterMode on meta-device copies of the given parts (no memory,
    no compute) with the math attention kernel, as model.count_forward_flops counts the UNets'. Without a VAE
    (precomputed) the transformer alone."""
    counts = {}
    transformer = getattr(transformer, 'module', transformer)  # under FSDP, the model its wrapper holds
    family = type(transformer).__name__
    with torch.device('meta'), sdpa_kernel(SDPBackend.MATH):
        if vae is not None:
            meta_vae = AutoencoderKL.from_config(vae.config)
            with FlopCounterMode(display=False) as counter:
                meta_vae.encode(torch.empty(1, vae.config.in_channels, height, width))
            counts['vae_encoder'] = counter.get_total_flops()
            for name, encoder in zip(FAMILIES[family].text_encoders, text_encoders):
                meta_encoder = type(encoder)(encoder.config)
                length = t5_length if encoder.config.model_type == 't5' else CAPTION_LENGTH
                with FlopCounterMode(display=False) as counter:
                    meta_encoder(torch.zeros(1, length, dtype=torch.long))
                counts[name] = counter.get_total_flops()
        meta_transformer = type(transformer).from_config(transformer.config)
        latents = torch.empty(1, latent_channels, height // LATENT_DOWNSAMPLE, width // LATENT_DOWNSAMPLE)
        text = {
            name: torch.empty(1, *shape) for name, shape in text_shapes(family, transformer.config, t5_length).items()
        }
        guidance = EMBEDDED_GUIDANCE if transformer.config.get('guidance_embeds') else None
        with FlopCounterMode(display=False) as counter:
            run_transformer(meta_transformer, family, latents, torch.tensor([500.0]), text, guidance)
        counts['transformer'] = counter.get_total_flops()
    return counts


# ----------------------------------------------------------------------------------- building


def convert_to_float8(transformer: torch.nn.Module, emulate: bool = False) -> int:
    """torchao's float8 training (--fp8) of the linear layers whose dimensions are both multiples of 16, as its
    float8 matmul needs: dynamic per-tensor scales, e4m3 forward and e5m2 gradients, the weights kept in their own
    precision for the optimizer. `emulate`: the float8 casts in ordinary matmuls (CPU tests). Returns how many
    layers it converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # --fp8 only

    def convertible(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(transformer, config=Float8LinearConfig(emulate=emulate), module_filter_fn=convertible)
    return sum(type(module).__name__ == 'Float8Linear' for module in transformer.modules())


def build_transformer_model(
    folder: ModelFolder,
    precomputed: bool = False,
    encoders_bf16: bool = False,
    init_device: torch.device | str | None = None,
    recipe: Recipe | None = None,
) -> DiffusionTransformer:
    """The model of a diffusion transformer's folder (see model.build_model, which calls this for one), trained by
    `recipe` (default: its family's, families.FAMILIES)."""
    transformer, transformer_loaded = build_part(folder, 'transformer', init_device)  # first: the same init
    family = type(transformer).__name__
    scheduler_class = FlowMatchEulerDiscreteScheduler if is_flow_matching(family) else DDPMScheduler
    noise_scheduler = scheduler_class.from_config(dict(folder.scheduler_config))
    vae_config = dict(folder.vae_config)
    vae, text_encoders, loaded = None, [], []
    if not precomputed:
        vae, text_encoders, loaded = build_frozen_encoders(folder, encoders_bf16, init_device)
    model = DiffusionTransformer(transformer, vae, text_encoders, noise_scheduler, vae_config, recipe)
    model.model_folder = folder
    model.weights_loaded = ['transformer'] * transformer_loaded + loaded
    return model
