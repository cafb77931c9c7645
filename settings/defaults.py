"""The values of the flags a run leaves unset, filled in before any section is settled (config.py): the model (SD2
base on a GPU, the tiny twin on a CPU), its preset's sizes, batch and duration (a folder's exported run's, or the
published run's), and the run recipe's precision, attention, EMA, speed paths and loader workers, each listed in one
note with where it comes from. The result, `Flags`, is read-only: what is derived from it goes into the sections."""

import argparse
import dataclasses
import importlib.util
from pathlib import Path

from guards.arguments import ConfigError
from settings import hardware
from settings.memory_plan import plans_for
from settings.model_folder import ModelFolder, read_model_folder, resolve_model_dir
from settings.presets import PRESETS, PUBLISHED_MODEL, SD2_BASE, Preset, default_model
from settings.run_record import RUN_DESCRIPTION_FILE, exported_run


class Flags(argparse.Namespace):
    """benchmark.py's flags, each given or filled in by `with_defaults`; read-only, so that every value derived from
    them is settled once, into the section that holds it."""

    def __init__(self, **values):
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f'the flags are read-only ({name}): a derived value goes into its section')


# The speed paths a recipe turns on by default (each flag, given, wins): on a GPU the fast recipe takes the paths of
# MLPerf's SD2 submissions that measured faster here, the published one none of them. Channels-last is not among
# them: it measured slower in eager mode (docs/speed.md has the figures), as PyTorch's GroupNorm has no
# channels-last kernel of MLPerf's kind.
FAST_PATHS = ('fused_adamw', 'low_precision_norm', 'encoders_bf16', 'pin_memory')
EXPORTED_RUN_FIX = 'export the folder again, or remove that file to train with the published preset'


def with_defaults(
    args: argparse.Namespace, gpu: hardware.Gpu | None
) -> tuple[Flags, Path, ModelFolder, tuple[str, ...]]:
    """The flags with the unset ones filled in, the model's folder and its configs (read once for every step that
    asks), and the notes naming each value filled in with where it comes from."""
    values, notes = dict(vars(args)), []
    has_gpu = gpu is not None
    if values['model_name'] is None:
        values['model_name'] = default_model(has_gpu)
        why = 'a GPU is present' if has_gpu else f'no GPU found; pass --model_name {PUBLISHED_MODEL} for the real model'
        notes.append(f'--model_name not given: using {values["model_name"]!r} ({why})')
    model_name = values['model_name']
    model_dir = resolve_model_dir(model_name)
    folder = read_model_folder(model_dir)
    published = values['run_recipe'] == 'published'
    if published and folder.is_transformer:
        raise ConfigError(
            f"--recipe published: the 2023 run's settings are SD2's (a UNet); {model_name} is a diffusion "
            'transformer: leave out --recipe'
        )
    exported = {} if model_name in PRESETS else exported_run(model_dir, EXPORTED_RUN_FIX)
    from_preset = exported_values(values, exported)
    # A model folder: the values of the run that exported it, else the published run's.
    preset = PRESETS.get(model_name) or exported_preset(exported)
    # The fast recipe on a GPU plans the microbatch from memory (config.settle_batch), where the model's counts are
    # known.
    planned = has_gpu and not published and plans_for(model_name)
    for flag, value in dataclasses.asdict(preset).items():
        if values[flag] is None and not (flag == 'device_train_microbatch_size' and planned):
            values[flag] = from_preset[flag] = value
    from_recipe = {}
    for flag, value in recipe_values(values, has_gpu).items():
        if values[flag] is None:
            values[flag] = from_recipe[flag] = value
    notes.append(describe_defaults(model_name, model_dir, values['run_recipe'], from_preset, from_recipe, has_gpu))
    if published and not has_gpu:
        notes.append(published_on_a_cpu(model_name, values['use_ema'], from_preset, from_recipe))
    return Flags(**values), model_dir, folder, tuple(notes)


def exported_values(values: dict, exported: dict) -> dict:
    """The prediction type and tokenizer the `exported` run trained with (a folder benchmark.py --export_pipeline
    wrote), for the flags not given (written into `values`); returns those filled in."""
    filled = {}
    for flag in ('prediction_type', 'tokenizer'):  # what the exported run trained with (None: the model's own)
        if values[flag] is None and exported.get(flag) is not None:
            if flag == 'tokenizer' and not Path(exported[flag]).is_dir():
                raise ConfigError(
                    f"--tokenizer: {values['model_name']}'s run read captions with {exported[flag]}, which is no "
                    'folder here: pass the tokenizer folder'
                )
            values[flag] = filled[flag] = exported[flag]
    return filled


def recipe_values(values: dict, has_gpu: bool) -> dict:
    """The run recipe's values (--recipe fast or published) on this machine."""
    published = values['run_recipe'] == 'published'
    recipe = {
        'num_workers': 8 if has_gpu else 0,
        'use_ema': published,
        # The 2023 run: fp16 mixed precision and xFormers attention (SDPA where xFormers is not installed).
        'precision': ('amp_fp16' if published else 'amp_bf16') if has_gpu else 'fp32',
        'attention': 'xformers' if published and has_gpu and importlib.util.find_spec('xformers') else 'sdpa',
        'channels_last': False,  # a path of MLPerf's that measured slower here (FAST_PATHS)
    }
    for flag in FAST_PATHS:
        recipe[flag] = has_gpu and not published
    recipe['low_precision_norm'] &= (values['precision'] or recipe['precision']) != 'fp32'  # needs autocast
    recipe['encoders_bf16'] &= not values['precomputed_latents']  # with precomputed latents there are no encoders
    return recipe


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


def describe_defaults(
    model_name: str, model_dir: Path, run_recipe: str, from_preset: dict, from_recipe: dict, has_gpu: bool
) -> str:
    """One line: the flags left unset and where their values come from, e.g. 'defaults: image_size 512, ... from
    the sd2-base preset; precision amp_bf16, ...; on: fused_adamw, ...; off: ... from the 'fast' recipe on a GPU'."""

    def listed(values: dict) -> str:
        return ', '.join(f'{flag} {"whole device batch" if value is None else value}' for flag, value in values.items())

    settings = {flag: value for flag, value in from_recipe.items() if not isinstance(value, bool)}
    switched = {flag: value for flag, value in from_recipe.items() if isinstance(value, bool)}
    on = [flag for flag, value in switched.items() if value]
    off = [flag for flag, value in switched.items() if not value]
    if model_name in PRESETS:
        preset = model_name
    elif (model_dir / RUN_DESCRIPTION_FILE).is_file():
        preset = f"exported run's ({model_dir / RUN_DESCRIPTION_FILE})"
    else:
        preset = 'published (a model folder)'
    recipe = ', '.join(
        part
        for part in (listed(settings), f'on: {", ".join(on)}' if on else '', f'off: {", ".join(off)}' if off else '')
        if part
    )
    other = 'fast' if run_recipe == 'published' else 'published'
    return (
        f'defaults: {listed(from_preset) or "none"} from the {preset} preset; {recipe or "none"} from the '
        f'{run_recipe!r} recipe on {"a GPU" if has_gpu else "a CPU"} (--recipe {other} for the other; a flag '
        'given wins)'
    )


def published_on_a_cpu(model_name: str, use_ema: bool, from_preset: dict, from_recipe: dict) -> str:
    """What --recipe published leaves out on a CPU, of the 2023 run's choices a flag did not set."""
    dropped = []
    if 'precision' in from_recipe:
        dropped.append("fp32, not the published fp16 mixed precision (a GPU's)")
    if 'attention' in from_recipe:
        dropped.append('SDPA attention, not xFormers (CUDA only)')
    microbatch = from_preset.get('device_train_microbatch_size', 4)
    if microbatch != 4:
        whole = 'the whole device batch' if microbatch is None else microbatch
        dropped.append(f"microbatch {whole} (the {model_name} preset's), not the published 4")
    kept = 'EMA' if use_ema else 'nothing else'
    return f'--recipe published on a CPU: {"; ".join(dropped) or "all of it"}; kept: {kept}'
