"""Stable Diffusion's UNets as a Composer model, built from a model folder: the training loss, the validation loss
(one per-sample MSE for both), and the training FLOPs. `build_model` builds the model of any model folder: a
UNet's here, a diffusion transformer's in diffusion_transformer.py.

`StableDiffusion` trains the UNet on the noise-prediction loss, with the VAE and CLIP text encoder(s) frozen.
SD 1.5 and SD 2 condition the UNet on one text encoder's last hidden state; SDXL on two encoders' penultimate
hidden states side by side, plus the second's pooled embedding and the image's size and crop
("micro-conditioning"), as Diffusers' SDXL pipeline does.
Parts whose weights are in the folder (a built-in config in `configs/`, or a folder a user gives) load them, the
rest are randomly initialized from their configs (parts.py).
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from models.diffusion_transformer import DiffusionTransformer, build_transformer_model
from models.diffusion_transformer import encode_text as encode_transformer_text
from models.parts import (
    MODEL_PARTS,
    FrozenEncodersModel,
    build_frozen_encoders,
    build_part,
    counted_once,
    describe_weights,
    latent_distribution,
    per_sample_mse,
    standard_normal_like,
    validation_timesteps,
)
from settings.families import Recipe
from settings.model_folder import (
    CAPTION_LENGTH,
    LATENT_DOWNSAMPLE,
    MICRO_CONDITIONS,
    ModelFolder,
    as_model_folder,
    has_micro_conditioning,
    pooled_text_width,
)

__all__ = [
    'StableDiffusion',
    'DiffusionTransformer',
    'DiffusionModel',
    'build_model',
    'describe_weights',
]


class StableDiffusion(FrozenEncodersModel):
    """Trains the UNet to predict the noise added to VAE latents, conditioned on CLIP text embeddings.

    The VAE and text encoders are frozen: in eval mode, without gradients, outside the optimizer, and run
    online every step, as in the published benchmark. Without them (vae=None, text_encoder=None) the model
    trains from precomputed batches: 'latent_mean', 'latent_logvar' and 'text_embedding' (for SDXL also
    'pooled_text_embedding'), as precompute.py writes them. SDXL batches carry 'time_ids' (see
    MICRO_CONDITIONS) and, online, 'input_ids_2' for the second encoder. A batch may carry 'noise',
    'timesteps' and 'latent_noise' (the Gaussian draw that samples the latent distribution) to make a step
    deterministic; otherwise each is drawn at random.
    """

    family = None  # a UNet: no diffusion transformer family (a DiffusionTransformer's is its class, families.py)

    def __init__(
        self,
        unet: UNet2DConditionModel,
        vae: AutoencoderKL | None,
        text_encoder: CLIPTextModel | None,
        noise_scheduler: DDPMScheduler,
        latent_scale: float | None = None,
        text_encoder_2: CLIPTextModelWithProjection | None = None,
    ):
        super().__init__()
        self.unet = unet
        self.vae = None if vae is None else vae.requires_grad_(False).eval()
        self.text_encoder = None if text_encoder is None else text_encoder.requires_grad_(False).eval()
        self.text_encoder_2 = None if text_encoder_2 is None else text_encoder_2.requires_grad_(False).eval()
        self.micro_conditioning = has_micro_conditioning(unet.config)
        self.noise_scheduler = noise_scheduler
        # 0.18215 for SD2: scales latents to unit variance (the VAE config's scaling_factor).
        self.latent_scale = vae.config.scaling_factor if vae is not None else latent_scale
        if self.latent_scale is None:
            raise ValueError("without a VAE, pass latent_scale (the VAE config's scaling_factor)")
        self._forward_flops: dict[tuple, dict[str, int]] = {}
        self.weights_loaded: list[str] = []

    denoiser_name = 'unet'

    @property
    def denoiser(self) -> UNet2DConditionModel:
        """The trained network (both model families have one)."""
        return self.unet

    def parts(self) -> dict[str, torch.nn.Module]:
        """The model's parts by folder name, the frozen ones absent when the batches carry their outputs."""
        named = {'unet': self.unet, 'vae': self.vae, 'text_encoder': self.text_encoder}
        return {name: part for name, part in {**named, 'text_encoder_2': self.text_encoder_2}.items() if part}

    def frozen_encoders(self) -> list[torch.nn.Module]:
        return [part for part in (self.vae, self.text_encoder, self.text_encoder_2) if part is not None]

    @property
    def latent_channels(self) -> int:
        return self.unet.config.in_channels

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        """FSDP's units inside the UNet: one per resolution block."""
        return [*self.unet.down_blocks, self.unet.mid_block, *self.unet.up_blocks]

    def precomputed_shapes(self, latent_size: int) -> dict:
        """What a precomputed sample holds at a latent size (data.SyntheticLatentsDataset's arguments)."""
        config = self.unet.config
        return {
            'latent_channels': config.in_channels,
            'latent_size': latent_size,
            'embedding_dim': config.cross_attention_dim,
            'pooled_dim': pooled_text_width(config),
            'size_conditions': self.micro_conditioning,
        }

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        latents, conditioning = self.encode(batch)
        noise = batch.get('noise')
        if noise is None:
            noise = standard_normal_like(latents)
        timesteps = batch.get('timesteps')
        if timesteps is None:  # uniform over all training steps
            timesteps = torch.randint(
                0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
            )
        return self.predict(latents, conditioning, noise, timesteps)

    def predict(
        self, latents: torch.Tensor, conditioning: dict, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The UNet's prediction for latents noised to `timesteps` with `noise`, and its training target."""
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.noise_scheduler.config.prediction_type == 'v_prediction':
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        prediction = self.unet(noisy_latents, timesteps, **conditioning).sample
        return prediction, target

    @torch.no_grad()
    def encode(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Scaled latents sampled from the VAE's latent distribution, and the UNet's conditioning (keyword
        arguments of its forward): computed by the frozen encoders, or read from a precomputed batch. In fp32,
        whatever the encoders hold."""
        mean, std = latent_distribution(batch, self.vae)
        if 'latent_mean' in batch:
            text = {name: batch[name].float() for name in ('text_embedding', 'pooled_text_embedding') if name in batch}
        else:
            text = {
                name: value.float()
                for name, value in encode_text(self.text_encoder, self.text_encoder_2, batch).items()
            }
        latent_noise = batch.get('latent_noise')
        if latent_noise is None:
            latent_noise = standard_normal_like(mean)
        conditioning = {'encoder_hidden_states': text['text_embedding']}
        if self.micro_conditioning:
            conditioning['added_cond_kwargs'] = {
                'text_embeds': text['pooled_text_embedding'],
                'time_ids': batch['time_ids'].float(),
            }
        return (mean + std * latent_noise) * self.latent_scale, conditioning

    def loss(self, outputs, batch) -> torch.Tensor:
        return per_sample_mse(*outputs).mean()

    def validation_losses(self, batch: dict) -> torch.Tensor:
        """Each sample's loss, the mean over VALIDATION_TIMESTEPS fixed timesteps with the sample's fixed draws
        (the batch's 'latent_noise' and 'noise', one per timestep)."""
        latents, conditioning = self.encode(batch)
        timesteps = validation_timesteps(self.noise_scheduler.config.num_train_timesteps).to(latents.device)
        losses = []
        for k, timestep in enumerate(timesteps):
            outputs = self.predict(latents, conditioning, batch['noise'][:, k], timestep.expand(latents.shape[0]))
            losses.append(per_sample_mse(*outputs))
        return torch.stack(losses, dim=1).mean(dim=1)

    def flops_per_batch(self, batch: dict) -> int:
        """Training FLOPs of this batch, for Composer's SpeedMonitor (FLOP/s and MFU)."""
        if 'latent_mean' in batch:
            latents = batch['latent_mean']
            return latents.shape[0] * self.flops_per_image(
                LATENT_DOWNSAMPLE * latents.shape[-2],
                LATENT_DOWNSAMPLE * latents.shape[-1],
                batch['text_embedding'].shape[-2],
            )
        images = batch['image']
        return images.shape[0] * self.flops_per_image(images.shape[-2], images.shape[-1], batch['input_ids'].shape[-1])

    def flops_per_image(self, height: int, width: int, caption_length: int = CAPTION_LENGTH) -> int:
        """Training FLOPs per image: the UNet's forward and backward (3x its forward: the backward computes
        gradients of activations and of weights) and the frozen encoders' forward."""
        parts = self.forward_flops(height, width, caption_length)
        return 3 * parts['unet'] + sum(flops for part, flops in parts.items() if part != 'unet')

    def trained_flops_per_image(self, height: int, width: int, caption_length: int = CAPTION_LENGTH) -> int:
        """The trained UNet's share of flops_per_image: forward and backward."""
        return 3 * self.forward_flops(height, width, caption_length)['unet']

    def forward_flops(self, height: int, width: int, caption_length: int = CAPTION_LENGTH) -> dict[str, int]:
        key = (height, width, caption_length)
        if key not in self._forward_flops:
            parts = (self.unet, self.vae, self.text_encoder, self.text_encoder_2)
            self._forward_flops[key] = counted_once(parts, key, lambda: self._count_forward_flops(*key))
        return self._forward_flops[key]

    def _count_forward_flops(self, height: int, width: int, caption_length: int) -> dict[str, int]:
        if self.vae is None:  # precomputed: the UNet alone
            latent_height, latent_width = height // LATENT_DOWNSAMPLE, width // LATENT_DOWNSAMPLE
            return {'unet': count_unet_forward_flops(self.unet.config, latent_height, latent_width, caption_length)}
        text_configs = [encoder.config for encoder in (self.text_encoder, self.text_encoder_2) if encoder]
        return count_forward_flops(self.unet.config, self.vae.config, text_configs, height, width, caption_length)


def count_forward_flops(
    unet_config, vae_config, text_configs: list, height: int, width: int, caption_length: int
) -> dict[str, int]:
    """Forward FLOPs per image of each part ('unet', 'vae_encoder', 'text_encoder', 'text_encoder_2'): matmuls
    and convolutions, attention included.

    Counted by PyTorch's FlopCounterMode on meta-device copies (no memory, no compute, any config and
    size) with the math attention kernel: the fused CPU flash-attention kernel is invisible to the counter.
    """
    counts = {}
    with torch.device('meta'), sdpa_kernel(SDPBackend.MATH):
        vae = AutoencoderKL.from_config(vae_config)
        with FlopCounterMode(display=False) as counter:
            latents = vae.encode(torch.empty(1, vae_config.in_channels, height, width)).latent_dist.mean
        counts['vae_encoder'] = counter.get_total_flops()
        for name, text_config in zip(('text_encoder', 'text_encoder_2'), text_configs):
            text_encoder = MODEL_PARTS[name](text_config)
            with FlopCounterMode(display=False) as counter:
                text_encoder(torch.zeros(1, caption_length, dtype=torch.long))
            counts[name] = counter.get_total_flops()
    counts['unet'] = count_unet_forward_flops(unet_config, latents.shape[-2], latents.shape[-1], caption_length)
    return counts


def count_unet_forward_flops(unet_config, latent_height: int, latent_width: int, caption_length: int) -> int:
    """Forward FLOPs per sample of the UNet alone at a latent size, counted as in count_forward_flops."""
    with torch.device('meta'), sdpa_kernel(SDPBackend.MATH):
        unet = UNet2DConditionModel.from_config(unet_config)
        latents = torch.empty(1, unet_config.in_channels, latent_height, latent_width)
        conditioning = {'encoder_hidden_states': torch.empty(1, caption_length, unet_config.cross_attention_dim)}
        if has_micro_conditioning(unet_config):
            conditioning['added_cond_kwargs'] = {
                'text_embeds': torch.empty(1, pooled_text_width(unet_config)),
                'time_ids': torch.empty(1, MICRO_CONDITIONS),
            }
        with FlopCounterMode(display=False) as counter:
            unet(latents, torch.tensor([500]), **conditioning)
    return counter.get_total_flops()


def encode_text(text_encoder, text_encoder_2, batch: dict) -> dict[str, torch.Tensor]:
    """What the UNet is conditioned on, from caption token ids. One encoder (SD 1.5, SD 2): 'text_embedding', its
    last hidden state after the final layer norm. Two (SDXL): the penultimate hidden states of both, without
    the final norm, side by side ('text_embedding', 768 + 1280 wide), and 'pooled_text_embedding', the second
    encoder's projected end-of-text state."""
    if text_encoder_2 is None:
        return {'text_embedding': text_encoder(batch['input_ids'])[0]}
    first = text_encoder(batch['input_ids'], output_hidden_states=True).hidden_states[-2]
    second = text_encoder_2(batch['input_ids_2'], output_hidden_states=True)
    return {
        'text_embedding': torch.cat([first, second.hidden_states[-2]], dim=-1),
        'pooled_text_embedding': second.text_embeds,
    }


def build_encoders(
    folder: ModelFolder | Path, encoders_bf16: bool = False, init_device: torch.device | str | None = None
) -> tuple[AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection | None, list[str]]:
    """The VAE and text encoder(s) of a UNet's model folder (the second None but for SDXL), and the names of those
    whose weights were loaded."""
    vae, text_encoders, loaded = build_frozen_encoders(folder, encoders_bf16, init_device)
    return vae, text_encoders[0], text_encoders[1] if len(text_encoders) > 1 else None, loaded


def encode_captions(folder: ModelFolder, text_encoders: list[torch.nn.Module], batch: dict) -> dict[str, torch.Tensor]:
    """What a model folder's denoiser is conditioned on, from caption token ids (precompute.py's text columns):
    encode_text here for the UNets, diffusion_transformer.encode_text for a transformer."""
    if folder.is_transformer:
        return encode_transformer_text(folder.family, text_encoders, batch)
    return encode_text(text_encoders[0], text_encoders[1] if len(text_encoders) > 1 else None, batch)


DiffusionModel = StableDiffusion | DiffusionTransformer


def build_model(
    folder: ModelFolder | Path,
    prediction_type: str | None = None,
    attention: str = 'sdpa',
    precomputed: bool = False,
    encoders_bf16: bool = False,
    init_device: torch.device | str | None = None,
    recipe: Recipe | None = None,
) -> DiffusionModel:
    """The model of a model folder (the ModelFolder a run's settling read, or the path model_folder.resolve_model_dir
    finds from a name), with `model_folder`, `model_dir` and `weights_loaded` (the parts whose weights the folder
    held) set; its configs are the ModelFolder's, read once. precomputed: the UNet alone (the batches
    carry the encoders' outputs); encoders_bf16: the frozen VAE and text encoder weights in bf16; init_device:
    where the parts without weights are randomly initialized (see build_part). A folder with a transformer/
    instead of a unet/ gets diffusion_transformer.py's model, trained by `recipe` (default: its family's);
    prediction_type and attention are UNet options."""
    folder = as_model_folder(folder)
    if folder.is_transformer:
        return build_transformer_model(folder, precomputed, encoders_bf16, init_device, recipe)
    unet, unet_loaded = build_part(folder, 'unet', init_device)  # first: the same init with or without encoders
    scheduler_config = dict(folder.scheduler_config)
    if prediction_type is not None:
        scheduler_config['prediction_type'] = prediction_type
    noise_scheduler = DDPMScheduler.from_config(scheduler_config)
    if attention == 'xformers':
        unet.enable_xformers_memory_efficient_attention()
    if precomputed:  # the UNet alone: the batches carry the encoders' outputs
        latent_scale = folder.vae_config['scaling_factor']
        model = StableDiffusion(unet, None, None, noise_scheduler, latent_scale)
        encoders_loaded = []
    else:
        vae, text_encoder, text_encoder_2, encoders_loaded = build_encoders(folder, encoders_bf16, init_device)
        model = StableDiffusion(unet, vae, text_encoder, noise_scheduler, text_encoder_2=text_encoder_2)
    model.model_folder = folder
    model.weights_loaded = ['unet'] * unet_loaded + encoders_loaded
    return model
