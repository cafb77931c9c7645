"""What a run is: the frozen `RunConfig`, made of the sections of run_sections.py, and `resolve_config`, which turns
benchmark.py's parsed flags (flags.py) into one.

Every flag is checked here, before anything is built, and every value derived from the flags, the device, the model
folder and the dataset is settled here once (device batch, microbatch, number of batches, the image size of
precomputed data, what the batches carry, ...), so that the builders (models/, runs/training.py, runs/evaluation.py)
only read the configuration. It settles from facts (presets.py, families.py, model_folder.py, durations.py) and imports
no torch, Composer, Streaming or Diffusers: each flag's own value is checked first, and only then is the machine
asked about its GPU (hardware.py, which loads torch) and the dataset read. The unset flags are filled in by
defaults.py; the sections about the data, the outputs and what the machine runs are settled with datasets.py,
output_paths.py and device_checks.py; `resolve_config` lists every section in the order it is settled.
"""

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from guards.arguments import ConfigError
from settings import hardware
from settings.dataset_checks import DatasetDescription
from settings.datasets import (
    ValidationSplit,
    check_data_flags,
    check_image_size,
    held_out_prompts,
    read_training_data,
    settle_validation_split,
)
from settings.defaults import Flags, with_defaults
from settings.device_checks import check_device, check_one_microbatch_a_step, check_shared_memory, sample_bytes
from settings.durations import Duration, batches_of, parse_half_life, parse_interval, parse_time
from settings.families import EMBEDDED_GUIDANCE, FAMILIES, is_flow_matching
from settings.memory_plan import Plan, plan, plans_for
from settings.memory_plan import Run as PlannedRun
from settings.model_folder import (
    ModelFolder,
    caption_inputs,
    check_training_fields,
    embeds_guidance,
    resolve_model_dir,
    t5_tokenizer_needed,
)
from settings.output_paths import check_export_folder, check_outputs, settle_sample_folder
from settings.presets import SAMPLE_PROMPTS, SYNTHETIC_SAMPLES
from settings.run_record import resumed_cpu_threads, resumed_record
from settings.run_sections import (
    FLOW_FLAGS,
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
            listed = getattr(section, 'listed', None)  # a section that lists its fields otherwise
            fields |= (
                listed()
                if listed
                else {field.name: getattr(section, field.name) for field in dataclasses.fields(section)}
            )
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
    """The frozen configuration of parsed flags; raises ConfigError naming the first bad flag. Each flag's own value
    is checked before the GPU is asked about; the unset flags are filled in (defaults.py); then each section is
    settled by one function from the flags and the sections settled before it, in the order the data flows: the
    data before the batch, so that the batch is planned for the size the data holds."""
    check_placed(args)
    check_values(args)
    gpu = hardware.gpu()
    flags, model_dir, model_folder, default_notes = with_defaults(args, gpu)
    model = settle_model(flags, model_dir, model_folder)
    objective, objective_notes = settle_objective(flags, model)
    outputs = settle_outputs(flags)
    data, dataset, data_notes = settle_data(flags, model, gpu)
    ema = settle_ema(flags)
    speed = settle_speed(flags, model, gpu)
    batch, batch_notes = settle_batch(flags, model, data, dataset, ema, speed, gpu)
    evaluation, evaluation_notes = settle_evaluation(flags, model, data, batch, objective, outputs)
    sections = dict(model=model, data=data, batch=batch, ema=ema, speed=speed, outputs=outputs, evaluation=evaluation)
    notes = (*default_notes, *objective_notes, *data_notes, *batch_notes, *evaluation_notes)
    return RunConfig(**sections, objective=objective, notes=notes)


SECTIONS = (
    ModelSection,
    DataSection,
    BatchSection,
    EMASection,
    SpeedSection,
    OutputSection,
    EvaluationSection,
    ObjectiveSection,
)


def check_placed(args: argparse.Namespace) -> None:
    """Every flag is a field of a section. A flag no section holds is a mistake of this code (a new flag not placed
    in one), not of the user's: it would be dropped from the run without a word."""
    placed = {field.name for kind in SECTIONS for field in dataclasses.fields(kind)} | set(FLOW_FLAGS)  # in a Recipe
    if unplaced := sorted(set(vars(args)) - placed):
        raise AssertionError(f'flags in no section of RunConfig (settings/run_sections.py): {unplaced}')


def section(kind: type, flags: Flags, **settled):
    """A section: the values settled for it, and for its other fields the flags' values as given or filled in."""
    fields = [field.name for field in dataclasses.fields(kind)]
    return kind(**{name: settled[name] if name in settled else getattr(flags, name) for name in fields})


def check_values(args: argparse.Namespace) -> None:
    """Each given flag's value on its own, before any default or the machine is consulted (the EMA's half life, a
    duration of the EMA's own rules, is parsed once, by settle_ema)."""
    if args.model_name is not None:
        resolve_model_dir(args.model_name)
    if args.image_size is not None:
        check_image_size(args.image_size)
    if args.batch_size is not None and args.batch_size <= 0:
        raise ConfigError(f'--batch_size {args.batch_size}: must be positive')
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f'--num_workers {args.num_workers}: must be 0 or more')
    if args.cpu_threads is not None and args.cpu_threads <= 0:
        raise ConfigError(f'--cpu_threads {args.cpu_threads}: must be positive')
    if args.device_train_microbatch_size not in (None, 'auto'):
        parse_microbatch(args.device_train_microbatch_size)
    for flag in ('max_duration', 'save_interval', 'lr_warmup'):  # Composer would take a 0ba save interval, never saving
        if getattr(args, flag) is not None:
            parse_time(f'--{flag}', getattr(args, flag))
    if args.save_num_checkpoints_to_keep == 0 or args.save_num_checkpoints_to_keep < -1:
        # Composer's 0 deletes each checkpoint once written (for uploads), leaving none to resume from.
        raise ConfigError(
            f'--save_num_checkpoints_to_keep {args.save_num_checkpoints_to_keep}: keep 1 or more, or -1 for all'
        )
    for flag in ('eval_interval', 'sample_interval'):
        parse_interval(f'--{flag}', getattr(args, flag))
    if args.sample_steps <= 0:
        raise ConfigError(f'--sample_steps {args.sample_steps}: must be positive')
    if not args.guidance_scale >= 0:
        raise ConfigError(f'--guidance_scale {args.guidance_scale}: must be 0 or more (1 or less: no guidance)')
    if args.grad_clip_norm is not None and not 0 < args.grad_clip_norm < float('inf'):
        raise ConfigError(f'--grad_clip_norm {args.grad_clip_norm}: must be a positive number')
    if args.caption_dropout is not None and not 0 <= args.caption_dropout < 1:
        raise ConfigError(f'--caption_dropout {args.caption_dropout}: a probability, at least 0 and below 1')
    for flag in ('logit_std', 'mode_scale'):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            raise ConfigError(f'--{flag} {getattr(args, flag)}: must be positive')
    if args.flux_guidance is not None and not 0 <= args.flux_guidance < float('inf'):
        raise ConfigError(f'--flux_guidance {args.flux_guidance}: must be a number, 0 or more')


def parse_microbatch(text) -> int:
    try:
        microbatch = int(text)
    except ValueError:
        raise ConfigError(f"--device_train_microbatch_size {text!r}: pass a positive integer or 'auto'")
    if microbatch <= 0:
        raise ConfigError(f'--device_train_microbatch_size {microbatch}: must be positive (or auto)')
    return microbatch


def settle_model(flags: Flags, model_dir: Path, model_folder: ModelFolder) -> ModelSection:
    """The model, its folder's configs (read once, by with_defaults) and what its batches carry."""
    return section(
        ModelSection, flags, model_dir=model_dir, model_folder=model_folder, caption_inputs=caption_inputs(model_folder)
    )


def settle_objective(flags: Flags, model: ModelSection) -> tuple[ObjectiveSection, tuple[str, ...]]:
    """A diffusion transformer's training recipe (its family's, families.py) with the flags given applied, and the
    defaults it gives --grad_clip_norm and --caption_dropout; the UNet-only flags refused for it, the flow matching
    flags for the models that do not learn a flow, and a folder whose configs ask for what the step would not do
    (model_folder.check_training_fields)."""
    given_flow = {flag: getattr(flags, flag) for flag in FLOW_FLAGS if getattr(flags, flag) is not None}
    name, folder, notes = model.model_name, model.model_folder, []
    guidance = embeds_guidance(folder)
    if flags.flux_guidance is not None and not guidance:
        raise ConfigError(
            f'--flux_guidance: {name} embeds no guidance scale (a Flux whose transformer config has '
            'guidance_embeds: true does, as Flux.1-dev); the sampling scale is --guidance_scale'
        )
    objective = dict(
        grad_clip_norm=flags.grad_clip_norm,
        lr_warmup=flags.lr_warmup,
        caption_dropout=0.0 if flags.caption_dropout is None else flags.caption_dropout,
        flux_guidance=flags.flux_guidance,
        recipe=None,
    )
    if not folder.is_transformer:
        if given_flow:
            raise ConfigError(f'--{next(iter(given_flow))}: a flow matching option; {name} is a UNet (DDPM)')
        check_training_fields(name, folder, flags.prediction_type)
        return ObjectiveSection(**objective), ()
    check_transformer_flags(flags, model)
    if given_flow and not is_flow_matching(folder.family):
        raise ConfigError(f'--{next(iter(given_flow))}: a flow matching option; {name} predicts DDPM noise')
    recipe = dataclasses.replace(FAMILIES[folder.family].recipe, **given_flow)  # values checked in check_values
    if guidance:
        objective['flux_guidance'] = EMBEDDED_GUIDANCE if flags.flux_guidance is None else flags.flux_guidance
        recipe = dataclasses.replace(recipe, flux_guidance=objective['flux_guidance'])
    objective |= dict(recipe=recipe, learns_flow=is_flow_matching(folder.family))
    if flags.grad_clip_norm is None:
        objective['grad_clip_norm'] = recipe.grad_clip_norm
    if flags.caption_dropout is None:
        objective['caption_dropout'] = recipe.caption_dropout
        if flags.precomputed_latents and recipe.caption_dropout:
            objective['caption_dropout'] = 0.0
            notes.append(
                f"{name}'s recipe drops captions with probability {recipe.caption_dropout}, which precomputed text "
                'embeddings cannot: this run drops none'
            )
    return ObjectiveSection(**objective), tuple(notes)


def check_transformer_flags(flags: Flags, model: ModelSection) -> None:
    """The UNet's options refused for a diffusion transformer, and the T5 tokenizer its captions need."""
    name, folder = model.model_name, model.model_folder
    objective = "the family's objective is fixed, PixArt's by its scheduler's prediction_type"
    for flag, why in (('prediction_type', objective), ('export_ema_unet', 'a UNet export')):
        if getattr(flags, flag) is not None:
            raise ConfigError(f'--{flag}: a UNet option ({why}); {name} is a diffusion transformer')
    check_training_fields(name, folder)
    if flags.attention == 'xformers':
        raise ConfigError('--attention xformers: the diffusion transformers run PyTorch SDPA attention only')
    if flags.fused_groupnorm:
        raise ConfigError(f'--fused_groupnorm: a UNet option (its ResNet blocks); {name} has none')
    reads_captions = not (flags.use_synth_data or flags.precomputed_latents)
    if reads_captions and model.caption_inputs.uses_t5 and flags.tokenizer is None:
        raise ConfigError(t5_tokenizer_needed(name) + ', or --use_synth_data')
    drawing = drawing_flags(flags)
    if drawing and model.caption_inputs.uses_t5 and flags.tokenizer is None:
        raise ConfigError(t5_tokenizer_needed(f"{name}'s pipeline", 'reads prompts', f'--{drawing[0]}'))


def drawing_flags(flags: Flags) -> list[str]:
    """The flags given that draw images with the model's pipeline, so need its text encoders: sample grids (an
    interval of '0' draws none) and the pipeline export."""
    sample_interval = parse_interval('--sample_interval', flags.sample_interval)
    return [
        flag
        for flag, value in (('sample_interval', sample_interval), ('export_pipeline', flags.export_pipeline))
        if value
    ]


def settle_outputs(flags: Flags) -> OutputSection:
    """What the run writes, each place checked now, not after hours of training (output_paths.py)."""
    check_outputs(flags)
    return section(OutputSection, flags)


def settle_data(
    flags: Flags, model: ModelSection, gpu: hardware.Gpu | None
) -> tuple[DataSection, DatasetDescription | None, tuple[str, ...]]:
    """The data section, the dataset's description (datasets.py; None for random tensors and the sample dataset),
    read before the batch is planned, and the notes of what was chosen."""
    notes = []
    check_data_flags(flags)
    if flags.tokenizer is not None:  # it loads, and gives the ids of the model's text encoders
        check_tokenizer(flags.tokenizer, model.caption_inputs)
    own = Path(model.model_dir) / 'tokenizer'
    reads_captions = not (flags.use_synth_data or flags.precomputed_latents or model.caption_inputs.uses_t5)
    if flags.tokenizer is None and reads_captions and own.is_dir():
        notes.append(
            f"tokenizer: the built-in CLIP tokenizer (CLIP's ids), not the model folder's {own}, which is read only "
            f'when given: --tokenizer {own}'
        )
    cpu_threads, cpu_threads_given = flags.cpu_threads, flags.cpu_threads is not None
    if cpu_threads is None and gpu is None:
        cpu_threads, cpu_threads_given, why = hardware.cpu_threads()
        notes.append(f'cpu threads: {cpu_threads} ({why}; --cpu_threads N sets it)')
    resumed = resumed_record(flags.save_folder, flags.autoresume)
    cpu_threads, line = resumed_cpu_threads(cpu_threads, cpu_threads_given, resumed)
    notes += [line] if line else []
    training = read_training_data(flags, model.model_name, model.model_folder, notes)
    data = section(
        DataSection,
        flags,
        local=training.local,
        sample_data=training.sample_data,
        image_size=training.image_size,
        cpu_threads=cpu_threads,
        cpu_threads_given=cpu_threads_given,
        epoch_size=training.epoch_size,
        dataset_identity=training.dataset.identity if training.dataset else None,
    )
    return data, training.dataset, tuple(notes)


def settle_ema(flags: Flags) -> EMASection:
    """The averaged weights: the half life by the EMA's own rules (units, whole numbers), as ema.EMA takes it (a
    Composer Time), and its options, which need it on."""
    try:
        half_life = parse_half_life(flags.ema_half_life)
    except ValueError as error:
        raise ConfigError(f'--ema_half_life: {error}')
    if (flags.ema_offload or flags.export_ema_unet) and not flags.use_ema:
        raise ConfigError('--ema_offload and --export_ema_unet need --use_ema')
    return section(EMASection, flags, ema_half_life=half_life)


def settle_speed(flags: Flags, model: ModelSection, gpu: hardware.Gpu | None) -> SpeedSection:
    """The speed paths, each where this machine runs it (device_checks.py)."""
    check_device(flags, model.model_name, model.model_folder, gpu)
    return section(SpeedSection, flags)


def settle_batch(
    flags: Flags,
    model: ModelSection,
    data: DataSection,
    dataset: DatasetDescription | None,
    ema: EMASection,
    speed: SpeedSection,
    gpu: hardware.Gpu | None,
) -> tuple[BatchSection, tuple[str, ...]]:
    """Global batch = world size x device batch; device batch = microbatch x accumulation steps; on a GPU under the
    fast recipe, a microbatch not given is the largest its memory holds (memory_plan.py), at the size the data
    holds. Then the run's length in batches (an epoch's from the data), and what the loader workers' batches need of
    shared memory."""
    world_size, notes = hardware.world_size(), []
    if flags.batch_size % world_size:
        raise ConfigError(
            f'--batch_size {flags.batch_size} is not divisible by the world size {world_size}: '
            f'pass a multiple of {world_size}'
        )
    device_batch = flags.batch_size // world_size
    microbatch, memory_plan = flags.device_train_microbatch_size, None
    if microbatch is None and gpu is not None and flags.run_recipe != 'published' and plans_for(model.model_name):
        memory_plan = plan_microbatch(flags, model, data, ema, speed, device_batch, world_size, gpu)
        notes.append(memory_plan.describe())
        if memory_plan.microbatch is None:
            raise ConfigError(
                f'{model.model_name} at {data.image_size}px: {memory_plan.describe()}; shard it over more GPUs '
                f'(--fsdp full_shard){"" if data.precomputed_latents else ", train from --precomputed_latents"}, '
                'or give --device_train_microbatch_size'
            )
        microbatch = memory_plan.microbatch
    microbatch = settled_microbatch(microbatch, flags.batch_size, device_batch, world_size, gpu)
    batch = section(
        BatchSection,
        flags,
        world_size=world_size,
        device_batch_size=device_batch,
        device_train_microbatch_size=microbatch,
        memory_plan=memory_plan,
        num_batches=settled_batches(flags, data, dataset, device_batch, world_size, notes),
    )
    if speed.compile == 'reduce-overhead':
        check_one_microbatch_a_step(microbatch, device_batch, world_size)
    if flags.profile and batch.num_batches < 2:
        raise ConfigError(
            f'--profile: the profiler warms up on the batch before the one it records; run at least '
            f'2 batches (--max_duration {flags.max_duration} is {batch.num_batches})'
        )
    epoch_samples = data.epoch_size if data.sample_data else dataset and dataset.num_samples
    sample = sample_bytes(data.image_size, data.precomputed_latents, data.use_synth_data)
    check_shared_memory(
        data.remote or data.local, data.num_workers, device_batch, data.image_size, sample, epoch_samples
    )
    return batch, tuple(notes)


def settled_microbatch(
    microbatch: int | str | None, batch_size: int, device_batch: int, world_size: int, gpu: hardware.Gpu | None
) -> int | str:
    """The microbatch given or planned (None: the whole device batch), dividing the device batch; or 'auto'."""
    if microbatch is None:
        return device_batch
    if str(microbatch) == 'auto':
        if gpu is None:
            raise ConfigError(
                '--device_train_microbatch_size auto needs a GPU (Composer searches for the largest '
                'microbatch that fits in GPU memory); on CPU pass a number that divides the device batch'
            )
        return 'auto'
    microbatch = parse_microbatch(microbatch)
    if device_batch % microbatch:
        devices = f'{world_size} device{"s" if world_size > 1 else ""}'
        share = f'--batch_size {batch_size} over {devices} gives {device_batch} samples per device'
        what = (
            f'fewer than --device_train_microbatch_size {microbatch}'
            if microbatch > device_batch
            else f'which is not divisible by --device_train_microbatch_size {microbatch}'
        )
        raise ConfigError(
            f'{share}, {what}: choose a microbatch that divides {device_batch}, or a batch size divisible by '
            f'{world_size} x {microbatch} = {world_size * microbatch}'
        )
    return microbatch


def plan_microbatch(
    flags: Flags,
    model: ModelSection,
    data: DataSection,
    ema: EMASection,
    speed: SpeedSection,
    device_batch: int,
    world_size: int,
    gpu: hardware.Gpu,
) -> Plan:
    run = PlannedRun(
        model.model_name,
        data.image_size,
        device_batch,
        world_size,
        ema.use_ema,
        ema.ema_offload,
        data.precomputed_latents,
        speed.encoders_bf16,
        flags.fsdp,
        flags.precision != 'fp32',
        speed.activation_checkpointing,
    )
    return plan(run, gpu.memory_bytes)


def settled_batches(
    flags: Flags, data: DataSection, dataset: DatasetDescription | None, device_batch: int, world_size: int, notes: list
) -> int:
    """The run's length in batches, whatever unit --max_duration is in: an epoch of real data is the batches of
    its samples a device gets."""
    duration, batch_size = parse_time('--max_duration', flags.max_duration), flags.batch_size
    num_batches = batches_of(duration, batch_size)
    if duration.unit == 'sp' and num_batches * batch_size != duration.value:
        notes.append(
            f'--max_duration {flags.max_duration}: {num_batches} whole batches of {batch_size}, '
            f'{num_batches * batch_size} samples (Composer stops at the first batch that reaches {duration.value})'
        )
    if data.use_synth_data and duration.unit == 'ep':
        num_batches = duration.value * (SYNTHETIC_SAMPLES // batch_size)
        notes.append(
            f'--max_duration {flags.max_duration}: an epoch of --use_synth_data is {SYNTHETIC_SAMPLES:,} '
            f'samples, {SYNTHETIC_SAMPLES // batch_size:,} batches of {batch_size} ({num_batches:,} batches in all)'
        )
    if data.use_synth_data:
        return num_batches
    num_samples, location = (
        (data.epoch_size, data.local) if data.sample_data else (dataset.num_samples, dataset.location)
    )
    # Streaming gives each rank ceil(epoch / ranks) samples; the loader drops a last partial batch.
    samples_per_device = -(-num_samples // world_size)
    batches_per_epoch = samples_per_device // device_batch
    if batches_per_epoch == 0:
        raise ConfigError(
            f'{location}: {samples_per_device} samples per device, fewer than one device '
            f'batch ({device_batch}): use a larger dataset or a smaller --batch_size'
        )
    left_out = samples_per_device - batches_per_epoch * device_batch
    if num_batches is None and left_out:
        notes.append(
            f'--max_duration {flags.max_duration}: an epoch of {location} is {batches_per_epoch} batch(es) of '
            f'{device_batch} per device: {left_out} of its {samples_per_device} samples per device are left out of '
            'each epoch (the loader drops a partial batch; shuffled, other samples each epoch)'
        )
    return num_batches if num_batches is not None else duration.value * batches_per_epoch


def settle_evaluation(
    flags: Flags,
    model: ModelSection,
    data: DataSection,
    batch: BatchSection,
    objective: ObjectiveSection,
    outputs: OutputSection,
) -> tuple[EvaluationSection, tuple[str, ...]]:
    """Whether the run learns: the held-out split and when the validation loss runs (datasets.py), the sample
    grids (when they are drawn, what they need of the model and the data, their prompts and folder) and the
    pipeline export (docs/quality.md)."""
    notes = []
    split = settle_validation_split(flags, data.sample_data, data.image_size, batch.num_batches, notes)
    sample_interval = parse_interval('--sample_interval', flags.sample_interval)
    needs_encoders = drawing_flags(flags)
    folder = model.model_folder
    if needs_encoders and folder.is_sdxl:
        raise ConfigError(
            f"--{needs_encoders[0]}: sample images and pipeline exports use Diffusers' StableDiffusionPipeline, "
            f'which takes one text encoder; {model.model_name} (SDXL) has two. The validation loss '
            '(--eval_interval) works for every model'
        )
    if data.precomputed_latents and (needs_encoders or objective.caption_dropout):
        flag = f'--{needs_encoders[0]}' if needs_encoders else '--caption_dropout'
        raise ConfigError(
            f'{flag}: with --precomputed_latents the model has no VAE or text encoder (and the data holds text '
            'embeddings, not captions): train on images and captions for it'
        )
    prompts = sample_prompts(flags.sample_prompts, sample_interval, split, data, notes)
    sample_dir = settle_sample_folder(flags.sample_dir, sample_interval, outputs.run_name)
    check_export_folder(flags.export_pipeline)
    evaluation = section(
        EvaluationSection,
        flags,
        **dataclasses.asdict(split),
        sample_interval=sample_interval,
        sample_dir=sample_dir,
        sample_prompts=prompts,
    )
    return evaluation, tuple(notes)


def sample_prompts(
    given: str | None, sample_interval: str | None, split: ValidationSplit, data: DataSection, notes: list
) -> tuple[str, ...]:
    """The sample grids' prompts: a file's lines (--sample_prompts), else the held-out split's first captions,
    else the sample dataset's shapes."""
    if given is None:
        return held_out_prompts(sample_interval, split, data.precomputed_latents, notes) or SAMPLE_PROMPTS
    path = Path(given)
    if not path.is_file():
        raise ConfigError(f'--sample_prompts {given}: no such file (one prompt a line)')
    prompts = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not prompts:
        raise ConfigError(f'--sample_prompts {path}: holds no prompt (one prompt a line)')
    return prompts
