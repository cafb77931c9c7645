"""What a run is: the frozen `RunConfig`, made of the sections of run_sections.py, and `resolve_config`, which turns
benchmark.py's parsed flags (flags.py) into one.

Every flag is checked here, before anything is built, and every value derived from the flags, the device, the model
folder and the dataset is settled here once (device batch, microbatch, number of batches, the image size of
precomputed data, what the batches carry, ...), so that the builders (models/, runs/training.py, runs/evaluation.py)
only read the configuration. It settles from facts (presets.py, families.py, model_folder.py, durations.py) and imports
no torch, Composer, Streaming or Diffusers: each flag's own value is checked first, and only then is the machine
asked about its GPU (hardware.py, which loads torch) and the dataset read. The steps about the machine, the outputs
and the data live in device_checks.py, output_paths.py and datasets.py; `resolve_config` lists every step in order.
"""

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from guards.arguments import ConfigError
from settings import hardware
from settings.datasets import check_data_flags, held_out_prompts, read_data, settle_epoch, settle_validation_split
from settings.device_checks import check_device, check_shared_memory
from settings.durations import Duration, parse_half_life, parse_interval, parse_time
from settings.families import EMBEDDED_GUIDANCE, FAMILIES, is_flow_matching
from settings.memory_plan import Plan, plan, plans_for
from settings.memory_plan import Run as PlannedRun
from settings.model_folder import (
    LATENT_DOWNSAMPLE,
    caption_inputs,
    check_training_fields,
    embeds_guidance,
    read_model_folder,
    resolve_model_dir,
    t5_tokenizer_needed,
)
from settings.output_paths import check_outputs, settle_sample_and_export_folders
from settings.presets import PRESETS, SAMPLE_PROMPTS, SD2_BASE, SYNTHETIC_SAMPLES, Preset
from settings.run_record import RUN_DESCRIPTION_FILE, exported_run
from settings.run_sections import (
    BatchSection,
    DataSection,
    EMASection,
    EvaluationSection,
    ModelSection,
    ObjectiveSection,
    OutputSection,
    SpeedSection,
)
from settings.tokenizer import check_tokenizer


@dataclass(frozen=True)
class RunConfig:
    """Every flag of benchmark.py with its default settled, and the values derived from them, in sections
    (run_sections.py), one per part of a run."""

    model: ModelSection
    data: DataSection
    batch: BatchSection
    ema: EMASection
    speed: SpeedSection
    outputs: OutputSection
    evaluation: EvaluationSection
    objective: ObjectiveSection
    notes: tuple[str, ...] = ()  # what resolving chose on the user's behalf, printed at start

    def as_dict(self) -> dict:
        """The flags' values as JSON takes them (printed at start, in the results file), one flat dict in
        flag_order; derived objects left out."""
        fields = {}
        for section in (getattr(self, field.name) for field in dataclasses.fields(self) if field.name != 'notes'):
            fields |= {field.name: getattr(section, field.name) for field in dataclasses.fields(section)}
        del fields['model_folder'], fields['caption_inputs'], fields['memory_plan']
        return {key: json_value(fields[key]) for key in flag_order(fields)}


# The fields the printed configuration and the results file list among another section's, each after the field
# named: results files are compared key by key across runs, so a section's order is not theirs.
LISTED_AFTER = {'epoch_size': 'num_batches', 'dataset_identity': 'epoch_size', 'seed': 'export_ema_unet'}


def flag_order(names) -> list[str]:
    """The names in the sections' order, with LISTED_AFTER's moved after their fields."""
    order = [name for name in names if name not in LISTED_AFTER]
    for name, after in LISTED_AFTER.items():  # in turn: dataset_identity follows epoch_size once placed
        order.insert(order.index(after) + 1, name)
    return order


def json_value(value):
    """A RunConfig value as JSON takes it: time strings and folders as text, tuples as lists."""
    if isinstance(value, Duration):
        return value.to_timestring()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return {key: json_value(item) for key, item in dataclasses.asdict(value).items()}
    return value


# ------------------------------------------------------------------------------------------ resolve


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The frozen configuration of parsed flags; raises ConfigError naming the first bad flag. A check_ step only
    checks; a settle_ step also derives values. The flags' own values are checked before the GPU is asked about.
    The steps of other modules: device_checks.py (what this machine runs), output_paths.py (where the run writes),
    datasets.py (the data it reads). The data is read before the batch is planned, in the order the data flows."""
    draft = argparse.Namespace(**vars(args), notes=[], memory_plan=None)  # the caller's args stay as they were
    check_values(draft)
    gpu = hardware.gpu()
    fill_defaults(draft, gpu)
    settle_recipe(draft)
    check_outputs(draft)
    check_data_flags(draft)
    check_tokenizer_given(draft)
    dataset = read_data(draft)  # before the batch: precomputed latents fix the image size the plan is for
    settle_batch(draft, gpu)
    check_device(draft, gpu)
    check_ema(draft)
    settle_duration(draft)
    epoch_samples = settle_epoch(draft, dataset)
    check_shared_memory(draft, epoch_samples)
    settle_validation_split(draft)
    settle_samples(draft)
    settle_sample_and_export_folders(draft)
    return sectioned(draft)


SECTIONS = {
    'model': ModelSection,
    'data': DataSection,
    'batch': BatchSection,
    'ema': EMASection,
    'speed': SpeedSection,
    'outputs': OutputSection,
    'evaluation': EvaluationSection,
    'objective': ObjectiveSection,
}


def sectioned(draft: argparse.Namespace) -> RunConfig:
    """The settled draft in its sections. A value no section holds is a mistake of this code (a new flag not
    placed in one), not of the user's: it would be dropped from the run without a word."""
    placed = {field.name for kind in SECTIONS.values() for field in dataclasses.fields(kind)} | {'notes'}
    if unplaced := sorted(set(vars(draft)) - placed):
        raise AssertionError(f'settled values in no section of RunConfig (settings/run_sections.py): {unplaced}')
    sections = {name: section(kind, draft) for name, kind in SECTIONS.items()}
    return RunConfig(**sections, notes=tuple(draft.notes))


def section(kind: type, draft: argparse.Namespace):
    """A section of the RunConfig, its fields picked from the settled draft."""
    return kind(**{field.name: getattr(draft, field.name) for field in dataclasses.fields(kind)})


def check_values(draft: argparse.Namespace) -> None:
    """Each given flag's value on its own, before any default or the machine is consulted. The EMA's half life is
    kept as parsed here, the one parse of it (ema.EMA takes it as a Composer Time)."""
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
        draft.ema_half_life = parse_half_life(draft.ema_half_life)
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


# The speed paths a recipe turns on by default (each flag, given, wins): on a GPU the fast recipe takes the paths of
# MLPerf's SD2 submissions that measured faster here, the published one none of them. Channels-last is not among
# them: it measured slower in eager mode (docs/speed.md has the figures), as PyTorch's GroupNorm has no
# channels-last kernel of MLPerf's kind.
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
    draft.model_folder = read_model_folder(draft.model_dir)  # its configs, read once for every step that asks
    draft.caption_inputs = caption_inputs(draft.model_folder)
    published = draft.run_recipe == 'published'
    if published and draft.model_folder.is_transformer:
        raise ConfigError(
            f"--recipe published: the 2023 run's settings are SD2's (a UNet); {draft.model_name} is a diffusion "
            'transformer: leave out --recipe'
        )
    from_preset, from_recipe = {}, {}
    exported = {} if draft.model_name in PRESETS else exported_run(draft.model_dir, EXPORTED_RUN_FIX)
    # A model folder: the values of the run that exported it, else the published run's.
    preset = PRESETS.get(draft.model_name) or exported_preset(exported)
    for flag in ('prediction_type', 'tokenizer'):  # what the exported run trained with (None: the model's own)
        if getattr(draft, flag) is None and exported.get(flag) is not None:
            if flag == 'tokenizer' and not Path(exported[flag]).is_dir():
                raise ConfigError(
                    f"--tokenizer: {draft.model_name}'s run read captions with {exported[flag]}, which is no folder "
                    'here: pass the tokenizer folder'
                )
            setattr(draft, flag, exported[flag])
            from_preset[flag] = exported[flag]
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
        draft.cpu_threads, draft.cpu_threads_given, why = hardware.cpu_threads()
        draft.notes.append(f'cpu threads: {draft.cpu_threads} ({why}; --cpu_threads N sets it)')


EXPORTED_RUN_FIX = 'export the folder again, or remove that file to train with the published preset'


def exported_preset(exported: dict) -> Preset:
    """The preset of a folder benchmark.py --export_pipeline wrote: the size, batch and microbatch of its run (the
    published run's where one is not recorded); SD2_BASE for another folder."""

    def recorded(flag: str, default):
        value = exported.get(flag)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    return Preset(
        image_size=recorded('image_size', SD2_BASE.image_size),
        batch_size=recorded('batch_size', SD2_BASE.batch_size),
        device_train_microbatch_size=recorded('device_train_microbatch_size', None)
        if exported
        else SD2_BASE.device_train_microbatch_size,
        max_duration=SD2_BASE.max_duration,
    )


def describe_defaults(draft: argparse.Namespace, from_preset: dict, from_recipe: dict, has_gpu: bool) -> str:
    """One line: the flags left unset and where their values come from, e.g. 'defaults: image_size 512, ... from
    the sd2-base preset; precision amp_bf16, ...; on: fused_adamw, ...; off: ... from the 'fast' recipe on a GPU'."""

    def listed(values: dict) -> str:
        return ', '.join(
            f'{flag} {"whole device batch" if value is None else json_value(value)}' for flag, value in values.items()
        )

    settings = {flag: value for flag, value in from_recipe.items() if not isinstance(value, bool)}
    switched = {flag: value for flag, value in from_recipe.items() if isinstance(value, bool)}
    on = [flag for flag, value in switched.items() if value]
    off = [flag for flag, value in switched.items() if not value]
    if draft.model_name in PRESETS:
        preset = draft.model_name
    elif (draft.model_dir / RUN_DESCRIPTION_FILE).is_file():
        preset = f"exported run's ({draft.model_dir / RUN_DESCRIPTION_FILE})"
    else:
        preset = 'published (a model folder)'
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
    """A diffusion transformer's training recipe (its family's, families.py) with the flags given applied, and the
    defaults it gives --grad_clip_norm and --caption_dropout; the UNet-only flags refused for it, the flow matching
    flags for the models that do not learn a flow, and a folder whose configs ask for what the step would not do
    (model_folder.check_training_fields)."""
    given_flow = [flag for flag in FLOW_FLAGS if getattr(draft, flag) is not None]
    draft.recipe = None
    folder = draft.model_folder
    guidance = embeds_guidance(folder)
    if draft.flux_guidance is not None and not guidance:
        raise ConfigError(
            f'--flux_guidance: {draft.model_name} embeds no guidance scale (a Flux whose transformer config has '
            'guidance_embeds: true does, as Flux.1-dev); the sampling scale is --guidance_scale'
        )
    if not folder.is_transformer:
        if given_flow:
            raise ConfigError(f'--{given_flow[0]}: a flow matching option; {draft.model_name} is a UNet (DDPM)')
        check_training_fields(draft.model_name, folder, draft.prediction_type)
        if draft.caption_dropout is None:
            draft.caption_dropout = 0.0
        return
    family = folder.family
    objective = "the family's objective is fixed, PixArt's by its scheduler's prediction_type"
    for flag, why in (('prediction_type', objective), ('export_ema_unet', 'a UNet export')):
        if getattr(draft, flag) is not None:
            raise ConfigError(f'--{flag}: a UNet option ({why}); {draft.model_name} is a diffusion transformer')
    check_training_fields(draft.model_name, folder)
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
    transformer = folder.denoiser_config
    if draft.image_size // patch > transformer.get('pos_embed_max_size', float('inf')):
        largest = transformer['pos_embed_max_size'] * patch
        raise ConfigError(f'--image_size {draft.image_size}: {draft.model_name} takes at most {largest}px')
    if given_flow and not is_flow_matching(family):
        raise ConfigError(f'--{given_flow[0]}: a flow matching option; {draft.model_name} predicts DDPM noise')
    recipe = FAMILIES[family].recipe
    recipe = dataclasses.replace(recipe, **{flag: getattr(draft, flag) for flag in given_flow})
    if guidance:
        draft.flux_guidance = EMBEDDED_GUIDANCE if draft.flux_guidance is None else draft.flux_guidance
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
        draft.memory_plan = planned = plan_microbatch(draft, gpu)
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


def check_ema(draft: argparse.Namespace) -> None:
    """The EMA's options need it on (its half life was parsed in check_values)."""
    if (draft.ema_offload or draft.export_ema_unet) and not draft.use_ema:
        raise ConfigError('--ema_offload and --export_ema_unet need --use_ema')


def check_tokenizer_given(draft: argparse.Namespace) -> None:
    """--tokenizer loads, and gives the ids of the model's text encoders (tokenizer.check_tokenizer)."""
    if draft.tokenizer is not None:
        check_tokenizer(draft.tokenizer, draft.caption_inputs)


def settle_duration(draft: argparse.Namespace) -> None:
    """The run's length in batches (epochs of real data are settled in datasets.settle_epoch, from the dataset
    read), and the checkpoint interval."""
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


def settle_samples(draft: argparse.Namespace) -> None:
    """Sample grids and the pipeline export: when grids are drawn, what they need of the model and the data, and
    their prompts (docs/quality.md)."""
    draft.sample_interval = parse_interval('--sample_interval', draft.sample_interval)
    needs_encoders = [flag for flag in ('sample_interval', 'export_pipeline') if getattr(draft, flag)]
    folder = draft.model_folder
    sdxl = 'text_encoder_2' in folder.text_encoder_folders and not folder.is_transformer
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
