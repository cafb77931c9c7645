"""What a run is: the frozen `RunConfig`, and `resolve_config`, which turns benchmark.py's parsed flags (flags.py)
into one.

Every flag is checked here, before anything is built, and every value derived from the flags, the device, the model
folder and the dataset is settled here once (device batch, microbatch, number of batches, the image size of
precomputed data, what the batches carry, ...), so that the builders (models/, runs/training.py, runs/evaluation.py)
only read the configuration. It settles from facts (presets.py, recipes.py, model_folder.py, durations.py) and imports
no torch, Composer, Streaming or Diffusers: each flag's own value is checked first, and only then is the machine
asked about its GPU (hardware.py, which loads torch) and the dataset read.
"""

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from datapath.dataset_checks import DataError, DatasetDescription, describe_dataset, first_captions, is_remote
from datapath.tokenizer import check_tokenizer
from runs.writer_lock import contents
from settings import hardware
from settings.arguments import ConfigError
from settings.durations import Duration, parse_duration, parse_half_life
from settings.memory_plan import Plan, plan, plans_for
from settings.memory_plan import Run as PlannedRun
from settings.model_folder import (
    LATENT_DOWNSAMPLE,
    T5_CAPTION_LENGTH,
    CaptionInputs,
    caption_inputs,
    check_training_fields,
    denoiser_config,
    embeds_guidance,
    is_transformer_folder,
    pooled_text_width,
    resolve_model_dir,
    t5_tokenizer_needed,
    text_shapes,
)
from settings.presets import (
    PRESETS,
    SAMPLE_DATASET,
    SAMPLE_PROMPTS,
    SAMPLE_SIZE,
    SAMPLE_VALIDATION_DATASET,
    SAMPLE_VALIDATION_SIZE,
    SD2_BASE,
    SYNTHETIC_SAMPLES,
)
from settings.recipes import FLUX_GUIDANCE, RECIPES, Recipe, is_flow_matching


@dataclass(frozen=True)
class RunConfig:
    """Every flag of benchmark.py with its default settled, and the values derived from them."""

    # model
    model_name: str
    model_dir: Path  # the folder the model is built from (a built-in config, or the user's)
    caption_inputs: CaptionInputs  # what its batches carry beside the image (caption columns, SDXL's time_ids)
    prediction_type: str | None
    attention: str
    run_recipe: str  # 'fast' or 'published': where the speed paths' and precision's defaults come from
    # data
    use_synth_data: bool
    remote: str | None
    local: str | None
    sample_data: bool  # no dataset given: the generated sample dataset at `local`, written on first use
    precomputed_latents: bool
    tokenizer: str | None
    image_size: int  # with precomputed latents: the size the data was precomputed at
    num_workers: int
    cpu_threads: int | None  # PyTorch's threads; None: its own choice (on a GPU)
    # --cpu_threads or OMP_NUM_THREADS gave the count; else it was chosen, and a resumed run takes its checkpoint's
    cpu_threads_given: bool
    # batch and duration
    batch_size: int
    world_size: int
    device_batch_size: int  # batch_size / world_size
    device_train_microbatch_size: int | str  # an int dividing device_batch_size, or 'auto'
    max_duration: str
    num_batches: int  # the run's length in batches, whatever unit max_duration is in
    epoch_size: int | None  # samples per epoch of the sample dataset (None: the whole dataset)
    dataset_identity: str | None  # a converted dataset's samples and index digest (dataset_checks.dataset_identity)
    precision: str
    fsdp: str
    fsdp_state_dict_type: str
    # EMA
    use_ema: bool
    ema_half_life: Duration
    ema_offload: bool
    export_ema_unet: str | None
    seed: int
    # speed paths
    channels_last: bool
    compile: str | None  # an Inductor mode (flags.COMPILE_MODES), None: eager
    activation_checkpointing: bool
    fp8: bool
    fused_groupnorm: bool  # fused_groupnorm.py's Triton GroupNorm + SiLU in the UNet
    cudnn_benchmark: bool
    fused_adamw: bool
    low_precision_norm: bool
    encoders_bf16: bool
    pin_memory: bool
    # checkpoints and outputs
    run_name: str | None
    save_folder: str | None
    save_interval: str
    save_num_checkpoints_to_keep: int  # -1: all
    autoresume: bool
    wandb_name: str | None
    wandb_project: str | None
    results_json: str | None
    profile: str | None
    # does it learn: validation loss, sample images, pipeline export (evaluation.py, export.py)
    eval_local: str | None  # the held-out split's folder (the sample dataset's own split by default on it)
    sample_validation: bool  # eval_local is the sample dataset's held-out split, written on first use
    eval_remote: str | None
    eval_interval: str | None  # a Composer time string; None: no validation
    sample_interval: str | None  # None: no sample images
    sample_dir: str | None
    sample_prompts: tuple[str, ...]
    sample_scheduler: str
    sample_steps: int
    guidance_scale: float
    export_pipeline: str | None
    # stability options (stability.py), off by default for the UNets
    grad_clip_norm: float | None
    lr_warmup: str | None
    caption_dropout: float
    # flow matching (diffusion_transformer.py): None for the UNets and PixArt
    timestep_density: str | None
    logit_mean: float | None
    logit_std: float | None
    mode_scale: float | None
    loss_weighting: str | None
    precondition_outputs: bool | None
    flux_guidance: float | None  # the guidance a guidance-distilled Flux embeds in training; None for other models
    recipe: Recipe | None  # a diffusion transformer's training recipe, with the flags above applied
    # what resolving chose on the user's behalf, printed at start
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """The flags' values as JSON takes them (printed at start, in the results file); derived objects left out."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        del fields['notes'], fields['caption_inputs']
        return {key: plain(value) for key, value in fields.items()}


def plain(value):
    """A RunConfig value as JSON takes it: time strings and folders as text, tuples as lists."""
    if isinstance(value, Duration):
        return value.to_timestring()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return {key: plain(item) for key, item in dataclasses.asdict(value).items()}
    return value


# ------------------------------------------------------------------------------------------ resolve


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The frozen configuration of parsed flags; raises ConfigError naming the first bad flag. A check_ step only
    checks; a settle_ step also derives values. The flags' own values are checked before the GPU is asked about."""
    draft = argparse.Namespace(**vars(args), notes=[])  # the caller's args stay as they were
    check_values(draft)
    gpu = hardware.gpu()
    fill_defaults(draft, gpu)
    settle_recipe(draft)
    settle_batch(draft, gpu)
    check_device(draft, gpu)
    settle_ema(draft)
    check_outputs(draft)
    settle_duration(draft)
    settle_data(draft)
    settle_quality(draft)
    draft.notes = tuple(draft.notes)
    return RunConfig(**vars(draft))


def check_values(draft: argparse.Namespace) -> None:
    """Each given flag's value on its own, before any default or the machine is consulted."""
    if draft.model_name is not None:
        resolve_model_dir(draft.model_name)
    if draft.image_size is not None:
        check_image_size(draft.image_size)
    if draft.batch_size is not None and draft.batch_size <= 0:
        raise ConfigError(f'--batch_size {draft.batch_size}: must be positive')
    if draft.num_workers is not None and draft.num_workers < 0:
        raise ConfigError(f'--num_workers {draft.num_workers}: must be 0 or more')
    if draft.cpu_threads is not None and draft.cpu_threads <= 0:
        raise ConfigError(f'--cpu_threads {draft.cpu_threads}: must be positive')
    if draft.device_train_microbatch_size not in (None, 'auto'):
        parse_microbatch(draft.device_train_microbatch_size)
    for flag in ('max_duration', 'save_interval', 'lr_warmup'):  # Composer would take a 0ba save interval, never saving
        if getattr(draft, flag) is not None:
            parse_time(f'--{flag}', getattr(draft, flag))
    if draft.save_num_checkpoints_to_keep == 0 or draft.save_num_checkpoints_to_keep < -1:
        # Composer's 0 deletes each checkpoint once written (for uploads), leaving none to resume from.
        raise ConfigError(
            f'--save_num_checkpoints_to_keep {draft.save_num_checkpoints_to_keep}: keep 1 or more, or -1 for all'
        )
    for flag in ('eval_interval', 'sample_interval'):
        parse_interval(f'--{flag}', getattr(draft, flag))
    try:  # by the EMA's own rules (units, whole numbers)
        parse_half_life(draft.ema_half_life)
    except ValueError as error:
        raise ConfigError(f'--ema_half_life: {error}')
    if draft.sample_steps <= 0:
        raise ConfigError(f'--sample_steps {draft.sample_steps}: must be positive')
    if not draft.guidance_scale >= 0:
        raise ConfigError(f'--guidance_scale {draft.guidance_scale}: must be 0 or more (1 or less: no guidance)')
    if draft.grad_clip_norm is not None and not 0 < draft.grad_clip_norm < float('inf'):
        raise ConfigError(f'--grad_clip_norm {draft.grad_clip_norm}: must be a positive number')
    if draft.caption_dropout is not None and not 0 <= draft.caption_dropout < 1:
        raise ConfigError(f'--caption_dropout {draft.caption_dropout}: a probability, at least 0 and below 1')
    for flag in ('logit_std', 'mode_scale'):
        if getattr(draft, flag) is not None and not getattr(draft, flag) > 0:
            raise ConfigError(f'--{flag} {getattr(draft, flag)}: must be positive')
    if draft.flux_guidance is not None and not 0 <= draft.flux_guidance < float('inf'):
        raise ConfigError(f'--flux_guidance {draft.flux_guidance}: must be a number, 0 or more')


def check_image_size(image_size: int) -> None:
    if image_size <= 0 or image_size % LATENT_DOWNSAMPLE:
        raise ConfigError(
            f'--image_size {image_size}: must be a positive multiple of {LATENT_DOWNSAMPLE} '
            f'(the VAE downsamples {LATENT_DOWNSAMPLE}x)'
        )


def parse_microbatch(text) -> int:
    try:
        microbatch = int(text)
    except ValueError:
        raise ConfigError(f"--device_train_microbatch_size {text!r}: pass a positive integer or 'auto'")
    if microbatch <= 0:
        raise ConfigError(f'--device_train_microbatch_size {microbatch}: must be positive (or auto)')
    return microbatch


FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
# The speed paths a recipe turns on by default (each flag, given, wins): on a GPU the fast recipe takes the paths of
# MLPerf's SD2 submissions that measured faster here, the published one none of them. Channels-last is not among
# them: SD2 base from precomputed latents on an H200 trained at 115.5 img/s with it and 130.4 without (eager,
# microbatch 64; docs/speed.md), as PyTorch's GroupNorm has no channels-last kernel of MLPerf's kind.
FAST_PATHS = ('fused_adamw', 'low_precision_norm', 'encoders_bf16', 'pin_memory')


def fill_defaults(draft: argparse.Namespace, gpu: hardware.Gpu | None) -> None:
    """The model folder (and what its batches carry), then the values of the flags left unset: the model's preset
    (sizes, batch, duration) and the run recipe's (precision, attention, EMA, the speed paths, the microbatch), each
    named in a note with where it comes from."""
    has_gpu = gpu is not None
    if draft.model_name is None:
        draft.model_name = 'sd2-base' if has_gpu else 'tiny'
        why = 'a GPU is present' if has_gpu else 'no GPU found; pass --model_name sd2-base for the real model'
        draft.notes.append(f'--model_name not given: using {draft.model_name!r} ({why})')
    draft.model_dir = resolve_model_dir(draft.model_name)
    draft.caption_inputs = caption_inputs(draft.model_dir)
    published = draft.run_recipe == 'published'
    if published and is_transformer_folder(draft.model_dir):
        raise ConfigError(
            f"--recipe published: the 2023 run's settings are SD2's (a UNet); {draft.model_name} is a diffusion "
            'transformer: leave out --recipe'
        )
    from_preset, from_recipe = {}, {}
    preset = PRESETS.get(draft.model_name, SD2_BASE)  # a model folder: the published run's values
    # The fast recipe on a GPU plans the microbatch from memory (settle_batch), where the model's counts are known.
    planned = has_gpu and not published and plans_for(draft.model_name)
    for flag, value in dataclasses.asdict(preset).items():
        if getattr(draft, flag) is None and not (flag == 'device_train_microbatch_size' and planned):
            setattr(draft, flag, value)
            from_preset[flag] = value
    online = not draft.precomputed_latents
    recipe_values = {
        'num_workers': 8 if has_gpu else 0,
        'use_ema': published,
        # The 2023 run: fp16 mixed precision and xFormers attention (SDPA where xFormers is not installed).
        'precision': ('amp_fp16' if published else 'amp_bf16') if has_gpu else 'fp32',
        'attention': 'xformers' if published and has_gpu and importlib.util.find_spec('xformers') else 'sdpa',
        'channels_last': False,  # a path of MLPerf's that measured slower here (FAST_PATHS)
    }
    for flag in FAST_PATHS:
        recipe_values[flag] = has_gpu and not published
    mixed = (draft.precision or recipe_values['precision']) != 'fp32'
    recipe_values['low_precision_norm'] &= mixed  # norms in the autocast precision need autocast
    recipe_values['encoders_bf16'] &= online  # with precomputed latents there are no encoders
    for flag, value in recipe_values.items():
        if getattr(draft, flag) is None:
            setattr(draft, flag, value)
            from_recipe[flag] = value
    draft.notes.append(describe_defaults(draft, from_preset, from_recipe, has_gpu))
    if published and not has_gpu:
        draft.notes.append(published_on_a_cpu(draft, from_preset, from_recipe))
    draft.cpu_threads_given = draft.cpu_threads is not None
    if draft.cpu_threads is None and not has_gpu:
        draft.cpu_threads, draft.cpu_threads_given, why = hardware.cpu_threads(draft.num_workers)
        draft.notes.append(f'cpu threads: {draft.cpu_threads} ({why}; --cpu_threads N sets it)')


def describe_defaults(draft: argparse.Namespace, from_preset: dict, from_recipe: dict, has_gpu: bool) -> str:
    """One line: the flags left unset and where their values come from, e.g. 'defaults: image_size 512, ... from
    the sd2-base preset; precision amp_bf16, ...; on: fused_adamw, ...; off: ... from the 'fast' recipe on a GPU'."""

    def listed(values: dict) -> str:
        return ', '.join(
            f'{flag} {"whole device batch" if value is None else plain(value)}' for flag, value in values.items()
        )

    settings = {flag: value for flag, value in from_recipe.items() if not isinstance(value, bool)}
    switched = {flag: value for flag, value in from_recipe.items() if isinstance(value, bool)}
    on = [flag for flag, value in switched.items() if value]
    off = [flag for flag, value in switched.items() if not value]
    preset = draft.model_name if draft.model_name in PRESETS else 'published (a model folder)'
    recipe = ', '.join(
        part
        for part in (listed(settings), f'on: {", ".join(on)}' if on else '', f'off: {", ".join(off)}' if off else '')
        if part
    )
    other = 'fast' if draft.run_recipe == 'published' else 'published'
    return (
        f'defaults: {listed(from_preset) or "none"} from the {preset} preset; {recipe or "none"} from the '
        f'{draft.run_recipe!r} recipe on {"a GPU" if has_gpu else "a CPU"} (--recipe {other} for the other; a flag '
        'given wins)'
    )


def check_kernels(draft: argparse.Namespace, has_gpu: bool) -> None:
    """The kernels past the fast recipe (docs/speed.md): each where it can run, or one line."""
    if draft.attention == 'cudnn':
        if not has_gpu:
            raise ConfigError('--attention cudnn: cuDNN attention runs on CUDA GPUs only; use --attention sdpa here')
        version = importlib.metadata.version('torch').split('+')[0]
        if tuple(int(part) for part in version.split('.')[:2]) < (2, 6):
            raise ConfigError(
                f"--attention cudnn: SDPA's backend priority needs torch 2.6 or newer (this is {version}); "
                'use --attention sdpa'
            )
    if draft.cudnn_benchmark and not has_gpu:
        raise ConfigError('--cudnn_benchmark: cuDNN autotunes GPU convolutions; there is no GPU here')
    if draft.fused_groupnorm:
        if importlib.util.find_spec('triton') is None:
            raise ConfigError('--fused_groupnorm: a Triton kernel, and triton is not installed (pip install triton)')
        if not has_gpu and os.environ.get('TRITON_INTERPRET') != '1':
            raise ConfigError(
                '--fused_groupnorm: a Triton kernel for CUDA GPUs; on a CPU it runs only under TRITON_INTERPRET=1 '
                "(Triton's interpreter: slow, for tests)"
            )


def published_on_a_cpu(draft: argparse.Namespace, from_preset: dict, from_recipe: dict) -> str:
    """What --recipe published leaves out on a CPU, of the 2023 run's choices a flag did not set."""
    dropped = []
    if 'precision' in from_recipe:
        dropped.append("fp32, not the published fp16 mixed precision (a GPU's)")
    if 'attention' in from_recipe:
        dropped.append('SDPA attention, not xFormers (CUDA only)')
    microbatch = from_preset.get('device_train_microbatch_size', 4)
    if microbatch != 4:
        whole = 'the whole device batch' if microbatch is None else microbatch
        dropped.append(f"microbatch {whole} (the {draft.model_name} preset's), not the published 4")
    kept = 'EMA' if draft.use_ema else 'nothing else'
    return f'--recipe published on a CPU: {"; ".join(dropped) or "all of it"}; kept: {kept}'


FLOW_FLAGS = ('timestep_density', 'logit_mean', 'logit_std', 'mode_scale', 'loss_weighting', 'precondition_outputs')


def settle_recipe(draft: argparse.Namespace) -> None:
    """A diffusion transformer's training recipe (diffusion_transformer.RECIPES) with the flags given applied, and the
    defaults it gives --grad_clip_norm and --caption_dropout; the UNet-only flags refused for it, the flow matching
    flags for the models that do not learn a flow, and a folder whose configs ask for what the step would not do
    (model_folder.check_training_fields)."""
    given_flow = [flag for flag in FLOW_FLAGS if getattr(draft, flag) is not None]
    draft.recipe = None
    guidance = embeds_guidance(draft.model_dir)
    if draft.flux_guidance is not None and not guidance:
        raise ConfigError(
            f'--flux_guidance: {draft.model_name} embeds no guidance scale (a Flux whose transformer config has '
            'guidance_embeds: true does, as Flux.1-dev); the sampling scale is --guidance_scale'
        )
    if not is_transformer_folder(draft.model_dir):
        if given_flow:
            raise ConfigError(f'--{given_flow[0]}: a flow matching option; {draft.model_name} is a UNet (DDPM)')
        check_training_fields(draft.model_name, draft.model_dir, draft.prediction_type)
        if draft.caption_dropout is None:
            draft.caption_dropout = 0.0
        return
    family = denoiser_config(draft.model_dir)['_class_name']
    objective = "the family's objective is fixed, PixArt's by its scheduler's prediction_type"
    for flag, why in (('prediction_type', objective), ('export_ema_unet', 'a UNet export')):
        if getattr(draft, flag) is not None:
            raise ConfigError(f'--{flag}: a UNet option ({why}); {draft.model_name} is a diffusion transformer')
    check_training_fields(draft.model_name, draft.model_dir)
    if draft.attention == 'xformers':
        raise ConfigError('--attention xformers: the diffusion transformers run PyTorch SDPA attention only')
    if draft.fused_groupnorm:
        raise ConfigError(f'--fused_groupnorm: a UNet option (its ResNet blocks); {draft.model_name} has none')
    reads_captions = not (draft.use_synth_data or draft.precomputed_latents)
    if reads_captions and draft.caption_inputs.uses_t5 and draft.tokenizer is None:
        raise ConfigError(t5_tokenizer_needed(draft.model_name) + ', or --use_synth_data')
    drawing = [flag for flag in ('sample_interval', 'export_pipeline') if getattr(draft, flag)]
    if drawing and draft.caption_inputs.uses_t5 and draft.tokenizer is None:
        raise ConfigError(t5_tokenizer_needed(f"{draft.model_name}'s pipeline", 'reads prompts', f'--{drawing[0]}'))
    patch = LATENT_DOWNSAMPLE * 2  # Flux's 2x2 latent packing, SD3's and PixArt's 2x2 patches
    if draft.image_size % patch:
        raise ConfigError(f'--image_size {draft.image_size}: {draft.model_name} takes multiples of {patch}')
    transformer = denoiser_config(draft.model_dir)
    if draft.image_size // patch > transformer.get('pos_embed_max_size', float('inf')):
        largest = transformer['pos_embed_max_size'] * patch
        raise ConfigError(f'--image_size {draft.image_size}: {draft.model_name} takes at most {largest}px')
    if given_flow and not is_flow_matching(family):
        raise ConfigError(f'--{given_flow[0]}: a flow matching option; {draft.model_name} predicts DDPM noise')
    recipe = RECIPES[family]
    recipe = dataclasses.replace(recipe, **{flag: getattr(draft, flag) for flag in given_flow})
    if guidance:
        draft.flux_guidance = FLUX_GUIDANCE if draft.flux_guidance is None else draft.flux_guidance
        recipe = dataclasses.replace(recipe, flux_guidance=draft.flux_guidance)
    draft.recipe = recipe  # its values were given (checked in check_values) or are the recipe's own
    if is_flow_matching(family):
        for flag in FLOW_FLAGS:
            setattr(draft, flag, getattr(recipe, flag))
    if draft.grad_clip_norm is None:
        draft.grad_clip_norm = recipe.grad_clip_norm
    if draft.caption_dropout is None:
        draft.caption_dropout = recipe.caption_dropout
        if draft.precomputed_latents and recipe.caption_dropout:
            draft.caption_dropout = 0.0
            draft.notes.append(
                f"{draft.model_name}'s recipe drops captions with probability {recipe.caption_dropout}, which "
                'precomputed text embeddings cannot: this run drops none'
            )


def settle_batch(draft: argparse.Namespace, gpu: hardware.Gpu | None) -> None:
    """Global batch = world size x device batch; device batch = microbatch x accumulation steps; on a GPU under the
    fast recipe, a microbatch not given is the largest its memory holds (memory_plan.py)."""
    has_gpu = gpu is not None
    check_image_size(draft.image_size)  # a preset's, or one given (checked in check_values)
    draft.world_size = world_size = hardware.world_size()
    if draft.batch_size % world_size:
        raise ConfigError(
            f'--batch_size {draft.batch_size} is not divisible by the world size {world_size}: '
            f'pass a multiple of {world_size}'
        )
    draft.device_batch_size = device_batch = draft.batch_size // world_size
    microbatch = draft.device_train_microbatch_size
    if microbatch is None and has_gpu and draft.run_recipe != 'published' and plans_for(draft.model_name):
        planned = plan_microbatch(draft, gpu)
        draft.notes.append(planned.describe())
        if planned.microbatch is None:
            raise ConfigError(
                f'{draft.model_name} at {draft.image_size}px: {planned.describe()}; shard it over more GPUs '
                f'(--fsdp full_shard){"" if draft.precomputed_latents else ", train from --precomputed_latents"}, '
                'or give --device_train_microbatch_size'
            )
        microbatch = planned.microbatch
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
    microbatch = parse_microbatch(microbatch)
    if device_batch % microbatch:
        raise ConfigError(
            f'--batch_size {draft.batch_size} over {world_size} device(s) gives {device_batch} samples '
            f'per device, which is not divisible by --device_train_microbatch_size {microbatch}: choose a '
            f'microbatch that divides {device_batch}, or a batch size divisible by '
            f'{world_size} x {microbatch} = {world_size * microbatch}'
        )
    draft.device_train_microbatch_size = microbatch


def plan_microbatch(draft: argparse.Namespace, gpu: hardware.Gpu) -> Plan:
    run = PlannedRun(
        draft.model_name,
        draft.image_size,
        draft.device_batch_size,
        draft.world_size,
        draft.use_ema,
        draft.ema_offload,
        draft.precomputed_latents,
        draft.encoders_bf16,
        draft.fsdp,
        draft.precision != 'fp32',
        draft.activation_checkpointing,
    )
    return plan(run, gpu.memory_bytes)


def check_device(draft: argparse.Namespace, gpu: hardware.Gpu | None) -> None:
    """Flags that need a GPU, or a package, or another flag, on this machine."""
    has_gpu = gpu is not None
    if not has_gpu and draft.precision != 'fp32':
        raise ConfigError(
            f'--precision {draft.precision} needs a GPU; on CPU Composer trains in fp32 only: '
            'pass --precision fp32 or leave it unset'
        )
    if has_gpu and draft.precision == 'amp_bf16' and not gpu.bf16:
        raise ConfigError(f'--precision amp_bf16: {gpu.name} has no bf16 support; pass --precision amp_fp16')
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
    check_kernels(draft, has_gpu)
    if draft.compile and not has_gpu:
        # Measured: the forward pass compiles, then Inductor's C++ codegen (outer-loop fusion with a local buffer,
        # which GPUs' Triton codegen does not use) fails on the backward graph. Dynamo's tracing is tested on CPU.
        raise ConfigError(
            "--compile: torch 2.7.0's Inductor fails compiling this model's backward pass for CPU "
            '(KeyError in its C++ code generation, after minutes of compiling); use --compile on a GPU'
        )
    if draft.compile == 'reduce-overhead':
        check_one_microbatch_a_step(draft)
    if draft.fp8:
        check_fp8(draft, gpu)
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


def check_one_microbatch_a_step(draft: argparse.Namespace) -> None:
    """reduce-overhead's CUDA graphs (Inductor's cudagraph trees) replay each microbatch's forward and backward into
    the same static memory, so with gradient accumulation a microbatch's outputs, its gradients among them, can be
    overwritten by the next one's replay before the step uses them. Untested on a GPU: refused until it is."""
    microbatch, device_batch = draft.device_train_microbatch_size, draft.device_batch_size
    replays = 'CUDA graphs replay every microbatch into the same memory'
    one_a_step = f'pass --device_train_microbatch_size {device_batch} (one microbatch a step)'
    if microbatch == 'auto':
        raise ConfigError(
            f'--compile reduce-overhead: {replays}, and --device_train_microbatch_size auto lets Composer split the '
            f'device batch of {device_batch} into several: {one_a_step}, or another --compile mode'
        )
    if microbatch < device_batch:
        raise ConfigError(
            f'--compile reduce-overhead: {replays}, and this step accumulates {device_batch // microbatch} '
            f'microbatches of {microbatch} (device batch {device_batch}): {one_a_step} or --batch_size '
            f'{microbatch * draft.world_size} ({microbatch} per device), or another --compile mode'
        )


def check_fp8(draft: argparse.Namespace, gpu: hardware.Gpu | None) -> None:
    """torchao's float8 training needs the float8 matrix units of compute capability 8.9 and later, bf16 autocast
    around it, and linear layers to convert: a diffusion transformer's."""
    if not is_transformer_folder(draft.model_dir):
        raise ConfigError(
            f"--fp8: float8 training converts a diffusion transformer's linear layers; {draft.model_name} is a UNet, "
            'mostly convolutions'
        )
    if gpu is None or gpu.capability < FP8_CAPABILITY:
        where = (
            'no GPU here'
            if gpu is None
            else f'{gpu.name} has compute capability {gpu.capability[0]}.{gpu.capability[1]}'
        )
        raise ConfigError(
            f'--fp8 needs float8 matrix units (an H100, H200 or newer: compute capability 8.9 or more); {where}'
        )
    if draft.precision != 'amp_bf16':
        raise ConfigError(
            f'--fp8 trains with bf16 autocast around the float8 matmuls: leave --precision {draft.precision} out'
        )
    if importlib.util.find_spec('torchao') is None:
        raise ConfigError(
            "--fp8: torchao is not installed: pip install 'torchao==0.11.0' (for torch 2.7; see docs/install.md)"
        )


def settle_ema(draft: argparse.Namespace) -> None:
    if (draft.ema_offload or draft.export_ema_unet) and not draft.use_ema:
        raise ConfigError('--ema_offload and --export_ema_unet need --use_ema')
    try:  # by the EMA's own rules (units, whole numbers), once: the algorithm takes the parsed time
        draft.ema_half_life = parse_half_life(draft.ema_half_life)
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
    if draft.save_folder:
        refuse_what_composer_changes('--save_folder', draft.save_folder)
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
    if draft.save_num_checkpoints_to_keep != -1 and not local_save_folder:
        # Composer deletes only its local copies: a remote folder's checkpoints would all stay.
        raise ConfigError(
            f'--save_num_checkpoints_to_keep {draft.save_num_checkpoints_to_keep}: deletes checkpoints of a local '
            f'--save_folder only ({draft.save_folder or "none given"}); pass one, or leave the flag out'
        )
    if draft.results_json:
        check_writable_file('--results_json', draft.results_json)


def refuse_what_composer_changes(flag: str, folder: str) -> None:
    """Composer reads a checkpoint folder as a URL: a '#' or '?' (and ';' in the last name) would end its path there.
    It also fills the folder in as a template ({run_name}, {rank}), and again each path in it as it saves, so no
    escaping keeps a brace; and this run reads the folder as given (--autoresume, the checks at start). Either way
    the checkpoints would go to another folder than the one named."""
    if '{' in folder or '}' in folder:
        raise ConfigError(
            f'{flag} {folder}: Composer fills in braces as a template ({{run_name}}, {{rank}}), where this run '
            "reads the folder as given: the checkpoints would go to another folder; give one without '{' or '}'"
        )
    url = urllib.parse.urlparse(folder if '://' in folder else f'./{folder}')
    cut = {'#': url.fragment, '?': url.query, ';': url.params}
    for char, rest in cut.items():
        if rest:
            raise ConfigError(
                f"{flag} {folder}: Composer reads it as a URL, whose path ends before the '{char}': the checkpoints "
                "would go to another folder; give one without '#', '?' or ';'"
            )


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
    """The run can write in `folder`, or make it: a scratch folder with a small file in it is made and removed there,
    or in its nearest existing parent. Tried rather than read from the permission bits, which say nothing to root,
    and a read-only filesystem or a full disk or quota shows only on writing (a full disk still makes folders, not
    files). Nothing is left behind. `given`: the flag's value, if not the folder itself (a file in it)."""
    parent = Path(folder)
    while not parent.exists():
        parent = parent.parent
    scratch = None
    try:
        scratch = tempfile.mkdtemp(dir=parent, prefix='.write-check-')
        Path(scratch, 'probe').write_bytes(bytes(4096))
    except OSError as error:
        raise ConfigError(f'{flag} {given or folder}: cannot write in {parent} ({error.strerror or error})') from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def refuse_used_output_folder(flag: str, folder: str, why: str) -> None:
    path = Path(folder)
    if path.is_file() or (path.is_dir() and contents(path)):  # a lock file a killed writer left is no output
        problem = 'is a file' if path.is_file() else 'is not empty'
        raise ConfigError(f'{flag} {folder}: {problem}; give a new folder ({why})')


def settle_duration(draft: argparse.Namespace) -> None:
    """The run's length in batches (epochs of real data are settled in settle_data, which reads the dataset), and
    the checkpoint interval."""
    duration = parse_time('--max_duration', draft.max_duration)
    if duration.unit == 'ba':
        draft.num_batches = duration.value
    elif duration.unit == 'sp':  # Composer trains until it has seen at least that many
        draft.num_batches = -(-duration.value // draft.batch_size)
        if draft.num_batches * draft.batch_size != duration.value:
            draft.notes.append(
                f'--max_duration {draft.max_duration}: {draft.num_batches} whole batches of {draft.batch_size}, '
                f'{draft.num_batches * draft.batch_size} samples (Composer stops at the first batch that reaches '
                f'{duration.value})'
            )
    else:
        draft.num_batches = duration.value * (SYNTHETIC_SAMPLES // draft.batch_size)
        if draft.use_synth_data:
            draft.notes.append(
                f'--max_duration {draft.max_duration}: an epoch of --use_synth_data is {SYNTHETIC_SAMPLES:,} '
                f'samples, {SYNTHETIC_SAMPLES // draft.batch_size:,} batches of {draft.batch_size} '
                f'({draft.num_batches:,} batches in all)'
            )
    if draft.profile and draft.num_batches < 2:
        raise ConfigError(
            f'--profile: the profiler warms up on the batch before the one it records; run at least '
            f'2 batches (--max_duration {draft.max_duration} is {draft.num_batches})'
        )


def parse_time(flag: str, text: str) -> Duration:
    """A positive Composer time string in batches, samples or epochs."""
    try:
        time = parse_duration(text)
    except (ValueError, TypeError) as error:  # TypeError: a fraction of a unit that counts whole ones ('1.5ep')
        raise ConfigError(f"{flag} {text!r}: {error} (examples: '10ba', '1ep', '20000sp')")
    if time.unit not in ('ba', 'sp', 'ep'):
        raise ConfigError(f"{flag} {text}: use batches, samples or epochs ('10ba', '20000sp', '1ep')")
    if time.value <= 0:
        raise ConfigError(f"{flag} {text}: must be positive (examples: '10ba', '1ep', '20000sp')")
    return time


def settle_data(draft: argparse.Namespace) -> None:
    """Which dataset, and what it implies: the sample dataset's epoch (the dataset written on first use), the
    batches of an epoch of real data, and the image size precomputed latents were made at."""
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
        check_tokenizer(draft.tokenizer, draft.caption_inputs)
    draft.sample_data = not (draft.use_synth_data or draft.remote or draft.local)
    draft.epoch_size = draft.dataset_identity = None
    if draft.use_synth_data:
        return
    duration = parse_duration(draft.max_duration)
    if draft.sample_data:
        # Ours, and written by the data loader's builder on first use (training.build_dataloader): its size is known.
        draft.local = str(SAMPLE_DATASET)
        draft.notes.append(
            f'no --remote/--local given: training on the sample dataset {draft.local} ({SAMPLE_SIZE} '
            'generated JPEGs with captions, built on first use); --use_synth_data trains on random '
            'tensors as published'
        )
        # A few hundred images: one epoch spans the whole run (at least one global batch), repeating samples.
        wanted = draft.batch_size if duration.unit == 'ep' else draft.batch_size * draft.num_batches
        draft.epoch_size = -(-max(wanted, SAMPLE_SIZE) // draft.batch_size) * draft.batch_size
        num_samples, location = draft.epoch_size, draft.local
    else:
        try:
            dataset = describe_dataset(draft.remote, draft.local, precomputed=draft.precomputed_latents)
        except DataError as error:
            raise ConfigError(str(error))
        num_samples, location, draft.dataset_identity = dataset.num_samples, dataset.location, dataset.identity
    # Streaming gives each rank ceil(epoch / ranks) samples; the loader drops a last partial batch.
    samples_per_device = -(-num_samples // draft.world_size)
    batches_per_epoch = samples_per_device // draft.device_batch_size
    if batches_per_epoch == 0:
        raise ConfigError(
            f'{location}: {samples_per_device} samples per device, fewer than one device '
            f'batch ({draft.device_batch_size}): use a larger dataset or a smaller --batch_size'
        )
    if duration.unit == 'ep':
        draft.num_batches = duration.value * batches_per_epoch
    if draft.precomputed_latents:
        settle_precomputed_shapes(draft, dataset)


def settle_precomputed_shapes(draft: argparse.Namespace, dataset: DatasetDescription) -> None:
    """The stored shapes must fit this model's denoiser; the image size is the one the data was precomputed at."""
    denoiser = denoiser_config(draft.model_dir)
    if is_transformer_folder(draft.model_dir):
        family = denoiser['_class_name']
        shapes = text_shapes(family, denoiser, T5_CAPTION_LENGTH[family])
        expected_channels = json.loads((draft.model_dir / 'vae' / 'config.json').read_text())['latent_channels']
        expected_length, expected_width = shapes['text_embedding']
        pooled = shapes.get('pooled_text_embedding', [None])[0]
        kind = 'transformer'
    else:
        expected_channels, expected_width = denoiser['in_channels'], denoiser['cross_attention_dim']
        expected_length, pooled, kind = dataset.embedding_length, pooled_text_width(denoiser), 'UNet'
    channels, height, width = dataset.latent_shape
    stored = (channels, dataset.embedding_length, dataset.embedding_width)
    if stored != (expected_channels, expected_length, expected_width):
        raise ConfigError(
            f'{dataset.location}: precomputed latents with {channels} channels and text embeddings of '
            f"{dataset.embedding_length} x {dataset.embedding_width}, but {draft.model_name}'s {kind} takes "
            f'{expected_channels} and {expected_length} x {expected_width}: precompute it with the same --model_name'
        )
    if pooled != dataset.pooled_width:
        raise ConfigError(
            f'{dataset.location}: '
            + (
                f"no pooled text embedding of width {pooled}, which {draft.model_name}'s {kind} takes"
                if dataset.pooled_width is None
                else f"a pooled text embedding, which {draft.model_name}'s {kind} does not take"
            )
            + ': precompute it with the same --model_name'
        )
    if height != width:
        raise ConfigError(f'{dataset.location}: latents of {height}x{width}; square ones expected')
    if kind == 'transformer' and height % 2:
        raise ConfigError(
            f'{dataset.location}: latents of {height}x{width} ({height * LATENT_DOWNSAMPLE}px), but '
            f'{draft.model_name} reads 2x2 patches of them: precompute at a multiple of 16 pixels'
        )
    if height * LATENT_DOWNSAMPLE != draft.image_size:
        draft.notes.append(
            f'--image_size {draft.image_size}: the data was precomputed at '
            f'{height * LATENT_DOWNSAMPLE}px, which is what this run trains at'
        )
        draft.image_size = height * LATENT_DOWNSAMPLE


def settle_quality(draft: argparse.Namespace) -> None:
    """Validation, samples, export and the stability options (docs/quality.md)."""
    settle_validation_split(draft)
    draft.sample_interval = parse_interval('--sample_interval', draft.sample_interval)
    needs_encoders = [flag for flag in ('sample_interval', 'export_pipeline') if getattr(draft, flag)]
    sdxl = (draft.model_dir / 'text_encoder_2').is_dir() and not is_transformer_folder(draft.model_dir)
    if needs_encoders and sdxl:
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
    if draft.sample_prompts is None:
        draft.sample_prompts = held_out_prompts(draft) or SAMPLE_PROMPTS
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


def held_out_prompts(draft: argparse.Namespace) -> tuple[str, ...]:
    """A run with sample grids and a held-out split of its own (a local folder of captions) draws the split's
    first captions: prompts of the data it trains on, none of them trained on. The sample dataset's shapes
    otherwise."""
    if not (draft.sample_interval and draft.eval_local) or draft.sample_validation or draft.precomputed_latents:
        return ()
    prompts = first_captions(draft.eval_local, len(SAMPLE_PROMPTS))
    if prompts:
        draft.notes.append(
            f'sample grids: the first {len(prompts)} captions of the held-out split {draft.eval_local} '
            '(--sample_prompts FILE: others)'
        )
    return prompts


# convert.py --validation_fraction writes its held-out split in this folder of the training data's
# (convert.VALIDATION_SPLIT; named here rather than imported, which would load PIL and tqdm for every flag check).
CONVERTED_VALIDATION_SPLIT = 'validation'


def settle_validation_split(draft: argparse.Namespace) -> None:
    """The held-out split: --eval_local/--eval_remote; or the one convert.py --validation_fraction wrote in the
    training folder; or with the sample dataset its own held-out split (written on first use); and when the
    validation loss runs (see --eval_interval)."""
    if draft.eval_local and draft.eval_remote:
        raise ConfigError('--eval_local and --eval_remote: give one (a folder, or a remote copied whole)')
    if draft.eval_remote and not is_remote(draft.eval_remote):
        draft.eval_local, draft.eval_remote = draft.eval_remote, None  # a bare folder is read in place
    given = bool(draft.eval_local or draft.eval_remote)
    draft.sample_validation = False
    interval = draft.eval_interval
    if interval is None:  # with a split given, at the start and the end; otherwise never
        interval = f'{draft.num_batches}ba' if given else '0'
    draft.eval_interval = parse_interval('--eval_interval', interval)
    if not draft.eval_interval:
        return
    found = not given and not draft.sample_data
    if found:
        draft.eval_local = converted_validation_split(draft)
        if draft.eval_local is None:
            raise ConfigError(
                '--eval_interval: no held-out split to validate on: pass --eval_local DIR or --eval_remote URL '
                '(an MDS dataset written by convert.py, or by precompute.py with --precomputed_latents), or convert '
                f'with --validation_fraction, which writes one in the output folder ({CONVERTED_VALIDATION_SPLIT}/)'
            )
    elif not given:
        # Ours, written by the evaluators' builder on first use (evaluation.build_evaluators): nothing to read.
        draft.eval_local, draft.sample_validation = str(SAMPLE_VALIDATION_DATASET), True
        draft.notes.append(
            f"validation loss on the sample dataset's held-out split {draft.eval_local} ({SAMPLE_VALIDATION_SIZE} "
            f'images) every {draft.eval_interval}, at the start and at the end (--eval_interval 0: never)'
        )
        return
    try:
        split = describe_dataset(draft.eval_remote, draft.eval_local, precomputed=draft.precomputed_latents)
    except DataError as error:
        raise ConfigError(f'--eval_{"interval" if found else "remote" if draft.eval_remote else "local"}: {error}')
    if split.num_samples == 0:
        raise ConfigError(f'--eval_local/--eval_remote {split.location}: the split holds no samples')
    if found:
        draft.notes.append(
            f'validation loss on {split.location} ({split.num_samples} images), the held-out split convert.py '
            f'--validation_fraction wrote beside the training data, every {draft.eval_interval}, at the start and '
            'at the end (--eval_local/--eval_remote: another split; --eval_interval 0: never)'
        )
    if split.latent_shape is not None and split.latent_shape[-1] * LATENT_DOWNSAMPLE != draft.image_size:
        raise ConfigError(
            f'{split.location}: validation latents precomputed at {split.latent_shape[-1] * LATENT_DOWNSAMPLE}px, '
            f'but the run trains at {draft.image_size}px: precompute the split at the same size'
        )


def converted_validation_split(draft: argparse.Namespace) -> str | None:
    """The held-out split convert.py --validation_fraction wrote in the training folder, when the run reads that
    folder in place (--local alone, or --remote naming a folder). Not looked for on a remote, where telling a
    missing split from an unreachable server would cost a round of retries: pass it as --eval_remote."""
    folder = draft.remote or draft.local
    if folder is None or is_remote(folder):  # --use_synth_data, or a remote
        return None
    split = Path(folder) / CONVERTED_VALIDATION_SPLIT
    return str(split) if (split / 'index.json').is_file() else None


def parse_interval(flag: str, text: str | None) -> str | None:
    """An evaluation interval: a positive Composer time string, or None for never ('0' or unset)."""
    if text is None or text.strip() == '0':
        return None
    parse_time(flag, text)
    return text
