"""What the two model families share (stable_diffusion.py's UNets, diffusion_transformer.py's diffusion
transformers): each part of a model folder built as a module, the VAE's latent distribution of a batch, the noise
draw, the per-sample loss, the validation-loss metric, and the Composer model's frozen encoders and evaluation hooks
(`FrozenEncodersModel`).

A part loads its weights where the folder has them and is otherwise randomly initialized from its config, which is
right for training from scratch and never needs a download. Its class comes from its config: Diffusers' configs name
it (`_class_name`), Transformers' list it (`architectures`); a config naming neither gets the class SD's layout has
under that folder name.
"""

import contextlib
import json
from pathlib import Path

import diffusers
import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.utils import is_accelerate_available
from torchmetrics import Metric
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from datapath.images import unit_range
from settings.model_folder import ModelFolder, as_model_folder, has_weights
from settings.presets import VALIDATION_TIMESTEPS

# The class of each part folder of SD's layout, where its config names none.
MODEL_PARTS = {
    'unet': UNet2DConditionModel,
    'vae': AutoencoderKL,
    'text_encoder': CLIPTextModel,
    'text_encoder_2': CLIPTextModelWithProjection,  # SDXL's second encoder (OpenCLIP ViT-bigG/14)
}
# Diffusers classes a model folder may name (the denoisers and the VAE), and the text encoders with their configs.
DIFFUSERS_PARTS = (
    'UNet2DConditionModel',
    'FluxTransformer2DModel',
    'SD3Transformer2DModel',
    'PixArtTransformer2DModel',
    'AutoencoderKL',
)
TEXT_ENCODERS = {
    'CLIPTextModel': (CLIPTextModel, CLIPTextConfig),
    'CLIPTextModelWithProjection': (CLIPTextModelWithProjection, CLIPTextConfig),
    'T5EncoderModel': (T5EncoderModel, T5Config),
}


def part_class(folder: ModelFolder, part: str) -> type:
    """The module class of a part folder, from its config (see the module docstring)."""
    config = folder.part_config(part)
    name = config.get('_class_name') or (config.get('architectures') or [None])[0]
    if name in DIFFUSERS_PARTS:
        return getattr(diffusers, name)
    if name in TEXT_ENCODERS:
        return TEXT_ENCODERS[name][0]
    if config.get('model_type') == 't5':
        return T5EncoderModel
    return MODEL_PARTS[part]


def build_part(
    folder: ModelFolder | Path, part: str, init_device: torch.device | str | None = None
) -> tuple[torch.nn.Module, bool]:
    """One part of a model folder ('unet', 'transformer', 'vae', 'text_encoder', ...) and whether its weights were
    loaded: they load (on the CPU) where the folder has them, otherwise the part is randomly initialized from its
    config on init_device (default: torch's default device, the CPU unless a caller set another)."""
    folder = as_model_folder(folder)
    model_class, model_dir = part_class(folder, part), folder.path
    if has_weights(model_dir, part):
        # Diffusers' default low_cpu_mem_usage needs the accelerate package, which this stack does not install, and
        # warns once per part that it falls back to False.
        options = (
            {'low_cpu_mem_usage': is_accelerate_available()} if model_class.__module__.startswith('diffusers') else {}
        )
        return model_class.from_pretrained(model_dir, subfolder=part, **options), True
    # Initializing SD2 base's 1.3B parameters on the host takes many seconds of CPU and gigabytes of memory per rank;
    # built on the GPU the Trainer would move them to anyway, it is quick.
    # From the config the folder's description holds (read once, at settling), not read again from its file.
    config = dict(folder.part_config(part))
    with contextlib.nullcontext() if init_device is None else torch.device(init_device):
        text_encoder = next((pair for pair in TEXT_ENCODERS.values() if pair[0] is model_class), None)
        if text_encoder:  # Transformers' models take a config object
            return model_class(text_encoder[1].from_dict(config)), False
        return model_class.from_config(config), False


def build_frozen_encoders(
    folder: ModelFolder | Path, encoders_bf16: bool = False, init_device: torch.device | str | None = None
) -> tuple[AutoencoderKL, list[torch.nn.Module], list[str]]:
    """The VAE and every text encoder of a model folder (in the order its pipeline names them), frozen and in eval
    mode, and the names of the parts whose weights were loaded. Eval mode: a module built from its config starts in
    training mode, where T5's dropout (0.1 in Flux's, SD3's and PixArt's configs) would randomize every embedding."""
    modules, loaded = [], []
    folder = as_model_folder(folder)
    for part in ('vae', *folder.text_encoder_folders):
        module, weights = build_part(folder, part, init_device)
        module = module.requires_grad_(False).eval()
        modules.append(module.to(torch.bfloat16) if encoders_bf16 else module)
        loaded += [part] * weights
    return modules[0], modules[1:], loaded


def describe_weights(parts: list[str], loaded: list[str]) -> str:
    """'weights loaded: unet; random init: vae, text_encoder', either half left out when it names nothing."""
    random_init = [part for part in parts if part not in loaded]
    halves = []
    if loaded:
        halves.append(f'weights loaded: {", ".join(loaded)}')
    if random_init:
        halves.append(f'random init: {", ".join(random_init)}')
    return '; '.join(halves)


# Forward FLOP counts by architecture and size, for this process. A count runs a meta-device copy of each part
# through FlopCounterMode, every operator dispatched in Python (longer than building the tiny model and training it a
# batch), and one process's runs, sweeps and checks count the same architecture at the same size again and again.
FORWARD_FLOPS: dict[tuple, dict[str, int]] = {}


def counted_once(parts: tuple, sizes: tuple, count) -> dict[str, int]:
    """count()'s FLOP counts of these parts (modules, or None for a part left out) at these sizes, counted once per
    process: parts of the same class and config are the same architecture, whatever their weights."""
    key = (*map(architecture, parts), *sizes)
    if key not in FORWARD_FLOPS:
        FORWARD_FLOPS[key] = count()
    return dict(FORWARD_FLOPS[key])


def architecture(part: torch.nn.Module | None) -> str | None:
    """A part's class and config, as text."""
    if part is None:
        return None
    part = getattr(part, 'module', part)  # under FSDP, the module its wrapper holds
    config = part.config
    if hasattr(config, 'to_json_string'):  # Transformers' configs
        return f'{type(part).__name__} {config.to_json_string(use_diff=False)}'
    return f'{type(part).__name__} {json.dumps(dict(config), sort_keys=True, default=repr)}'  # Diffusers' FrozenDict


def standard_normal_like(tensor: torch.Tensor) -> torch.Tensor:
    """A Gaussian draw of tensor's shape, dtype and device, in the contiguous layout whatever tensor's. Not
    torch.randn_like: it keeps a channels-last layout and fills memory in that order, so under --channels_last
    (where convolutions return channels-last latents on a GPU) the same seed gave other noise than the plain
    run, and the two steps could not be compared."""
    return torch.randn(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def latent_distribution(batch: dict, vae: AutoencoderKL | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and standard deviation of the VAE's latent distribution of a batch's images, in fp32, before either
    family's scaling: read from a precomputed batch ('latent_mean', 'latent_logvar', as precompute.py stores it) or
    computed by the frozen VAE."""
    if 'latent_mean' in batch:
        mean = batch['latent_mean'].float()
        std = torch.exp(0.5 * batch['latent_logvar'].float())  # as Diffusers' DiagonalGaussianDistribution
        return mean, std
    if vae is None:
        raise ValueError(
            'this model has no VAE or text encoder (precomputed latents): the batch needs '
            "'latent_mean', 'latent_logvar' and 'text_embedding'"
        )
    latent_dist = vae.encode(unit_range(batch['image']).to(vae.dtype)).latent_dist
    return latent_dist.mean.float(), latent_dist.std.float()


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sample's mean squared error, in fp32: the training loss is their mean, the validation loss their mean
    over fixed timesteps."""
    return F.mse_loss(prediction.float(), target.float(), reduction='none').flatten(1).mean(dim=1)


def validation_timesteps(num_train_timesteps: int, count: int = VALIDATION_TIMESTEPS) -> torch.Tensor:
    """The midpoints of `count` equal bins of the schedule: 62, 187, ..., 937 of 1000 steps for count 8."""
    return (torch.arange(count) * 2 + 1) * num_train_timesteps // (2 * count)


class ValidationLoss(Metric):
    """The mean per-sample validation loss: sums and counts in float64, summed over ranks, then divided."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state('total', default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx='sum')
        self.add_state('count', default=torch.tensor(0, dtype=torch.long), dist_reduce_fx='sum')

    def update(self, losses: torch.Tensor, valid: torch.Tensor) -> None:
        valid = valid.bool()
        self.total += losses[valid].double().sum()
        self.count += int(valid.sum())

    def compute(self) -> torch.Tensor:
        return self.total / self.count


class FrozenEncodersModel(ComposerModel):
    """A trained denoiser beside frozen encoders, evaluated on the validation loss. Subclasses give
    frozen_encoders() and validation_losses(batch)."""

    model_folder: ModelFolder | None = None  # set by the builder, with the parts whose weights it loaded

    @property
    def model_dir(self) -> Path | None:
        return None if self.model_folder is None else self.model_folder.path

    def frozen_encoders(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def validation_losses(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        # Diffusers' DDPM add_noise and get_velocity move the scheduler's alphas_cumprod to the batch's device on
        # each call. Inside a compiled forward, the first graph then guards on the CPU table and the second step
        # recompiles; so the table follows the model's device (nn.Module.to and .cuda call _apply).
        super()._apply(fn, recurse)
        scheduler = getattr(self, 'noise_scheduler', None)
        table = getattr(scheduler, 'alphas_cumprod', None)
        parameter = next(self.parameters(), None)
        if isinstance(table, torch.Tensor) and parameter is not None and not parameter.is_meta:
            scheduler.alphas_cumprod = table.to(parameter.device)
        return self

    def train(self, mode: bool = True):
        # Composer calls model.train() every epoch; the frozen encoders must stay in eval mode.
        super().train(mode)
        for encoder in self.frozen_encoders():
            encoder.eval()
        return self

    # Evaluation (Composer's Evaluators, see evaluation.py): the validation loss, and sample images.
    def eval_forward(self, batch: dict, outputs=None):
        """The per-sample validation losses of a ValidationSplit batch. A sample-grid batch only marks that a grid
        is due: export.SampleGrid draws it (at EVAL_START, with the weights the evaluator runs on). Any other
        batch gets the model's forward, as Composer's default."""
        if 'sample_grid' in batch:
            return None
        if 'valid' in batch:
            return self.validation_losses(batch)
        return self(batch)

    def get_metrics(self, is_train: bool = False) -> dict:
        return {} if is_train else {'ValidationLoss': ValidationLoss()}

    def update_metric(self, batch: dict, outputs, metric) -> None:
        if 'valid' in batch:  # a ValidationSplit batch: other evaluation data has no metric here
            metric.update(outputs, batch['valid'])
