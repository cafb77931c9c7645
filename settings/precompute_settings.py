"""precompute.py's flags settled into a frozen PrecomputeSettings, as benchmark.py's are into a RunConfig: each flag's
own value checked first, then the unset ones filled in from this machine (hardware.py) and the model's preset, with
the same default model as a run (presets.default_model). Facts only (no torch loads here)."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from guards.arguments import ConfigError
from settings import hardware
from settings.dataset_checks import is_remote
from settings.model_folder import (
    ModelFolder,
    caption_inputs,
    read_model_folder,
    resolve_model_dir,
    t5_tokenizer_needed,
)
from settings.presets import PRESETS, SAMPLE_DATASET, SD2_BASE, default_model
from settings.tokenizer import check_tokenizer


@dataclass(frozen=True)
class PrecomputeSettings:
    """What precompute.py encodes, and how: each flag given or filled in (read-only)."""

    remote: str | None
    local: str | None  # the sample dataset's folder where neither --remote nor --local is given
    out: str
    model_name: str
    model_folder: ModelFolder  # its configs, read once for the checks and every batch
    image_size: int
    tokenizer: str | None
    batch_size: int
    num_workers: int
    part_size: int
    precision: str
    seed: int
    overwrite: bool
    sample_data: bool  # the input is the sample dataset


def settle_precompute(args: argparse.Namespace) -> PrecomputeSettings:
    """The flags checked, each on its own first, then with the defaults of this machine and the model's."""
    for flag in ('image_size', 'batch_size', 'part_size'):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise ConfigError(f'--{flag} {getattr(args, flag)}: must be positive')
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f'--num_workers {args.num_workers}: must be 0 or more')
    if args.image_size is not None and args.image_size % 8:
        raise ConfigError(f'--image_size {args.image_size}: must be a multiple of 8 (the VAE downsamples 8x)')
    # A bad --model_name is named before the inputs are looked at.
    model_dir = None if args.model_name is None else resolve_model_dir(args.model_name)
    for source in (args.remote, args.local):
        if source is not None:
            check_apart(args.out, source)
    has_gpu = hardware.gpu() is not None
    model_name = args.model_name or default_model(has_gpu)
    model_dir = model_dir or resolve_model_dir(model_name)
    folder = read_model_folder(model_dir)
    image_size = args.image_size or PRESETS.get(model_name, SD2_BASE).image_size
    if folder.is_transformer and image_size % 16:
        raise ConfigError(f'--image_size {image_size}: {model_name} takes multiples of 16 (2x2 patches of latents)')
    inputs = caption_inputs(folder)
    if args.tokenizer is not None:
        check_tokenizer(args.tokenizer, inputs)  # here, once, rather than in every loader worker
    elif inputs.uses_t5:
        raise ConfigError(t5_tokenizer_needed(model_name))
    sample_data = not (args.remote or args.local)
    if sample_data:
        check_apart(args.out, str(SAMPLE_DATASET))
    given = {flag: getattr(args, flag) for flag in ('remote', 'out', 'tokenizer', 'part_size', 'seed', 'overwrite')}
    return PrecomputeSettings(
        **given,
        local=str(SAMPLE_DATASET) if sample_data else args.local,
        model_name=model_name,
        model_folder=folder,
        image_size=image_size,
        batch_size=args.batch_size or (32 if has_gpu else 16),
        num_workers=(8 if has_gpu else 0) if args.num_workers is None else args.num_workers,
        precision=args.precision or ('bf16' if has_gpu else 'fp32'),
        sample_data=sample_data,
    )


def check_apart(out: str, source: str) -> None:
    """--overwrite empties the output, and the merged index.json replaces the one at its root: the output may not
    hold the input, nor lie inside it."""
    if overlaps(out, source):
        raise ConfigError(
            f'--out {out}: overlaps the input {source}; write the precomputed dataset to a folder or prefix of its own'
        )


def overlaps(out: str, source: str) -> bool:
    """Whether one location holds the other (or is it): local folders, or remotes by their URL prefix."""
    if is_remote(out) != is_remote(source):
        return False
    if not is_remote(out):
        out_path, source_path = Path(out).resolve(), Path(source).resolve()
        return out_path.is_relative_to(source_path) or source_path.is_relative_to(out_path)
    out_prefix, source_prefix = out.rstrip('/') + '/', source.rstrip('/') + '/'
    return out_prefix.startswith(source_prefix) or source_prefix.startswith(out_prefix)
