"""benchmark.py's flags: the argparse parser and its help. Parsing only: config.py fills the defaults a run leaves
unset, checks every flag and settles what follows from them (config.resolve_config). Nothing heavy is imported here,
so that --help and a mistyped flag answer before torch, Composer and Diffusers load.
"""

import argparse

from guards import arguments
from settings.families import EMBEDDED_GUIDANCE, LOSS_WEIGHTINGS, TIMESTEP_DENSITIES
from settings.model_folder import BUILTIN_MODELS
from settings.presets import SAMPLERS

# Inductor's modes (torch.compile's mode=), passed through Composer's compile_config.
COMPILE_MODES = ('default', 'max-autotune-no-cudagraphs', 'reduce-overhead')


def add_switch(group, flag: str, help: str) -> None:
    """An on/off flag (--flag, --no-flag) whose default, left None here, the run's recipe settles (config.py)."""
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(
        description='What training a text-to-image diffusion model from scratch costs on this machine: trains one '
        '(the Stable Diffusion UNets, Flux.1, SD3.5, PixArt-Sigma, or a tiny CPU twin) with Composer and measures '
        'img/s, FLOP/s and MFU, for report.py to turn into days and dollars. Flags left unset take the preset of the '
        'model: the published 2023 run for sd2-base, a CPU smoke run for tiny.'
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
        choices=['sdpa', 'cudnn', 'xformers'],
        default=None,
        help="attention backend: PyTorch's scaled_dot_product_attention as it chooses (sdpa), SDPA with cuDNN's "
        'fused attention first (cudnn: a GPU, torch 2.6 or newer; the UNets and the transformers), or xFormers '
        '(UNets) (default: sdpa; with --recipe published on a GPU, xformers where it is installed)',
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
        "(default: SD2's CLIP BPE, ids as OpenCLIP's, padded with 0); for a model with a T5 encoder (flux-schnell, "
        "sd3.5-medium, pixart-sigma) T5's tokenizer, which it needs to read captions",
    )
    data.add_argument(
        '--image_size', type=int, default=None, help='training resolution in pixels (preset: 512; tiny: 64)'
    )
    data.add_argument(
        '--num_workers', type=int, default=None, help='dataloader workers per device (default: 8 on a GPU, 0 on CPU)'
    )
    data.add_argument(
        '--cpu_threads',
        type=int,
        default=None,
        help="PyTorch's CPU threads per process (default on a CPU: the cores this process may use, less the loader "
        "workers and the cores busy with other work, or OMP_NUM_THREADS where set; on a GPU: PyTorch's own)",
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
    add_switch(
        train, '--use_ema', 'keep an exponential moving average of the UNet (default: off; on with --recipe published)'
    )
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
        'speed paths (docs/speed.md): on a GPU the fast recipe turns on fused_adamw, low_precision_norm, '
        'encoders_bf16 and pin_memory and plans the microbatch from memory; the published recipe none of them. '
        '--<flag> turns one on, --no-<flag> off'
    )
    speed.add_argument(
        '--recipe',
        dest='run_recipe',
        choices=['fast', 'published'],
        default='fast',
        help="fast: the speed paths on a GPU (default); published: the 2023 run's choices (microbatch 4, fp16 "
        'mixed precision, xFormers attention where installed, EMA, every speed path off), for its Table 1',
    )
    add_switch(
        speed, '--channels_last', "convolutions in channels-last memory layout (Composer's ChannelsLast algorithm)"
    )
    speed.add_argument(
        '--compile',
        nargs='?',
        const='default',
        default=None,
        choices=COMPILE_MODES,
        metavar='MODE',
        help="torch.compile the model through Composer's compile_config, in one of Inductor's modes: default (the "
        'flag alone), max-autotune-no-cudagraphs (kernels tuned at start), reduce-overhead (CUDA graphs of the '
        'compiled forward and backward: one launch each, at static shapes); GPU only',
    )
    speed.add_argument(
        '--activation_checkpointing',
        action='store_true',
        help="recompute each UNet or transformer block's activations in the backward (Diffusers' gradient "
        'checkpointing): about a third more compute, a quarter of the activation memory or less, so larger '
        'microbatches fit (the memory plan counts it)',
    )
    speed.add_argument(
        '--fp8',
        action='store_true',
        help="torchao's float8 training of a diffusion transformer's linear layers (H100, H200 and newer; needs "
        'amp_bf16); the UNets, mostly convolutions, are not converted',
    )
    speed.add_argument(
        '--fused_groupnorm',
        action='store_true',
        help="a UNet's GroupNorm and the SiLU after it as one Triton kernel (fused_groupnorm.py), forward and "
        'backward, in the layout it is given: not in either recipe until the GPU campaign measures it; a GPU '
        "(on a CPU only under TRITON_INTERPRET=1, Triton's slow interpreter, for tests)",
    )
    speed.add_argument(
        '--cudnn_benchmark',
        action='store_true',
        help='cuDNN tries its convolution algorithms on each new shape and keeps the fastest '
        '(torch.backends.cudnn.benchmark): the first batch pays for it, which the throughput windows leave out; '
        'a GPU; not in either recipe until the GPU campaign measures it',
    )
    add_switch(speed, '--fused_adamw', "PyTorch's fused AdamW kernel (same update)")
    add_switch(
        speed,
        '--low_precision_norm',
        "GroupNorm and LayerNorm in the autocast precision (Composer's LowPrecisionGroupNorm "
        'and LowPrecisionLayerNorm); needs --precision amp_bf16 or amp_fp16',
    )
    add_switch(
        speed,
        '--encoders_bf16',
        'keep the frozen VAE and text encoder weights in bf16 (half the memory and weight reads)',
    )
    add_switch(
        speed, '--pin_memory', 'page-locked host memory for batches, so their copy to the GPU can overlap compute'
    )
    ckpt = parser.add_argument_group('checkpoints')
    ckpt.add_argument('--run_name', default=None, help='run name (needed with --autoresume)')
    ckpt.add_argument('--save_folder', default=None, help='where Composer writes checkpoints (none by default)')
    ckpt.add_argument(
        '--save_interval', default='1ep', help='checkpoint every this Composer time string (default: %(default)s)'
    )
    ckpt.add_argument(
        '--save_num_checkpoints_to_keep',
        type=int,
        default=-1,
        metavar='N',
        help='keep the newest N checkpoints in a local --save_folder, the older deleted as each new one is written '
        "(Composer's save_num_checkpoints_to_keep): the newest whole checkpoint is never deleted, and a run resumed "
        "with --autoresume counts those its earlier processes wrote. -1 keeps all (default); 0 (Composer's for "
        'uploads: every local checkpoint deleted once written, none left to resume from) is refused',
    )
    ckpt.add_argument('--autoresume', action='store_true', help='resume from the latest checkpoint in --save_folder')
    ckpt.add_argument(
        '--trust_checkpoint',
        action='store_true',
        help='load the checkpoint to resume from even where it names code that loading runs (refused by default: '
        'checkpoints are read weights-only); only for a file whose writer you trust',
    )
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
    quality.add_argument(
        '--sample_scheduler',
        choices=list(SAMPLERS),
        default='ddim',
        help="sampler of the DDPM models (%(default)s); Flux and SD3.5 sample with their flow's Euler sampler",
    )
    quality.add_argument('--sample_steps', type=int, default=25, help='sampling steps (default: %(default)s)')
    quality.add_argument(
        '--guidance_scale', type=float, default=7.5, help='classifier-free guidance scale (default: %(default)s)'
    )
    quality.add_argument(
        '--export_pipeline',
        default=None,
        metavar='DIR',
        help='after training, save a Diffusers pipeline folder here (StableDiffusionPipeline, FluxPipeline, '
        'StableDiffusion3Pipeline or PixArtSigmaPipeline; the EMA weights with --use_ema)',
    )
    stability = parser.add_argument_group(
        "stability (off by default for the UNets: the published run has none; a diffusion transformer's recipe "
        'sets its own, see docs/models.md)'
    )
    stability.add_argument('--grad_clip_norm', type=float, default=None, help='clip the gradient norm to this')
    stability.add_argument(
        '--lr_warmup', default=None, help="linear learning-rate warmup from 0 over this time string (e.g. '1000ba')"
    )
    stability.add_argument(
        '--caption_dropout',
        type=float,
        default=None,
        help='train on the empty caption with this probability, for classifier-free guidance (default: 0, or the '
        "diffusion transformer recipe's)",
    )
    flow = parser.add_argument_group("flow matching (Flux, SD3.5; default: the model's recipe, docs/models.md)")
    flow.add_argument(
        '--timestep_density',
        choices=TIMESTEP_DENSITIES,
        default=None,
        help='how noise levels are drawn: uniformly, logit-normal (--logit_mean, --logit_std) or mode (--mode_scale)',
    )
    flow.add_argument('--logit_mean', type=float, default=None, help='mean of the logit-normal density (default: 0)')
    flow.add_argument('--logit_std', type=float, default=None, help='std of the logit-normal density (default: 1)')
    flow.add_argument('--mode_scale', type=float, default=None, help="the mode density's scale (default: 1.29)")
    flow.add_argument(
        '--loss_weighting',
        choices=LOSS_WEIGHTINGS,
        default=None,
        help="each sample's loss weight by its noise level, as Diffusers' SD3 training example (default: none)",
    )
    add_switch(
        flow,
        '--precondition_outputs',
        'the loss on the output turned into an estimate of the image, noisy - sigma x output, against the latents, '
        "as Diffusers' SD3 training example by default: the velocity error scaled by sigma (default: off, the "
        'rectified-flow target noise - latents)',
    )
    flow.add_argument(
        '--flux_guidance',
        type=float,
        default=None,
        help='the guidance scale a guidance-distilled Flux (transformer config guidance_embeds: true, as Flux.1-dev) '
        f"embeds while it trains (default: {EMBEDDED_GUIDANCE}, Diffusers' Flux training example's); not the sampling "
        '--guidance_scale',
    )
