"""Stable Diffusion 2 training-throughput benchmark: Composer's Trainer around Diffusers' UNet and VAE
and Transformers' CLIP text encoder, trained from scratch on the noise-prediction loss.

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4   # published run
    python benchmark.py --use_synth_data                                   # on a laptop: tiny model

Flags default to the published run (512px, global batch 2048, AdamW lr 1e-4 wd 1e-3, constant LR).
Without a GPU the default model is `tiny`, and the choice is printed at start.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from composer import Trainer
from composer.algorithms import ChannelsLast, LowPrecisionGroupNorm, LowPrecisionLayerNorm
from composer.callbacks import SpeedMonitor
from composer.core import Time, TimeUnit
from composer.loggers import InMemoryLogger, WandBLogger
from composer.models import ComposerModel
from composer.optim import ConstantScheduler
from composer.profiler import Profiler, cyclic_schedule
from composer.utils import dist, get_device, reproducibility
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextConfig, CLIPTextModel

from streaming.base.util import clean_stale_shared_memory

from convert import SAMPLE_DATASET, SAMPLE_SIZE, ensure_sample_dataset
from data import (CAPTION_LENGTH, BadSampleCounter, DataError, PrecomputedLatentsDataset, StreamingLAIONDataset,
                  SyntheticImageCaptionDataset, SyntheticLatentsDataset, collate, unit_range)
from ema import EMA, export_ema_unet

CONFIGS_DIR = Path(__file__).resolve().parent / 'configs'
BUILTIN_MODELS = sorted(path.name for path in CONFIGS_DIR.iterdir() if path.is_dir())
# Files a model folder must hold: the layout of Diffusers' pipelines (stabilityai/stable-diffusion-2-base).
CONFIG_FILES = ('unet/config.json', 'vae/config.json', 'text_encoder/config.json',
                'scheduler/scheduler_config.json')
WEIGHT_FILES = {
    'unet': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'vae': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'text_encoder': ('model.safetensors', 'pytorch_model.bin'),
}
# Per-model defaults for flags left unset. sd2-base is the published run: 512px, global batch 2048,
# microbatch 4 per A100-40GB with xFormers. tiny is a CPU smoke run: a few dozen small batches.
PRESETS = {
    'sd2-base': {'image_size': 512, 'batch_size': 2048, 'device_train_microbatch_size': '4',
                 'max_duration': '10ba'},
    'tiny': {'image_size': 64, 'batch_size': 16, 'device_train_microbatch_size': None,
             'max_duration': '40ba'},
}
LATENT_DOWNSAMPLE = 8  # SD's VAE: image pixels per latent pixel along each side
SYNTHETIC_SAMPLES = 100_000  # one synthetic "epoch"; runs are normally bounded in batches instead
# torch.compile options for --compile, as Composer's compile_config: Inductor with its defaults.
COMPILE_CONFIG: dict = {}


class ConfigError(ValueError):
    """A bad flag or model folder: reported as one line naming the problem, exit status 2."""


# ---------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Measure Stable Diffusion 2 training throughput (img/s, FLOP/s, MFU) with Composer. '
        'Flags left unset take the preset of the model: the published run for sd2-base, a CPU smoke run for tiny.')
    model = parser.add_argument_group('model')
    model.add_argument('--model_name', default=None,
                       help=f'built-in config ({", ".join(BUILTIN_MODELS)}), a local folder in the Diffusers '
                       'layout (weights load when present, random init otherwise), or a hub id (needs network). '
                       'Default: sd2-base on a GPU, tiny without one')
    model.add_argument('--prediction_type', choices=['epsilon', 'v_prediction'], default=None,
                       help="training target; default: the model's scheduler config (epsilon for SD2 base)")
    model.add_argument('--attention', choices=['sdpa', 'xformers'], default='sdpa',
                       help='UNet attention backend: PyTorch scaled_dot_product_attention or xFormers (default: %(default)s)')
    data = parser.add_argument_group('data')
    data.add_argument('--use_synth_data', action='store_true', help='train on random images and captions')
    data.add_argument('--remote', default=None, help='streaming dataset location, e.g. s3://bucket/laion/mds '
                      '(S3-compatible servers: set S3_ENDPOINT_URL); write one with convert.py')
    data.add_argument('--local', default=None, help='a local MDS dataset folder, or with --remote its cache folder '
                      '(default: a fresh temporary folder per run). Without --remote, --local and --use_synth_data: '
                      'a generated sample dataset in data/sample-mds')
    data.add_argument('--precomputed_latents', action='store_true',
                      help="train the UNet alone on precompute.py's output (--remote/--local), or with --use_synth_data "
                      'on random latents and text embeddings: no VAE or text encoder in memory or in the step')
    data.add_argument('--tokenizer', default=None, help='local tokenizer folder (Transformers layout) for the captions '
                      "(default: SD2's CLIP BPE, ids as OpenCLIP's, padded with 0)")
    data.add_argument('--image_size', type=int, default=None, help='training resolution in pixels (preset: 512; tiny: 64)')
    data.add_argument('--num_workers', type=int, default=None,
                      help='dataloader workers per device (default: 8 on a GPU, 0 on CPU)')
    train = parser.add_argument_group('training')
    train.add_argument('--batch_size', type=int, default=None,
                       help='global batch size over all devices (preset: 2048, the published run; tiny: 16)')
    train.add_argument('--device_train_microbatch_size', default=None,
                       help="samples per forward/backward on each device, or 'auto' (GPU only); the device "
                       'batch is accumulated over microbatches (preset: 4 for sd2-base, whole device batch for tiny)')
    train.add_argument('--max_duration', default=None,
                       help="run length as a Composer time string: '10ba' batches, '1ep', '20000sp' samples (preset: 10ba; tiny: 40ba)")
    train.add_argument('--precision', choices=['fp32', 'amp_bf16', 'amp_fp16'], default=None,
                       help='default: amp_bf16 on a GPU, fp32 on CPU')
    train.add_argument('--fsdp', choices=['none', 'shard_grad_op', 'full_shard'], default='none',
                       help='shard the UNet with FSDP through Composer: shard_grad_op shards gradients and optimizer '
                       'state, full_shard the weights too; none replicates it with DDP (default: %(default)s)')
    train.add_argument('--fsdp_state_dict_type', choices=['full', 'sharded'], default='full',
                       help='checkpoints under --fsdp: full is one file gathered to and written by rank 0; sharded '
                       'has each rank write its own shards into a folder (torch.distributed.checkpoint) '
                       '(default: %(default)s)')
    train.add_argument('--use_ema', action='store_true', help='keep an exponential moving average of the UNet')
    train.add_argument('--ema_half_life', default='1000ba',
                       help="EMA half life as a Composer time string (Composer's default, as in the published run)")
    train.add_argument('--ema_offload', action='store_true',
                       help='keep the EMA in host memory, updated off the training thread: no GPU memory')
    train.add_argument('--export_ema_unet', default=None, metavar='DIR',
                       help='after training, save the EMA UNet here (Diffusers save_pretrained layout)')
    train.add_argument('--seed', type=int, default=17, help='seeds the random init and the data (default: %(default)s)')
    speed = parser.add_argument_group('speed paths (off by default, pinned memory aside: none has been measured on a '
                                      'GPU for this repo yet; benchmarks/speed_sweep.py measures them)')
    speed.add_argument('--channels_last', action='store_true',
                       help="convolutions in channels-last memory layout (Composer's ChannelsLast algorithm)")
    speed.add_argument('--compile', action='store_true', help='torch.compile the model through Composer')
    speed.add_argument('--fused_adamw', action='store_true', help="PyTorch's fused AdamW kernel (same update)")
    speed.add_argument('--low_precision_norm', action='store_true',
                       help="GroupNorm and LayerNorm in the autocast precision (Composer's LowPrecisionGroupNorm "
                       'and LowPrecisionLayerNorm); needs --precision amp_bf16 or amp_fp16')
    speed.add_argument('--encoders_bf16', action='store_true',
                       help='keep the frozen VAE and text encoder weights in bf16 (half the memory and weight reads)')
    speed.add_argument('--pin_memory', action=argparse.BooleanOptionalAction, default=None,
                       help='page-locked host memory for batches, so their copy to the GPU can overlap compute '
                       '(default: on with a GPU; --no-pin_memory turns it off)')
    ckpt = parser.add_argument_group('checkpoints')
    ckpt.add_argument('--run_name', default=None, help='run name (needed with --autoresume)')
    ckpt.add_argument('--save_folder', default=None, help='where Composer writes checkpoints (none by default)')
    ckpt.add_argument('--save_interval', default='1ep', help='checkpoint every this Composer time string (default: %(default)s)')
    ckpt.add_argument('--autoresume', action='store_true', help='resume from the latest checkpoint in --save_folder')
    log = parser.add_argument_group('logging')
    log.add_argument('--wandb_name', default=None, help='W&B run name')
    log.add_argument('--wandb_project', default=None, help='log to this W&B project (WANDB_MODE=offline works)')
    log.add_argument('--results_json', default=None,
                     help='write the measured throughput, config, versions and device here at the end')
    log.add_argument('--profile', default=None, metavar='DIR',
                     help="record a PyTorch profiler trace of the last batch (Composer's profiler) into DIR, one "
                     'Chrome trace per rank; benchmarks/profile_summary.py says where its time went. The profiled '
                     'batch runs slower: measure throughput without it')
    return parser.parse_args(argv)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset flags from the model's preset and the device, and check every flag before any work."""
    has_gpu = torch.cuda.is_available()
    if args.model_name is None:
        args.model_name = 'sd2-base' if has_gpu else 'tiny'
        announce(f'--model_name not given: using {args.model_name!r} '
                 f'({"a GPU is present" if has_gpu else "no GPU found; pass --model_name sd2-base for the real model"})')
    preset = PRESETS.get(args.model_name, PRESETS['sd2-base'])
    for flag, value in preset.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.num_workers is None:
        args.num_workers = 8 if has_gpu else 0
    if args.precision is None:
        args.precision = 'amp_bf16' if has_gpu else 'fp32'
    if args.pin_memory is None:
        args.pin_memory = has_gpu

    if args.image_size <= 0 or args.image_size % LATENT_DOWNSAMPLE:
        raise ConfigError(f'--image_size {args.image_size}: must be a positive multiple of {LATENT_DOWNSAMPLE} '
                          f'(the VAE downsamples {LATENT_DOWNSAMPLE}x)')
    if args.batch_size <= 0:
        raise ConfigError(f'--batch_size {args.batch_size}: must be positive')
    if args.num_workers < 0:
        raise ConfigError(f'--num_workers {args.num_workers}: must be 0 or more')
    world_size = dist.get_world_size()
    if args.batch_size % world_size:
        raise ConfigError(f'--batch_size {args.batch_size} is not divisible by the world size {world_size}: '
                          f'pass a multiple of {world_size}')
    args.device_batch_size = args.batch_size // world_size
    microbatch = args.device_train_microbatch_size
    if microbatch is None:
        args.device_train_microbatch_size = args.device_batch_size
    elif str(microbatch) == 'auto':
        if not has_gpu:
            raise ConfigError("--device_train_microbatch_size auto needs a GPU (Composer searches for the largest "
                              'microbatch that fits in GPU memory); on CPU pass a number that divides the device batch')
    else:
        try:
            microbatch = int(microbatch)
        except ValueError:
            raise ConfigError(f"--device_train_microbatch_size {microbatch!r}: pass a positive integer or 'auto'")
        if microbatch <= 0 or args.device_batch_size % microbatch:
            raise ConfigError(
                f'--batch_size {args.batch_size} over {world_size} device(s) gives {args.device_batch_size} samples '
                f'per device, which is not divisible by --device_train_microbatch_size {microbatch}: choose a '
                f'microbatch that divides {args.device_batch_size}, or a batch size divisible by '
                f'{world_size} x {microbatch} = {world_size * microbatch}')
        args.device_train_microbatch_size = microbatch

    if not has_gpu and args.precision != 'fp32':
        raise ConfigError(f'--precision {args.precision} needs a GPU; on CPU Composer trains in fp32 only: '
                          'pass --precision fp32 or leave it unset')
    if has_gpu and args.precision == 'amp_bf16' and not torch.cuda.is_bf16_supported():
        raise ConfigError(f'--precision amp_bf16: {torch.cuda.get_device_name()} has no bf16 support; '
                          'pass --precision amp_fp16')
    if args.attention == 'xformers':
        try:
            import xformers  # noqa: F401
        except ImportError:
            raise ConfigError('--attention xformers: xformers is not installed; install it with '
                              "pip install 'xformers==0.0.30' (Linux x86_64 with CUDA) or use --attention sdpa")
        if not has_gpu:
            raise ConfigError('--attention xformers: xFormers attention runs on CUDA GPUs only; '
                              'use --attention sdpa on this machine')
    if (args.ema_offload or args.export_ema_unet) and not args.use_ema:
        raise ConfigError('--ema_offload and --export_ema_unet need --use_ema')
    if args.use_ema:
        try:
            EMA(half_life=args.ema_half_life)
        except ValueError as error:
            raise ConfigError(f'--ema_half_life: {error}')
    if args.use_synth_data and (args.remote or args.local):
        raise ConfigError('--use_synth_data trains on random tensors: leave out --remote/--local, or drop --use_synth_data')
    if args.precomputed_latents and not (args.use_synth_data or args.remote or args.local):
        raise ConfigError('--precomputed_latents needs a dataset written by precompute.py (--local DIR or --remote URL; '
                          'e.g. python precompute.py --out data/sample-latents, then --local data/sample-latents), '
                          'or --use_synth_data for random latents')
    if args.precomputed_latents and args.encoders_bf16:
        raise ConfigError('--encoders_bf16: with --precomputed_latents there is no VAE or text encoder to keep in bf16')
    if args.precomputed_latents and args.tokenizer:
        raise ConfigError('--tokenizer: precomputed captions are already embeddings (choose the tokenizer in precompute.py)')
    if args.compile and not has_gpu:
        # Measured: the forward pass compiles, then Inductor's C++ codegen (outer-loop fusion with a local buffer,
        # which GPUs' Triton codegen does not use) fails on the backward graph. Dynamo's tracing is tested on CPU.
        raise ConfigError("--compile: torch 2.7.0's Inductor fails compiling this model's backward pass for CPU "
                          '(KeyError in its C++ code generation, after minutes of compiling); use --compile on a GPU')
    if args.pin_memory and not has_gpu:
        raise ConfigError('--pin_memory pins batches for copies to a GPU, and there is none: leave it out')
    if args.low_precision_norm and args.precision == 'fp32':
        raise ConfigError('--low_precision_norm runs the norms in the autocast precision: it needs --precision '
                          'amp_bf16 or amp_fp16 (a GPU)')
    args.sample_data = not (args.use_synth_data or args.remote or args.local)
    if args.sample_data:
        args.local = str(SAMPLE_DATASET)
        announce(f'no --remote/--local given: training on the sample dataset {args.local} ({SAMPLE_SIZE} generated '
                 'JPEGs with captions, built on first use); --use_synth_data trains on random tensors as published')
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise ConfigError(f'--tokenizer {args.tokenizer}: no such folder')
    if args.fsdp != 'none' and not has_gpu:
        raise ConfigError(f'--fsdp {args.fsdp}: Composer shards with FSDP on CUDA GPUs only; on CPU leave '
                          '--fsdp none (each rank holds a full replica, synchronized by DDP over gloo)')
    if args.fsdp_state_dict_type != 'full' and args.fsdp == 'none':
        raise ConfigError(f'--fsdp_state_dict_type {args.fsdp_state_dict_type}: applies to --fsdp checkpoints only; '
                          'without --fsdp rank 0 writes one file')
    if args.profile:
        refuse_used_output_folder('--profile', args.profile, 'traces are never overwritten')
    if args.export_ema_unet:  # checked now, not after hours of training; never over a model's weights
        refuse_used_output_folder('--export_ema_unet', args.export_ema_unet, 'an export never overwrites weights')
    if args.autoresume and not (args.save_folder and args.run_name):
        raise ConfigError('--autoresume needs --save_folder and --run_name (Composer finds the checkpoint by both)')
    if args.save_folder and not args.autoresume and '://' not in args.save_folder:
        # Composer refuses too, with a traceback that does not say how to continue the earlier run.
        refuse_used_output_folder('--save_folder', args.save_folder, 'checkpoints are never overwritten; or pass '
                                  '--autoresume with the earlier run\'s --run_name to continue it')
    try:
        duration = Time.from_timestring(args.max_duration)
    except ValueError as error:
        raise ConfigError(f"--max_duration {args.max_duration!r}: {error} (examples: '10ba', '1ep', '20000sp')")
    args.num_batches = num_batches(duration, args.batch_size)
    if args.profile and args.num_batches < 2:
        raise ConfigError(f'--profile: the profiler warms up on the batch before the one it records; run at least '
                          f'2 batches (--max_duration {args.max_duration} is {args.num_batches})')
    return args


def refuse_used_output_folder(flag: str, folder: str, why: str) -> None:
    path = Path(folder)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        problem = 'is a file' if path.is_file() else 'is not empty'
        raise ConfigError(f'{flag} {folder}: {problem}; give a new folder ({why})')


def num_batches(duration: Time, batch_size: int) -> int:
    if duration.unit == TimeUnit.BATCH:
        return duration.value
    if duration.unit == TimeUnit.SAMPLE:
        return duration.value // batch_size
    if duration.unit == TimeUnit.EPOCH:
        return duration.value * (SYNTHETIC_SAMPLES // batch_size)
    raise ConfigError(f"--max_duration {duration}: use batches, samples or epochs ('10ba', '20000sp', '1ep')")


def announce(message: str) -> None:
    if dist.get_global_rank() == 0:
        print(message, flush=True)


# -------------------------------------------------------------------------------------------- model

class StableDiffusion(ComposerModel):
    """Trains the UNet to predict the noise added to VAE latents, conditioned on CLIP text embeddings.

    The VAE and text encoder are frozen: in eval mode, without gradients, outside the optimizer, and run
    online every step, as in the published benchmark. Without them (vae=None, text_encoder=None) the model
    trains from precomputed batches: 'latent_mean', 'latent_logvar' and 'text_embedding', as precompute.py
    writes them. A batch may carry 'noise', 'timesteps' and 'latent_noise' (the Gaussian draw that samples
    the latent distribution) to make a step deterministic; otherwise each is drawn at random.
    """

    def __init__(self, unet: UNet2DConditionModel, vae: AutoencoderKL | None, text_encoder: CLIPTextModel | None,
                 noise_scheduler: DDPMScheduler, latent_scale: float | None = None):
        super().__init__()
        self.unet = unet
        self.vae = None if vae is None else vae.requires_grad_(False).eval()
        self.text_encoder = None if text_encoder is None else text_encoder.requires_grad_(False).eval()
        self.noise_scheduler = noise_scheduler
        # 0.18215 for SD2: scales latents to unit variance (the VAE config's scaling_factor).
        self.latent_scale = vae.config.scaling_factor if vae is not None else latent_scale
        if self.latent_scale is None:
            raise ValueError('without a VAE, pass latent_scale (the VAE config\'s scaling_factor)')
        self._flops_per_image: dict[tuple, int] = {}

    def train(self, mode: bool = True):
        # Composer calls model.train() every epoch; the frozen encoders must stay in eval mode.
        super().train(mode)
        for encoder in (self.vae, self.text_encoder):
            if encoder is not None:
                encoder.eval()
        return self

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        latents, text_embeddings = self.encode(batch)
        noise = batch.get('noise')
        if noise is None:
            noise = torch.randn_like(latents)
        timesteps = batch.get('timesteps')
        if timesteps is None:  # uniform over all training steps
            timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=latents.device)
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.noise_scheduler.config.prediction_type == 'v_prediction':
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        prediction = self.unet(noisy_latents, timesteps, text_embeddings).sample
        return prediction, target

    @torch.no_grad()
    def encode(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled latents sampled from the VAE's latent distribution, and the text embeddings: computed by
        the frozen encoders, or read from a precomputed batch. Both in fp32, whatever the encoders hold."""
        if 'latent_mean' in batch:
            mean = batch['latent_mean'].float()
            std = torch.exp(0.5 * batch['latent_logvar'].float())  # as Diffusers' DiagonalGaussianDistribution
            text_embeddings = batch['text_embedding'].float()
        else:
            if self.vae is None:
                raise ValueError('this model has no VAE or text encoder (precomputed latents): the batch needs '
                                 "'latent_mean', 'latent_logvar' and 'text_embedding'")
            latent_dist = self.vae.encode(unit_range(batch['image']).to(self.vae.dtype)).latent_dist
            mean, std = latent_dist.mean.float(), latent_dist.std.float()
            text_embeddings = self.text_encoder(batch['input_ids'])[0].float()
        latent_noise = batch.get('latent_noise')
        if latent_noise is None:
            latent_noise = torch.randn_like(mean)
        return (mean + std * latent_noise) * self.latent_scale, text_embeddings

    def loss(self, outputs, batch) -> torch.Tensor:
        prediction, target = outputs
        return F.mse_loss(prediction.float(), target.float())

    def flops_per_batch(self, batch: dict) -> int:
        """Training FLOPs of this batch, for Composer's SpeedMonitor (FLOP/s and MFU)."""
        if 'latent_mean' in batch:
            latents = batch['latent_mean']
            return latents.shape[0] * self.flops_per_image(LATENT_DOWNSAMPLE * latents.shape[-2],
                                                           LATENT_DOWNSAMPLE * latents.shape[-1],
                                                           batch['text_embedding'].shape[-2])
        images = batch['image']
        return images.shape[0] * self.flops_per_image(images.shape[-2], images.shape[-1],
                                                      batch['input_ids'].shape[-1])

    def flops_per_image(self, height: int, width: int, caption_length: int = CAPTION_LENGTH) -> int:
        key = (height, width, caption_length)
        if key not in self._flops_per_image:
            if self.vae is None:  # precomputed: the UNet alone
                parts = {'unet': count_unet_forward_flops(self.unet.config, height // LATENT_DOWNSAMPLE,
                                                          width // LATENT_DOWNSAMPLE, caption_length)}
            else:
                parts = count_forward_flops(self.unet.config, self.vae.config, self.text_encoder.config, *key)
            # Backward costs twice the forward (gradients of activations and of weights): UNet x3.
            # The frozen encoders run forward only.
            self._flops_per_image[key] = 3 * parts['unet'] + parts.get('vae_encoder', 0) + parts.get('text_encoder', 0)
        return self._flops_per_image[key]


def count_forward_flops(unet_config, vae_config, text_config, height: int, width: int,
                        caption_length: int) -> dict[str, int]:
    """Forward FLOPs per image of each part: matmuls and convolutions, attention included.

    Counted by PyTorch's FlopCounterMode on meta-device copies (no memory, no compute, any config and
    size) with the math attention kernel: the fused CPU flash-attention kernel is invisible to the counter.
    """
    counts = {}
    with torch.device('meta'), sdpa_kernel(SDPBackend.MATH):
        vae = AutoencoderKL.from_config(vae_config)
        text_encoder = CLIPTextModel(text_config)
        with FlopCounterMode(display=False) as counter:
            latents = vae.encode(torch.empty(1, vae_config.in_channels, height, width)).latent_dist.mean
        counts['vae_encoder'] = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            text_encoder(torch.zeros(1, caption_length, dtype=torch.long))
        counts['text_encoder'] = counter.get_total_flops()
    counts['unet'] = count_unet_forward_flops(unet_config, latents.shape[-2], latents.shape[-1], caption_length)
    return counts


def count_unet_forward_flops(unet_config, latent_height: int, latent_width: int, caption_length: int) -> int:
    """Forward FLOPs per sample of the UNet alone at a latent size, counted as in count_forward_flops."""
    with torch.device('meta'), sdpa_kernel(SDPBackend.MATH):
        unet = UNet2DConditionModel.from_config(unet_config)
        latents = torch.empty(1, unet_config.in_channels, latent_height, latent_width)
        text_embeddings = torch.empty(1, caption_length, unet_config.cross_attention_dim)
        with FlopCounterMode(display=False) as counter:
            unet(latents, torch.tensor([500]), text_embeddings)
    return counter.get_total_flops()


def resolve_model_dir(model_name: str) -> Path:
    """A built-in config, a local folder, or (only when asked for) a hub id downloaded to the HF cache."""
    if model_name in BUILTIN_MODELS:
        return CONFIGS_DIR / model_name
    path = Path(model_name).expanduser()
    if not path.is_dir():
        looks_like_hub_id = model_name.count('/') == 1 and not model_name.startswith(('.', '/', '~'))
        if not looks_like_hub_id:
            raise ConfigError(f'--model_name {model_name!r}: not a built-in model ({", ".join(BUILTIN_MODELS)}) '
                              'and no such folder')
        if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', '', 'false'):
            raise ConfigError(f'--model_name {model_name!r}: looks like a hub id, but HF_HUB_OFFLINE is set; '
                              f'use a built-in model ({", ".join(BUILTIN_MODELS)}) or a local folder')
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(model_name, allow_patterns=[
            *CONFIG_FILES, *(f'{part}/{name}' for part, names in WEIGHT_FILES.items() for name in names[:1])]))
    missing = [name for name in CONFIG_FILES if not (path / name).is_file()]
    if missing:
        raise ConfigError(f'--model_name {model_name!r}: missing config file(s) {", ".join(missing)} in {path} '
                          f'(expected the Diffusers layout: {", ".join(CONFIG_FILES)})')
    return path


def has_weights(model_dir: Path, part: str) -> bool:
    return any((model_dir / part / name).is_file() for name in WEIGHT_FILES[part])


MODEL_PARTS = {'unet': UNet2DConditionModel, 'vae': AutoencoderKL, 'text_encoder': CLIPTextModel}


def build_part(model_dir: Path, part: str,
               init_device: torch.device | str | None = None) -> tuple[torch.nn.Module, bool]:
    """One part of a model folder ('unet', 'vae' or 'text_encoder') and whether its weights were loaded: they load
    (on the CPU) where the folder has them, otherwise the part is randomly initialized from its config on
    init_device (default: torch's default device, the CPU unless a caller set another)."""
    model_class = MODEL_PARTS[part]
    if has_weights(model_dir, part):
        return model_class.from_pretrained(model_dir, subfolder=part), True
    # SD2 base's 1.3B parameters take about 20 s of CPU time and 5 GB of host memory per rank to initialize
    # (measured on 2 cores); built on the GPU the Trainer would move them to anyway, well under a second.
    with contextlib.nullcontext() if init_device is None else torch.device(init_device):
        if part == 'text_encoder':  # Transformers' models take a config object
            return model_class(CLIPTextConfig.from_pretrained(model_dir, subfolder=part)), False
        return model_class.from_config(model_class.load_config(model_dir, subfolder=part)), False


def build_encoders(model_dir: Path, encoders_bf16: bool = False,
                   init_device: torch.device | str | None = None) -> tuple[AutoencoderKL, CLIPTextModel, list[str]]:
    """The VAE and text encoder of a model folder, and the names of those whose weights were loaded."""
    vae, vae_loaded = build_part(model_dir, 'vae', init_device)
    text_encoder, text_encoder_loaded = build_part(model_dir, 'text_encoder', init_device)
    if encoders_bf16:
        vae, text_encoder = vae.to(torch.bfloat16), text_encoder.to(torch.bfloat16)
    return vae, text_encoder, ['vae'] * vae_loaded + ['text_encoder'] * text_encoder_loaded


def build_model(model_name: str, prediction_type: str | None = None, attention: str = 'sdpa',
                precomputed: bool = False, encoders_bf16: bool = False,
                init_device: torch.device | str | None = None) -> StableDiffusion:
    """The model of a built-in name, folder or hub id. precomputed: the UNet alone (the batches carry the
    encoders' outputs); encoders_bf16: the frozen VAE and text encoder weights in bf16; init_device: where the
    parts without weights are randomly initialized (see build_part)."""
    model_dir = resolve_model_dir(model_name)
    unet, unet_loaded = build_part(model_dir, 'unet', init_device)  # first: the same init with or without encoders
    scheduler_config = DDPMScheduler.load_config(model_dir, subfolder='scheduler')
    if prediction_type is not None:
        scheduler_config['prediction_type'] = prediction_type
    noise_scheduler = DDPMScheduler.from_config(scheduler_config)
    if attention == 'xformers':
        unet.enable_xformers_memory_efficient_attention()
    if precomputed:
        announce(f'model {model_name!r} from {model_dir}: UNet only '
                 f'({"weights loaded" if unet_loaded else "random init"}); no VAE or text encoder: the data holds '
                 'their outputs')
        latent_scale = AutoencoderKL.load_config(model_dir, subfolder='vae')['scaling_factor']
        return StableDiffusion(unet, None, None, noise_scheduler, latent_scale)
    vae, text_encoder, encoders_loaded = build_encoders(model_dir, encoders_bf16, init_device)
    loaded = ['unet'] * unet_loaded + encoders_loaded
    announce(f'model {model_name!r} from {model_dir}: weights loaded for {", ".join(loaded) or "nothing"}, '
             'random init for the rest')
    return StableDiffusion(unet, vae, text_encoder, noise_scheduler)


# --------------------------------------------------------------------------------- data and trainer

def build_dataloader(args: argparse.Namespace, model: StableDiffusion) -> DataLoader:
    if not args.use_synth_data:
        return build_streaming_dataloader(args, model)
    if args.precomputed_latents:
        config = model.unet.config
        dataset = SyntheticLatentsDataset(config.in_channels, args.image_size // LATENT_DOWNSAMPLE,
                                          config.cross_attention_dim, num_samples=SYNTHETIC_SAMPLES, seed=args.seed)
    else:
        dataset = SyntheticImageCaptionDataset(args.image_size, num_samples=SYNTHETIC_SAMPLES, seed=args.seed)
    # Composer's sampler gives each rank its own slice of every global batch.
    sampler = dist.get_sampler(dataset, shuffle=False, drop_last=True)
    return DataLoader(dataset, batch_size=args.device_batch_size, sampler=sampler, drop_last=True,
                      num_workers=args.num_workers, pin_memory=args.pin_memory,
                      persistent_workers=args.num_workers > 0)


def build_streaming_dataloader(args: argparse.Namespace, model: StableDiffusion) -> DataLoader:
    """MDS shards through Streaming, which splits samples over ranks and workers itself (no sampler here) and,
    given the device batch size, lets Composer's checkpoints resume mid-epoch on exactly the remaining samples."""
    duration = Time.from_timestring(args.max_duration)
    epoch_size = None
    if args.sample_data:
        ensure_sample_dataset(Path(args.local))
        # A few hundred images: one epoch spans the whole run (at least one global batch), repeating samples.
        wanted = args.batch_size if duration.unit == TimeUnit.EPOCH else args.batch_size * args.num_batches
        epoch_size = -(-max(wanted, SAMPLE_SIZE) // args.batch_size) * args.batch_size
    try:
        if args.precomputed_latents:
            dataset = PrecomputedLatentsDataset(remote=args.remote, local=args.local, batch_size=args.device_batch_size,
                                                shuffle=True, seed=args.seed)
            check_precomputed_sample(dataset, model, args)
        else:
            dataset = StreamingLAIONDataset(remote=args.remote, local=args.local, image_size=args.image_size,
                                            tokenizer=args.tokenizer, batch_size=args.device_batch_size, shuffle=True,
                                            seed=args.seed, epoch_size=epoch_size)
    except DataError as error:
        raise ConfigError(str(error))
    batches_per_epoch = len(dataset) // args.device_batch_size
    if batches_per_epoch == 0:
        raise ConfigError(f'{args.remote or args.local}: {len(dataset)} samples per device, fewer than one device '
                          f'batch ({args.device_batch_size}): use a larger dataset or a smaller --batch_size')
    if duration.unit == TimeUnit.EPOCH:
        args.num_batches = duration.value * batches_per_epoch
    return DataLoader(dataset, batch_size=args.device_batch_size, drop_last=True, num_workers=args.num_workers,
                      collate_fn=None if args.precomputed_latents else collate, pin_memory=args.pin_memory,
                      persistent_workers=args.num_workers > 0)


def check_precomputed_sample(dataset: PrecomputedLatentsDataset, model: StableDiffusion, args) -> None:
    """The stored shapes must fit this UNet; the image size is the one the data was precomputed at."""
    sample = dataset[0]
    channels, height, width = sample['latent_mean'].shape
    config = model.unet.config
    if channels != config.in_channels or sample['text_embedding'].shape[-1] != config.cross_attention_dim:
        raise DataError(f'{dataset.location}: precomputed latents with {channels} channels and text embeddings of '
                        f"width {sample['text_embedding'].shape[-1]}, but {args.model_name}'s UNet takes "
                        f'{config.in_channels} and {config.cross_attention_dim}: precompute it with the same '
                        '--model_name')
    if height != width:
        raise DataError(f'{dataset.location}: latents of {height}x{width}; square ones expected')
    if height * LATENT_DOWNSAMPLE != args.image_size:
        announce(f'--image_size {args.image_size}: the data was precomputed at {height * LATENT_DOWNSAMPLE}px, '
                 'which is what this run trains at')
        args.image_size = height * LATENT_DOWNSAMPLE


def build_optimizer(args: argparse.Namespace, model: StableDiffusion) -> torch.optim.Optimizer:
    # The published optimizer. fused=True: one kernel for all parameters, the same update.
    return torch.optim.AdamW(model.unet.parameters(), lr=1e-4, weight_decay=1e-3, fused=args.fused_adamw or None)


def mark_fsdp_units(model: StableDiffusion) -> None:
    """Composer wraps each child module of the model (unet, vae, text_encoder) in FSDP, and inside it every
    module marked _fsdp_wrap (a ComposerModel's own fsdp_wrap_fn is never consulted for its children)."""
    unet = model.unet
    for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
        block._fsdp_wrap = True  # one unit per resolution block: full_shard gathers one block's weights at a time
    for encoder in (model.vae, model.text_encoder):
        if encoder is None:
            continue
        # The frozen encoders stay whole on every GPU (1.7 GB in fp32): FSDP gathers weights only in forward(),
        # which encode() never calls, and their weights have no gradients or optimizer state to shard.
        encoder._fsdp_wrap = False
        if torch.cuda.is_available():  # under FSDP the Trainer moves only the modules FSDP wraps
            encoder.to(torch.device('cuda', torch.cuda.current_device()))


def build_trainer(args: argparse.Namespace, model: StableDiffusion, dataloader: DataLoader,
                  callbacks: tuple = ()) -> Trainer:
    optimizer = build_optimizer(args, model)
    if args.fsdp != 'none':
        mark_fsdp_units(model)
    algorithms = [EMA(half_life=args.ema_half_life, offload=args.ema_offload)] if args.use_ema else []
    if args.channels_last:
        algorithms.append(ChannelsLast())
    if args.low_precision_norm:
        algorithms += [LowPrecisionGroupNorm(), LowPrecisionLayerNorm()]
    # Throughput is a rolling mean over this many batches (100 as published, fewer on short runs),
    # so the first batch, which holds one-off setup costs, is never inside a window.
    speed_window = max(1, min(100, args.num_batches // 2))
    loggers = [InMemoryLogger()]
    if args.wandb_project:
        loggers.append(WandBLogger(project=args.wandb_project, name=args.wandb_name))
    return Trainer(
        model=model,
        train_dataloader=dataloader,
        optimizers=optimizer,
        schedulers=ConstantScheduler(),
        max_duration=args.max_duration,
        device_train_microbatch_size=args.device_train_microbatch_size,
        precision=args.precision,
        callbacks=[SpeedMonitor(window_size=speed_window), BadSampleCounter(), *callbacks],
        loggers=loggers,
        progress_bar=True,
        seed=args.seed,
        run_name=args.run_name,
        save_folder=args.save_folder,
        save_interval=args.save_interval,
        autoresume=args.autoresume,
        algorithms=algorithms,
        compile_config=COMPILE_CONFIG if args.compile else None,
        profiler=None if args.profile is None else build_profiler(args),
        parallelism_config=None if args.fsdp == 'none' else {
            'fsdp': {'sharding_strategy': args.fsdp.upper(), 'use_orig_params': True,
                     'state_dict_type': args.fsdp_state_dict_type}},
    )


def build_profiler(args: argparse.Namespace) -> Profiler:
    """PyTorch's profiler on the last batch (the one before it warms the profiler up), traces kept locally."""
    return Profiler(
        schedule=cyclic_schedule(skip_first=args.num_batches - 2, wait=0, warmup=1, active=1, repeat=1),
        trace_handlers=[],
        sys_prof_cpu=False,
        torch_prof_folder=args.profile,
        torch_prof_remote_file_name=None,
        torch_prof_memory_remote_file_name=None,
        torch_prof_with_flops=False,  # FLOP counting adds CPU time to every op; SpeedMonitor counts FLOPs
    )


# ------------------------------------------------------------------------------------------ results

def summarize(trainer: Trainer, args: argparse.Namespace) -> dict:
    """Median of the rolling-window throughputs SpeedMonitor logged, with what is needed to compare runs."""
    logged = next(logger for logger in trainer.logger.destinations if isinstance(logger, InMemoryLogger)).data

    def median(metric):
        values = [float(value) for _, value in logged.get(metric, [])]
        return statistics.median(values) if values else None

    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    has_gpu = torch.cuda.is_available()
    mfu = median('throughput/device/mfu')
    return {
        'schema': 'sd2-benchmark-results/1',
        'img_per_sec': median('throughput/samples_per_sec'),
        'img_per_sec_per_device': median('throughput/device/samples_per_sec'),
        'flops_per_image': model.flops_per_image(args.image_size, args.image_size),
        'flops_per_sec': median('throughput/flops_per_sec'),
        'mfu': mfu,
        'throughput_windows': len(logged.get('throughput/samples_per_sec', [])),
        'peak_gpu_memory_gb': torch.cuda.max_memory_allocated() / 1e9 if has_gpu else None,
        'bad_samples': int(logged['data/bad_samples'][-1][1]) if logged.get('data/bad_samples') else 0,
        'device_type': 'gpu' if has_gpu else 'cpu',
        'device_name': torch.cuda.get_device_name() if has_gpu else cpu_name(),
        'num_devices': dist.get_world_size(),
        'world_size': dist.get_world_size(),
        'image_size': args.image_size,
        'model_name': args.model_name,
        'config': vars(args),
        'versions': package_versions(),
        'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    }


def cpu_name() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, str | None]:
    versions = {'python': platform.python_version(), 'cuda': torch.version.cuda}
    for package in ('torch', 'mosaicml', 'mosaicml-streaming', 'diffusers', 'transformers', 'xformers'):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def print_summary(results: dict) -> None:
    if results['img_per_sec'] is None:
        print('throughput: the run was too short for a throughput window (needs at least 2 batches)')
        return
    line = (f"throughput: {results['img_per_sec']:.2f} img/s ({results['img_per_sec_per_device']:.2f} per device, "
            f"{results['num_devices']} x {results['device_name']})")
    if results['flops_per_sec']:
        line += f", {results['flops_per_sec'] / 1e12:.3g} TFLOP/s"
    if results['mfu']:
        line += f", MFU {100 * results['mfu']:.1f}%"
    print(line + f"; median of {results['throughput_windows']} rolling windows", flush=True)
    if results['bad_samples']:
        print(f"data: {results['bad_samples']} bad sample(s) read and replaced by the next good ones "
              '(each warned about once)', flush=True)


# --------------------------------------------------------------------------------------------- main

def main(args: argparse.Namespace, callbacks: tuple = ()) -> Trainer:
    """Runs the benchmark; `callbacks` lets tests and scripts watch the run."""
    args = resolve_args(args)
    microbatch = args.device_train_microbatch_size
    accumulation = '?' if microbatch == 'auto' else args.device_batch_size // microbatch
    announce(f'config: {json.dumps(vars(args), sort_keys=True)}')
    announce(f'batch: global {args.batch_size} = {dist.get_world_size()} device(s) x microbatch {microbatch} '
             f'x {accumulation} accumulation step(s)')
    # One process group for the whole run, made now through Composer (the Trainer then reuses it). Otherwise
    # Streaming makes and destroys one of its own twice (clean_stale_shared_memory, StreamingDataset) before
    # the Trainer makes its own, each time on MASTER_PORT, and a rank that reaches the next one while rank 0
    # still serves the last joins the old one and waits forever (seen: two CPU ranks on a fresh clone).
    dist.initialize_dist(get_device(None))
    reproducibility.seed_all(args.seed)  # same random init on every run and rank
    # On a GPU the random init runs there: Composer set this rank's device in initialize_dist.
    init_device = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else None
    model = build_model(args.model_name, args.prediction_type, args.attention, args.precomputed_latents,
                        args.encoders_bf16, init_device)
    if not args.use_synth_data:
        clean_stale_shared_memory()  # Streaming's shared memory left by a killed run would block this one
    trainer = build_trainer(args, model, build_dataloader(args, model), callbacks)
    trainer.fit()
    if dist.get_global_rank() == 0:
        results = summarize(trainer, args)
        print_summary(results)
        if args.results_json:
            Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.results_json).write_text(json.dumps(results, indent=2) + '\n')
            print(f'results written to {args.results_json}')
    if args.profile:
        traces = sorted(str(path) for path in Path(args.profile).glob('*.json'))
        announce(f'profiler traces: {", ".join(traces)} (python benchmarks/profile_summary.py {traces[0]})')
    if args.export_ema_unet:
        export_ema_unet(trainer, args.export_ema_unet)
        announce(f'EMA UNet saved to {args.export_ema_unet}')
    return trainer


if __name__ == '__main__':
    try:
        main(parse_args())
    except ConfigError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
    except DataError as error:  # e.g. a dataset of mostly bad samples, found while training
        # Raised in a dataloader worker, the message carries the worker's traceback: its last line is the reason.
        print(f"error: {str(error).strip().splitlines()[-1].removeprefix('data.DataError: ')}", file=sys.stderr)
        sys.exit(1)
