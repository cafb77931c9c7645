"""What a run is: benchmark.py's flags (`parse_args`), the named presets, the model folders, and
`resolve_config`, which turns parsed flags into one frozen `RunConfig`.

Every flag is checked here, before anything is built, and every value derived from the flags, the device
and the dataset is settled here (device batch, microbatch, number of batches, the image size of
precomputed data, ...), so that the builders (model.py, training.py) only read the configuration.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch
from composer.core import Time, TimeUnit
from composer.utils import dist

import arguments
from convert import (
    SAMPLE_DATASET,
    SAMPLE_SIZE,
    SAMPLE_VALIDATION_DATASET,
    SAMPLE_VALIDATION_SEED,
    SAMPLE_VALIDATION_SIZE,
    ensure_sample_dataset,
)
from data import CaptionInputs, DataError, DatasetDescription, describe_dataset
from ema import EMA
from evaluation import SAMPLE_PROMPTS
from tokenizer import CaptionTokenizer, caption_pad_ids

CONFIGS_DIR = Path(__file__).resolve().parent / 'configs'
BUILTIN_MODELS = sorted(path.name for path in CONFIGS_DIR.iterdir() if path.is_dir())
# Files a model folder must hold: the layout of Diffusers' pipelines (stabilityai/stable-diffusion-2-base), and
# the second text encoder's that SDXL's adds (stabilityai/stable-diffusion-xl-base-1.0).
CONFIG_FILES = ('unet/config.json', 'vae/config.json', 'text_encoder/config.json', 'scheduler/scheduler_config.json')
SECOND_ENCODER_CONFIG = 'text_encoder_2/config.json'
# Weight files of each part, as Diffusers and Transformers save them; a part without them is randomly initialized.
WEIGHT_FILES = {
    'unet': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'vae': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'text_encoder': ('model.safetensors', 'pytorch_model.bin'),
    'text_encoder_2': ('model.safetensors', 'pytorch_model.bin'),
}
LATENT_DOWNSAMPLE = 8  # SD's VAE: image pixels per latent pixel along each side
# The values SDXL's UNet embeds beside the pooled text ('time_ids'): original height and width, crop top and
# left, target height and width.
MICRO_CONDITIONS = 6
SYNTHETIC_SAMPLES = 100_000  # one synthetic "epoch"; runs are normally bounded in batches instead


class ConfigError(ValueError):
    """A bad flag or model folder: reported as one line naming the problem, exit status 2."""


@dataclass(frozen=True)
class Preset:
    """A built-in model's values for the flags a run leaves unset."""

    image_size: int
    batch_size: int  # global, over all devices
    device_train_microbatch_size: int | None  # None: the whole device batch in one forward/backward
    max_duration: str


# The published run: 512px and global batch 2048 (= 8 nodes x 8 A100-40GB x microbatch 4 x 8 accumulation
# steps, or any other split of the same batch), microbatch 4 per A100-40GB with xFormers attention.
SD2_BASE = Preset(image_size=512, batch_size=2048, device_train_microbatch_size=4, max_duration='10ba')
# A CPU smoke run: a few dozen small batches of a model with SD2's structure and tiny widths.
TINY = Preset(image_size=64, batch_size=16, device_train_microbatch_size=None, max_duration='40ba')
# The other models at the resolution and global batch of their public training runs: SD 1.5 and SD 2 768-v
# 2048 (their model cards: 32 x 8 x 2 x 4), SDXL 2048 (its report's pretraining batch) at its final 1024px.
# Microbatches are starting points scaled from SD2's 4 at 512px by activation size, not measured.
PRESETS = {
    'sd2-base': SD2_BASE,
    'sd1.5': SD2_BASE,
    'sd2-768-v': dataclasses.replace(SD2_BASE, image_size=768, device_train_microbatch_size=2),
    'sdxl-base': dataclasses.replace(SD2_BASE, image_size=1024, device_train_microbatch_size=1),
    'tiny': TINY,
    'tiny-sd1.5': TINY,
    'tiny-sd2-768-v': dataclasses.replace(TINY, image_size=96),
    'tiny-sdxl-base': TINY,
}


@dataclass(frozen=True)
class RunConfig:
    """Every flag of benchmark.py with its default settled, and the values derived from them."""

    # model
    model_name: str
    model_dir: str  # the folder the model is built from (a built-in config, or the user's)
    prediction_type: str | None
    attention: str
    # data
    use_synth_data: bool
    remote: str | None
    local: str | None
    sample_data: bool  # no dataset given: the generated sample dataset at `local`
    precomputed_latents: bool
    tokenizer: str | None
    image_size: int  # with precomputed latents: the size the data was precomputed at
    num_workers: int
    # batch and duration
    batch_size: int
    world_size: int
    device_batch_size: int  # batch_size / world_size
    device_train_microbatch_size: int | str  # an int dividing device_batch_size, or 'auto'
    max_duration: str
    num_batches: int  # the run's length in batches, whatever unit max_duration is in
    epoch_size: int | None  # samples per epoch of the sample dataset (None: the whole dataset)
    precision: str
    fsdp: str
    fsdp_state_dict_type: str
    # EMA
    use_ema: bool
    ema_half_life: str
    ema_offload: bool
    export_ema_unet: str | None
    seed: int
    # speed paths
    channels_last: bool
    compile: bool
    fused_adamw: bool
    low_precision_norm: bool
    encoders_bf16: bool
    pin_memory: bool
    # checkpoints and outputs
    run_name: str | None
    save_folder: str | None
    save_interval: str
    autoresume: bool
    wandb_name: str | None
    wandb_project: str | None
    results_json: str | None
    profile: str | None
    # does it learn: validation loss, sample images, pipeline export (evaluation.py, export.py)
    eval_local: str | None  # the held-out split's folder (the sample dataset's own split by default on it)
    eval_remote: str | None
    eval_interval: str | None  # a Composer time string; None: no validation
    sample_interval: str | None  # None: no sample images
    sample_dir: str | None
    sample_prompts: tuple[str, ...]
    sample_scheduler: str
    sample_steps: int
    guidance_scale: float
    export_pipeline: str | None
    # stability options (stability.py), off by default
    grad_clip_norm: float | None
    lr_warmup: str | None
    caption_dropout: float
    # what resolving chose on the user's behalf, printed at start
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {key: value for key, value in dataclasses.asdict(self).items() if key != 'notes'}


# -------------------------------------------------------------------------------------------- flags


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(
        description='Measure Stable Diffusion 2 training throughput (img/s, FLOP/s, MFU) with Composer. '
        'Flags left unset take the preset of the model: the published run for sd2-base, a CPU smoke run for tiny.'
    )
    model = parser.add_argument_group('model')
    model.add_argument(
        '--model_name',
        default=None,
        help=f'built-in config ({", ".join(BUILTIN_MODELS)}), a local folder in the Diffusers '
        'layout (weights load when present, random init otherwise), or a hub id (needs network). '
        'Default: sd2-base on a GPU, tiny without one',
    )
    model.add_argument(
        '--prediction_type',
        choices=['epsilon', 'v_prediction'],
        default=None,
        help="training target; default: the model's scheduler config (epsilon for SD2 base)",
    )
    model.add_argument(
        '--attention',
        choices=['sdpa', 'xformers'],
        default='sdpa',
        help='UNet attention backend: PyTorch scaled_dot_product_attention or xFormers (default: %(default)s)',
    )
    data = parser.add_argument_group('data')
    data.add_argument('--use_synth_data', action='store_true', help='train on random images and captions')
    data.add_argument(
        '--remote',
        default=None,
        help='streaming dataset location, e.g. s3://bucket/laion/mds '
        '(S3-compatible servers: set S3_ENDPOINT_URL); write one with convert.py',
    )
    data.add_argument(
        '--local',
        default=None,
        help='a local MDS dataset folder, or with --remote its cache folder '
        '(default: a fresh temporary folder per run). Without --remote, --local and --use_synth_data: '
        'a generated sample dataset in data/sample-mds',
    )
    data.add_argument(
        '--precomputed_latents',
        action='store_true',
        help="train the UNet alone on precompute.py's output (--remote/--local), or with --use_synth_data "
        'on random latents and text embeddings: no VAE or text encoder in memory or in the step',
    )
    data.add_argument(
        '--tokenizer',
        default=None,
        help='local tokenizer folder (Transformers layout) for the captions '
        "(default: SD2's CLIP BPE, ids as OpenCLIP's, padded with 0)",
    )
    data.add_argument(
        '--image_size', type=int, default=None, help='training resolution in pixels (preset: 512; tiny: 64)'
    )
    data.add_argument(
        '--num_workers', type=int, default=None, help='dataloader workers per device (default: 8 on a GPU, 0 on CPU)'
    )
    train = parser.add_argument_group('training')
    train.add_argument(
        '--batch_size',
        type=int,
        default=None,
        help='global batch size over all devices (preset: 2048, the published run; tiny: 16)',
    )
    train.add_argument(
        '--device_train_microbatch_size',
        default=None,
        help="samples per forward/backward on each device, or 'auto' (GPU only); the device "
        'batch is accumulated over microbatches (preset: 4 for sd2-base, whole device batch for tiny)',
    )
    train.add_argument(
        '--max_duration',
        default=None,
        help="run length as a Composer time string: '10ba' batches, '1ep', '20000sp' samples "
        '(preset: 10ba; tiny: 40ba)',
    )
    train.add_argument(
        '--precision',
        choices=['fp32', 'amp_bf16', 'amp_fp16'],
        default=None,
        help='default: amp_bf16 on a GPU, fp32 on CPU',
    )
    train.add_argument(
        '--fsdp',
        choices=['none', 'shard_grad_op', 'full_shard'],
        default='none',
        help='shard the UNet with FSDP through Composer: shard_grad_op shards gradients and optimizer '
        'state, full_shard the weights too; none replicates it with DDP (default: %(default)s)',
    )
    train.add_argument(
        '--fsdp_state_dict_type',
        choices=['full', 'sharded'],
        default='full',
        help='checkpoints under --fsdp: full is one file gathered to and written by rank 0; sharded '
        'has each rank write its own shards into a folder (torch.distributed.checkpoint) '
        '(default: %(default)s)',
    )
    train.add_argument('--use_ema', action='store_true', help='keep an exponential moving average of the UNet')
    train.add_argument(
        '--ema_half_life',
        default='1000ba',
        help="EMA half life as a Composer time string (Composer's default, as in the published run)",
    )
    train.add_argument(
        '--ema_offload',
        action='store_true',
        help='keep the EMA in host memory, updated off the training thread: no GPU memory',
    )
    train.add_argument(
        '--export_ema_unet',
        default=None,
        metavar='DIR',
        help='after training, save the EMA UNet here (Diffusers save_pretrained layout)',
    )
    train.add_argument('--seed', type=int, default=17, help='seeds the random init and the data (default: %(default)s)')
    speed = parser.add_argument_group(
        'speed paths (off by default, pinned memory aside: none has been measured on a '
        'GPU for this repo yet; benchmarks/speed_sweep.py measures them)'
    )
    speed.add_argument(
        '--channels_last',
        action='store_true',
        help="convolutions in channels-last memory layout (Composer's ChannelsLast algorithm)",
    )
    speed.add_argument('--compile', action='store_true', help='torch.compile the model through Composer')
    speed.add_argument('--fused_adamw', action='store_true', help="PyTorch's fused AdamW kernel (same update)")
    speed.add_argument(
        '--low_precision_norm',
        action='store_true',
        help="GroupNorm and LayerNorm in the autocast precision (Composer's LowPrecisionGroupNorm "
        'and LowPrecisionLayerNorm); needs --precision amp_bf16 or amp_fp16',
    )
    speed.add_argument(
        '--encoders_bf16',
        action='store_true',
        help='keep the frozen VAE and text encoder weights in bf16 (half the memory and weight reads)',
    )
    speed.add_argument(
        '--pin_memory',
        action=argparse.BooleanOptionalAction,
        default=None,
        help='page-locked host memory for batches, so their copy to the GPU can overlap compute '
        '(default: on with a GPU; --no-pin_memory turns it off)',
    )
    ckpt = parser.add_argument_group('checkpoints')
    ckpt.add_argument('--run_name', default=None, help='run name (needed with --autoresume)')
    ckpt.add_argument('--save_folder', default=None, help='where Composer writes checkpoints (none by default)')
    ckpt.add_argument(
        '--save_interval', default='1ep', help='checkpoint every this Composer time string (default: %(default)s)'
    )
    ckpt.add_argument('--autoresume', action='store_true', help='resume from the latest checkpoint in --save_folder')
    log = parser.add_argument_group('logging')
    log.add_argument('--wandb_name', default=None, help='W&B run name')
    log.add_argument('--wandb_project', default=None, help='log to this W&B project (WANDB_MODE=offline works)')
    log.add_argument(
        '--results_json',
        default=None,
        help='write the measured throughput, config, versions and device here at the end',
    )
    log.add_argument(
        '--profile',
        default=None,
        metavar='DIR',
        help="record a PyTorch profiler trace of the last batch (Composer's profiler) into DIR, one "
        'Chrome trace per rank; benchmarks/profile_summary.py says where its time went. The profiled '
        'batch runs slower: measure throughput without it',
    )
    add_quality_flags(parser)
    return parser.parse_args(argv)


def add_quality_flags(parser: argparse.ArgumentParser) -> None:
    """Does it learn (docs/quality.md): validation, samples, export; and the options that keep long runs stable."""
    quality = parser.add_argument_group(
        'validation and samples (time outside the throughput windows: Composer stops its training clock)'
    )
    quality.add_argument(
        '--eval_local', default=None, metavar='DIR', help='a held-out MDS split for the validation loss'
    )
    quality.add_argument(
        '--eval_remote', default=None, metavar='URL', help='a held-out MDS split to copy from a remote (s3://...)'
    )
    quality.add_argument(
        '--eval_interval',
        default=None,
        help="validation loss every this Composer time string ('100ba', '1ep'), at the start and at the end; "
        '0: never. On the sample dataset it validates on its held-out split. Default: at the start and end '
        'with --eval_local/--eval_remote, never otherwise (it costs time, though never measured throughput)',
    )
    quality.add_argument(
        '--sample_interval',
        default=None,
        help='a grid of sample images every this time string, at the start and at the end (default: never)',
    )
    quality.add_argument(
        '--sample_dir', default=None, metavar='DIR', help='where sample grids go (default: results/samples/RUN)'
    )
    quality.add_argument(
        '--sample_prompts', default=None, metavar='FILE', help='prompts for the grid, one a line (default: 4 built in)'
    )
    quality.add_argument('--sample_scheduler', choices=['ddim', 'euler'], default='ddim', help='sampler (%(default)s)')
    quality.add_argument('--sample_steps', type=int, default=25, help='sampling steps (default: %(default)s)')
    quality.add_argument(
        '--guidance_scale', type=float, default=7.5, help='classifier-free guidance scale (default: %(default)s)'
    )
    quality.add_argument(
        '--export_pipeline',
        default=None,
        metavar='DIR',
        help='after training, save a Diffusers StableDiffusionPipeline folder here (the EMA UNet with --use_ema)',
    )
    stability = parser.add_argument_group('stability (off by default: the published run has none)')
    stability.add_argument('--grad_clip_norm', type=float, default=None, help='clip the gradient norm to this')
    stability.add_argument(
        '--lr_warmup', default=None, help="linear learning-rate warmup from 0 over this time string (e.g. '1000ba')"
    )
    stability.add_argument(
        '--caption_dropout',
        type=float,
        default=0.0,
        help='train on the empty caption with this probability, for classifier-free guidance (default: 0)',
    )


# ------------------------------------------------------------------------------------------ resolve


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The frozen configuration of parsed flags; raises ConfigError naming the first bad flag."""
    has_gpu = torch.cuda.is_available()
    draft = argparse.Namespace(**vars(args), notes=[])  # the caller's args stay as they were
    fill_defaults(draft, has_gpu)
    check_batch(draft, has_gpu)
    check_device(draft, has_gpu)
    check_ema(draft)
    check_outputs(draft)
    check_duration(draft)
    check_data(draft)
    check_quality(draft)
    draft.notes = tuple(draft.notes)
    return RunConfig(**vars(draft))


def fill_defaults(draft: argparse.Namespace, has_gpu: bool) -> None:
    if draft.model_name is None:
        draft.model_name = 'sd2-base' if has_gpu else 'tiny'
        why = 'a GPU is present' if has_gpu else 'no GPU found; pass --model_name sd2-base for the real model'
        draft.notes.append(f'--model_name not given: using {draft.model_name!r} ({why})')
    draft.model_dir = str(resolve_model_dir(draft.model_name))
    preset = PRESETS.get(draft.model_name, SD2_BASE)  # a model folder: the published run's values
    for flag, value in dataclasses.asdict(preset).items():
        if getattr(draft, flag) is None:
            setattr(draft, flag, value)
    if draft.num_workers is None:
        draft.num_workers = 8 if has_gpu else 0
    if draft.precision is None:
        draft.precision = 'amp_bf16' if has_gpu else 'fp32'
    if draft.pin_memory is None:
        draft.pin_memory = has_gpu


def check_batch(draft: argparse.Namespace, has_gpu: bool) -> None:
    """Global batch = world size x device batch; device batch = microbatch x accumulation steps."""
    if draft.image_size <= 0 or draft.image_size % LATENT_DOWNSAMPLE:
        raise ConfigError(
            f'--image_size {draft.image_size}: must be a positive multiple of {LATENT_DOWNSAMPLE} '
            f'(the VAE downsamples {LATENT_DOWNSAMPLE}x)'
        )
    if draft.batch_size <= 0:
        raise ConfigError(f'--batch_size {draft.batch_size}: must be positive')
    if draft.num_workers < 0:
        raise ConfigError(f'--num_workers {draft.num_workers}: must be 0 or more')
    draft.world_size = world_size = dist.get_world_size()
    if draft.batch_size % world_size:
        raise ConfigError(
            f'--batch_size {draft.batch_size} is not divisible by the world size {world_size}: '
            f'pass a multiple of {world_size}'
        )
    draft.device_batch_size = device_batch = draft.batch_size // world_size
    microbatch = draft.device_train_microbatch_size
    if microbatch is None:
        draft.device_train_microbatch_size = device_batch
        return
    if str(microbatch) == 'auto':
        if not has_gpu:
            raise ConfigError(
                '--device_train_microbatch_size auto needs a GPU (Composer searches for the largest '
                'microbatch that fits in GPU memory); on CPU pass a number that divides the device batch'
            )
        return
    try:
        microbatch = int(microbatch)
    except ValueError:
        raise ConfigError(f"--device_train_microbatch_size {microbatch!r}: pass a positive integer or 'auto'")
    if microbatch <= 0:
        raise ConfigError(f'--device_train_microbatch_size {microbatch}: must be positive (or auto)')
    if device_batch % microbatch:
        raise ConfigError(
            f'--batch_size {draft.batch_size} over {world_size} device(s) gives {device_batch} samples '
            f'per device, which is not divisible by --device_train_microbatch_size {microbatch}: choose a '
            f'microbatch that divides {device_batch}, or a batch size divisible by '
            f'{world_size} x {microbatch} = {world_size * microbatch}'
        )
    draft.device_train_microbatch_size = microbatch


def check_device(draft: argparse.Namespace, has_gpu: bool) -> None:
    """Flags that need a GPU, or a package, or another flag, on this machine."""
    if not has_gpu and draft.precision != 'fp32':
        raise ConfigError(
            f'--precision {draft.precision} needs a GPU; on CPU Composer trains in fp32 only: '
            'pass --precision fp32 or leave it unset'
        )
    if has_gpu and draft.precision == 'amp_bf16' and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f'--precision amp_bf16: {torch.cuda.get_device_name()} has no bf16 support; pass --precision amp_fp16'
        )
    if draft.attention == 'xformers':
        try:
            import xformers  # noqa: F401
        except ImportError:
            raise ConfigError(
                '--attention xformers: xformers is not installed; install it with '
                "pip install 'xformers==0.0.30' (Linux x86_64 with CUDA) or use --attention sdpa"
            )
        if not has_gpu:
            raise ConfigError(
                '--attention xformers: xFormers attention runs on CUDA GPUs only; use --attention sdpa on this machine'
            )
    if draft.compile and not has_gpu:
        # Measured: the forward pass compiles, then Inductor's C++ codegen (outer-loop fusion with a local buffer,
        # which GPUs' Triton codegen does not use) fails on the backward graph. Dynamo's tracing is tested on CPU.
        raise ConfigError(
            "--compile: torch 2.7.0's Inductor fails compiling this model's backward pass for CPU "
            '(KeyError in its C++ code generation, after minutes of compiling); use --compile on a GPU'
        )
    if draft.pin_memory and not has_gpu:
        raise ConfigError('--pin_memory pins batches for copies to a GPU, and there is none: leave it out')
    if draft.low_precision_norm and draft.precision == 'fp32':
        raise ConfigError(
            '--low_precision_norm runs the norms in the autocast precision: it needs --precision '
            'amp_bf16 or amp_fp16 (a GPU)'
        )
    if draft.fsdp != 'none' and not has_gpu:
        raise ConfigError(
            f'--fsdp {draft.fsdp}: Composer shards with FSDP on CUDA GPUs only; on CPU leave '
            '--fsdp none (each rank holds a full replica, synchronized by DDP over gloo)'
        )
    if draft.fsdp_state_dict_type != 'full' and draft.fsdp == 'none':
        raise ConfigError(
            f'--fsdp_state_dict_type {draft.fsdp_state_dict_type}: applies to --fsdp checkpoints only; '
            'without --fsdp rank 0 writes one file'
        )


def check_ema(draft: argparse.Namespace) -> None:
    if (draft.ema_offload or draft.export_ema_unet) and not draft.use_ema:
        raise ConfigError('--ema_offload and --export_ema_unet need --use_ema')
    if draft.use_ema:
        try:  # the algorithm parses its own half life
            EMA(half_life=draft.ema_half_life)
        except ValueError as error:
            raise ConfigError(f'--ema_half_life: {error}')


def check_outputs(draft: argparse.Namespace) -> None:
    """Output folders are checked now, not after hours of training, and never overwritten."""
    if draft.profile:
        refuse_used_output_folder('--profile', draft.profile, 'traces are never overwritten')
        check_writable_folder('--profile', draft.profile)
    if draft.export_ema_unet:
        refuse_used_output_folder('--export_ema_unet', draft.export_ema_unet, 'an export never overwrites weights')
        check_writable_folder('--export_ema_unet', draft.export_ema_unet)
    if draft.wandb_project and importlib.util.find_spec('wandb') is None:
        raise ConfigError('--wandb_project needs the wandb package: pip install wandb (it leaves torch as it is)')
    if draft.autoresume and not (draft.save_folder and draft.run_name):
        raise ConfigError('--autoresume needs --save_folder and --run_name (Composer finds the checkpoint by both)')
    local_save_folder = draft.save_folder and '://' not in draft.save_folder
    if local_save_folder and Path(draft.save_folder).exists() and not Path(draft.save_folder).is_dir():
        raise ConfigError(f'--save_folder {draft.save_folder}: is a file, not a folder of checkpoints')
    if local_save_folder and not draft.autoresume:
        # Composer refuses too, with a traceback that does not say how to continue the earlier run.
        refuse_used_output_folder(
            '--save_folder',
            draft.save_folder,
            "checkpoints are never overwritten; or pass --autoresume with the earlier run's --run_name to continue it",
        )
    if local_save_folder:  # else trained until the first checkpoint, then stopped by an OSError traceback
        check_writable_folder('--save_folder', draft.save_folder)
    if draft.results_json:
        check_writable_file('--results_json', draft.results_json)


def check_writable_file(flag: str, file: str) -> None:
    """A file that can be written once the run ends: not a folder, under a folder that exists or can be made."""
    path = Path(file)
    if path.is_dir():
        raise ConfigError(f'{flag} {file}: is a folder; give a file name')
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f'{flag} {file}: {parent} is a file, so no folder can be made there')
    check_writable_folder(flag, str(path.parent), given=file)  # permission bits, read-only filesystems, quotas


def check_writable_folder(flag: str, folder: str, given: str | None = None) -> None:
    """The run can write in `folder`, or make it: a scratch folder is made and removed in it, or in its nearest
    existing parent. Tried rather than read from the permission bits, which say nothing to root, and a read-only
    filesystem or a full quota shows only on writing. Nothing is left behind. `given`: the flag's value, if not
    the folder itself (a file in it)."""
    parent = Path(folder)
    while not parent.exists():
        parent = parent.parent
    try:
        shutil.rmtree(tempfile.mkdtemp(dir=parent, prefix='.write-check-'))
    except OSError as error:
        raise ConfigError(f'{flag} {given or folder}: cannot write in {parent} ({error.strerror or error})') from None


def refuse_used_output_folder(flag: str, folder: str, why: str) -> None:
    path = Path(folder)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        problem = 'is a file' if path.is_file() else 'is not empty'
        raise ConfigError(f'{flag} {folder}: {problem}; give a new folder ({why})')


def check_duration(draft: argparse.Namespace) -> None:
    """The run's length in batches (epochs of real data are settled in check_data, which reads the dataset), and
    the checkpoint interval."""
    duration = parse_time('--max_duration', draft.max_duration)
    if duration.unit == TimeUnit.BATCH:
        draft.num_batches = duration.value
    elif duration.unit == TimeUnit.SAMPLE:  # Composer trains until it has seen at least that many
        draft.num_batches = -(-duration.value // draft.batch_size)
    else:
        draft.num_batches = duration.value * (SYNTHETIC_SAMPLES // draft.batch_size)
    parse_time('--save_interval', draft.save_interval)  # Composer would take 0ba and never save
    if draft.profile and draft.num_batches < 2:
        raise ConfigError(
            f'--profile: the profiler warms up on the batch before the one it records; run at least '
            f'2 batches (--max_duration {draft.max_duration} is {draft.num_batches})'
        )


def parse_time(flag: str, text: str) -> Time:
    """A positive Composer time string in batches, samples or epochs."""
    try:
        time = Time.from_timestring(text)
    except (ValueError, TypeError) as error:  # TypeError: a fraction of a unit that counts whole ones ('1.5ep')
        raise ConfigError(f"{flag} {text!r}: {error} (examples: '10ba', '1ep', '20000sp')")
    if time.unit not in (TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.EPOCH):
        raise ConfigError(f"{flag} {text}: use batches, samples or epochs ('10ba', '20000sp', '1ep')")
    if time.value <= 0:
        raise ConfigError(f"{flag} {text}: must be positive (examples: '10ba', '1ep', '20000sp')")
    return time


def check_data(draft: argparse.Namespace) -> None:
    """Which dataset, and what it implies: the sample dataset's epoch, the batches of an epoch of real data,
    and the image size precomputed latents were made at."""
    if draft.use_synth_data and (draft.remote or draft.local):
        raise ConfigError(
            '--use_synth_data trains on random tensors: leave out --remote/--local, or drop --use_synth_data'
        )
    if draft.precomputed_latents and not (draft.use_synth_data or draft.remote or draft.local):
        raise ConfigError(
            '--precomputed_latents needs a dataset written by precompute.py (--local DIR or --remote URL; '
            'e.g. python precompute.py --out data/sample-latents, then --local data/sample-latents), '
            'or --use_synth_data for random latents'
        )
    if draft.precomputed_latents and draft.encoders_bf16:
        raise ConfigError('--encoders_bf16: with --precomputed_latents there is no VAE or text encoder to keep in bf16')
    if draft.precomputed_latents and draft.tokenizer:
        raise ConfigError(
            '--tokenizer: precomputed captions are already embeddings (choose the tokenizer in precompute.py)'
        )
    if draft.tokenizer is not None:
        check_tokenizer(draft.tokenizer)
    draft.sample_data = not (draft.use_synth_data or draft.remote or draft.local)
    draft.epoch_size = None
    if draft.use_synth_data:
        return
    duration = Time.from_timestring(draft.max_duration)
    if draft.sample_data:
        draft.local = str(SAMPLE_DATASET)
        draft.notes.append(
            f'no --remote/--local given: training on the sample dataset {draft.local} ({SAMPLE_SIZE} '
            'generated JPEGs with captions, built on first use); --use_synth_data trains on random '
            'tensors as published'
        )
        ensure_sample_dataset(SAMPLE_DATASET)
        # A few hundred images: one epoch spans the whole run (at least one global batch), repeating samples.
        wanted = draft.batch_size if duration.unit == TimeUnit.EPOCH else draft.batch_size * draft.num_batches
        draft.epoch_size = -(-max(wanted, SAMPLE_SIZE) // draft.batch_size) * draft.batch_size
    try:
        dataset = describe_dataset(draft.remote, draft.local, precomputed=draft.precomputed_latents)
    except DataError as error:
        raise ConfigError(str(error))
    # Streaming gives each rank ceil(epoch / ranks) samples; the loader drops a last partial batch.
    samples_per_device = -(-(draft.epoch_size or dataset.num_samples) // draft.world_size)
    batches_per_epoch = samples_per_device // draft.device_batch_size
    if batches_per_epoch == 0:
        raise ConfigError(
            f'{dataset.location}: {samples_per_device} samples per device, fewer than one device '
            f'batch ({draft.device_batch_size}): use a larger dataset or a smaller --batch_size'
        )
    if duration.unit == TimeUnit.EPOCH:
        draft.num_batches = duration.value * batches_per_epoch
    if draft.precomputed_latents:
        check_precomputed_shapes(draft, dataset)


def check_precomputed_shapes(draft: argparse.Namespace, dataset: DatasetDescription) -> None:
    """The stored shapes must fit this UNet; the image size is the one the data was precomputed at."""
    unet = json.loads((Path(draft.model_dir) / 'unet' / 'config.json').read_text())
    channels, height, width = dataset.latent_shape
    if channels != unet['in_channels'] or dataset.embedding_width != unet['cross_attention_dim']:
        raise ConfigError(
            f'{dataset.location}: precomputed latents with {channels} channels and text embeddings of '
            f"width {dataset.embedding_width}, but {draft.model_name}'s UNet takes "
            f'{unet["in_channels"]} and {unet["cross_attention_dim"]}: precompute it with the same '
            '--model_name'
        )
    pooled = pooled_text_width(unet)
    if pooled != dataset.pooled_width:
        raise ConfigError(
            f'{dataset.location}: '
            + (
                f"no pooled text embedding of width {pooled}, which {draft.model_name}'s UNet (SDXL) takes"
                if dataset.pooled_width is None
                else f"a pooled text embedding (SDXL's), which {draft.model_name}'s UNet does not take"
            )
            + ': precompute it with the same --model_name'
        )
    if height != width:
        raise ConfigError(f'{dataset.location}: latents of {height}x{width}; square ones expected')
    if height * LATENT_DOWNSAMPLE != draft.image_size:
        draft.notes.append(
            f'--image_size {draft.image_size}: the data was precomputed at '
            f'{height * LATENT_DOWNSAMPLE}px, which is what this run trains at'
        )
        draft.image_size = height * LATENT_DOWNSAMPLE


def check_quality(draft: argparse.Namespace) -> None:
    """Validation, samples, export and the stability options (docs/quality.md)."""
    check_validation_split(draft)
    draft.sample_interval = parse_interval('--sample_interval', draft.sample_interval)
    needs_encoders = [flag for flag in ('sample_interval', 'export_pipeline') if getattr(draft, flag)]
    if needs_encoders and (Path(draft.model_dir) / 'text_encoder_2').is_dir():
        raise ConfigError(
            f"--{needs_encoders[0]}: sample images and pipeline exports use Diffusers' StableDiffusionPipeline, "
            f'which takes one text encoder; {draft.model_name} (SDXL) has two. The validation loss '
            '(--eval_interval) works for every model'
        )
    if draft.precomputed_latents and (needs_encoders or draft.caption_dropout):
        flag = f'--{needs_encoders[0]}' if needs_encoders else '--caption_dropout'
        raise ConfigError(
            f'{flag}: with --precomputed_latents the model has no VAE or text encoder (and the data holds text '
            'embeddings, not captions): train on images and captions for it'
        )
    if draft.sample_steps <= 0:
        raise ConfigError(f'--sample_steps {draft.sample_steps}: must be positive')
    if not draft.guidance_scale >= 0:
        raise ConfigError(f'--guidance_scale {draft.guidance_scale}: must be 0 or more (1 or less: no guidance)')
    if draft.sample_prompts is None:
        draft.sample_prompts = SAMPLE_PROMPTS
    else:
        path = Path(draft.sample_prompts)
        if not path.is_file():
            raise ConfigError(f'--sample_prompts {draft.sample_prompts}: no such file (one prompt a line)')
        draft.sample_prompts = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
        if not draft.sample_prompts:
            raise ConfigError(f'--sample_prompts {path}: holds no prompt (one prompt a line)')
    if draft.sample_dir is None and draft.sample_interval:
        draft.sample_dir = str(Path('results', 'samples', draft.run_name or time.strftime('%Y%m%d-%H%M%S')))
    if draft.sample_dir and Path(draft.sample_dir).is_file():
        raise ConfigError(f'--sample_dir {draft.sample_dir}: is a file; give a folder')
    if draft.sample_dir:
        check_writable_folder('--sample_dir', draft.sample_dir)
    if draft.export_pipeline:
        refuse_used_output_folder('--export_pipeline', draft.export_pipeline, 'an export never overwrites weights')
        check_writable_folder('--export_pipeline', draft.export_pipeline)
    if draft.grad_clip_norm is not None and not 0 < draft.grad_clip_norm < float('inf'):
        raise ConfigError(f'--grad_clip_norm {draft.grad_clip_norm}: must be a positive number')
    if draft.lr_warmup is not None:
        parse_time('--lr_warmup', draft.lr_warmup)
    if not 0 <= draft.caption_dropout < 1:
        raise ConfigError(f'--caption_dropout {draft.caption_dropout}: a probability, at least 0 and below 1')


def check_validation_split(draft: argparse.Namespace) -> None:
    """The held-out split: --eval_local/--eval_remote, or with the sample dataset its own held-out split; and
    when the validation loss runs (see --eval_interval)."""
    if draft.eval_local and draft.eval_remote:
        raise ConfigError('--eval_local and --eval_remote: give one (a folder, or a remote copied whole)')
    if draft.eval_remote and not urllib.parse.urlparse(draft.eval_remote).scheme:
        draft.eval_local, draft.eval_remote = draft.eval_remote, None  # a bare folder is read in place
    given = bool(draft.eval_local or draft.eval_remote)
    interval = draft.eval_interval
    if interval is None:  # with a split given, at the start and the end; otherwise never
        interval = f'{draft.num_batches}ba' if given else '0'
    draft.eval_interval = parse_interval('--eval_interval', interval)
    if not draft.eval_interval:
        return
    if not given:
        if not draft.sample_data:
            raise ConfigError(
                '--eval_interval: no held-out split to validate on: pass --eval_local DIR or --eval_remote URL '
                '(an MDS dataset written by convert.py, or by precompute.py with --precomputed_latents)'
            )
        draft.eval_local = str(SAMPLE_VALIDATION_DATASET)
        ensure_sample_dataset(SAMPLE_VALIDATION_DATASET, SAMPLE_VALIDATION_SIZE, SAMPLE_VALIDATION_SEED, broken=False)
        draft.notes.append(
            f"validation loss on the sample dataset's held-out split {draft.eval_local} ({SAMPLE_VALIDATION_SIZE} "
            f'images) every {draft.eval_interval}, at the start and at the end (--eval_interval 0: never)'
        )
    try:
        split = describe_dataset(draft.eval_remote, draft.eval_local, precomputed=draft.precomputed_latents)
    except DataError as error:
        raise ConfigError(f'--eval_{"remote" if draft.eval_remote else "local"}: {error}')
    if split.num_samples == 0:
        raise ConfigError(f'--eval_local/--eval_remote {split.location}: the split holds no samples')
    if split.latent_shape is not None and split.latent_shape[-1] * LATENT_DOWNSAMPLE != draft.image_size:
        raise ConfigError(
            f'{split.location}: validation latents precomputed at {split.latent_shape[-1] * LATENT_DOWNSAMPLE}px, '
            f'but the run trains at {draft.image_size}px: precompute the split at the same size'
        )


def parse_interval(flag: str, text: str | None) -> str | None:
    """An evaluation interval: a positive Composer time string, or None for never ('0' or unset)."""
    if text is None or text.strip() == '0':
        return None
    parse_time(flag, text)
    return text


def resolve_model_dir(model_name: str) -> Path:
    """A built-in config, a local folder, or (only when asked for) a hub id downloaded to the HF cache."""
    if model_name in BUILTIN_MODELS:
        return CONFIGS_DIR / model_name
    path = Path(model_name).expanduser()
    if not path.is_dir():
        looks_like_hub_id = model_name.count('/') == 1 and not model_name.startswith(('.', '/', '~'))
        if not looks_like_hub_id:
            raise ConfigError(
                f'--model_name {model_name!r}: not a built-in model ({", ".join(BUILTIN_MODELS)}) and no such folder'
            )
        if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', '', 'false'):
            raise ConfigError(
                f'--model_name {model_name!r}: looks like a hub id, but HF_HUB_OFFLINE is set; '
                f'use a built-in model ({", ".join(BUILTIN_MODELS)}) or a local folder'
            )
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                model_name,
                allow_patterns=[
                    *CONFIG_FILES,
                    SECOND_ENCODER_CONFIG,
                    *(f'{part}/{name}' for part, names in WEIGHT_FILES.items() for name in names[:1]),
                ],
            )
        )
    missing = [name for name in CONFIG_FILES if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            f'--model_name {model_name!r}: missing config file(s) {", ".join(missing)} in {path} '
            f'(expected the Diffusers layout: {", ".join(CONFIG_FILES)})'
        )
    configs = {}
    for name in (*CONFIG_FILES, SECOND_ENCODER_CONFIG):
        if not (path / name).is_file():
            continue
        try:
            configs[name] = json.loads((path / name).read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise ConfigError(f'--model_name {model_name!r}: {path / name} is not valid JSON ({error})')
    # SDXL's UNet embeds the second encoder's pooled output: one without the other cannot train.
    micro_conditioning = has_micro_conditioning(configs['unet/config.json'])
    if micro_conditioning != (SECOND_ENCODER_CONFIG in configs):
        raise ConfigError(
            f'--model_name {model_name!r}: '
            + (
                "the UNet's addition_embed_type 'text_time' (SDXL) needs a second text encoder: "
                + SECOND_ENCODER_CONFIG
                if micro_conditioning
                else f"{SECOND_ENCODER_CONFIG} is there, but the UNet has no addition_embed_type 'text_time' to use it"
            )
        )
    return path


def has_micro_conditioning(unet_config) -> bool:
    """SDXL's UNet: it embeds the pooled text and the size/crop values beside the timestep."""
    return unet_config.get('addition_embed_type') == 'text_time'


def pooled_text_width(unet_config) -> int | None:
    """The width of the pooled text embedding an SDXL UNet takes (1280), None for other UNets."""
    if not has_micro_conditioning(unet_config):
        return None
    return (
        unet_config['projection_class_embeddings_input_dim'] - MICRO_CONDITIONS * unet_config['addition_time_embed_dim']
    )


def caption_inputs(model_dir: Path) -> CaptionInputs:
    """What the batches of a model folder's model carry beside the image (see data.CaptionInputs)."""
    unet = json.loads((model_dir / 'unet' / 'config.json').read_text())
    return CaptionInputs(caption_pad_ids(model_dir), has_micro_conditioning(unet))


def check_tokenizer(folder: str) -> None:
    """Loads the tokenizer once now, so that a folder without one fails here rather than in every loader worker."""
    if not Path(folder).is_dir():
        raise ConfigError(f'--tokenizer {folder}: no such folder')
    try:
        CaptionTokenizer(folder)('a photo')
    except Exception as error:  # Transformers raises several kinds (OSError, ValueError, TypeError, ...)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f'--tokenizer {folder}: no tokenizer Transformers can load ({reason})')
