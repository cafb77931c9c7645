"""Prompts to images, offline: from a Composer checkpoint of benchmark.py, or from a pipeline folder that
`benchmark.py --export_pipeline` (or Diffusers) saved: Stable Diffusion's (one text encoder), Flux's, SD3's or
PixArt-Sigma's. A checkpoint records its run's model, prediction type and tokenizer folder, which --model_name,
--prediction_type and --tokenizer default to (a flag given is used, with a line where it differs): the record
beside it in its save folder (run_description.json), read before torch loads, else the one inside it; an older
checkpoint without that record needs --model_name. A pipeline folder holds its own.

    python generate.py --checkpoint ckpt/latest-rank0.pt --prompt 'a red circle' --out out/
    python generate.py --pipeline results/pipeline --prompts prompts.txt --out out/ --batch_size 8

Image i is drawn from seed --seed + i, so a prompt list gives the same images with any batch size. The images are
as large as the run's training images (the exported folder and the checkpoint record their size) unless
--image_size says otherwise; grid.png shows them under their prompts. With --clip_model (a local CLIP folder) it
prints the CLIP score of the images against their prompts, and with --fid_reference and --fid_weights the FID
against reference images (docs/quality.md); no weights are downloaded.
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from guards import arguments
from guards.arguments import ConfigError
from guards.library_patches import LibraryChanged
from guards.outputs import one_line
from guards.stopping import SIGNALS, Stopped, stop_on_signals
from settings.families import FAMILIES
from settings.generate_settings import GenerateSettings
from settings.model_folder import (
    LATENT_DOWNSAMPLE,
    UNET_PIPELINE_NAME,
    WEIGHT_FILES,
    caption_inputs,
    read_model_folder,
    resolve_model_dir,
    weight_files,
    weights_problem,
)
from settings.presets import SAMPLERS
from settings.run_record import not_a_checkpoint, recorded_beside
from settings.tokenizer import check_tokenizer_file

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # never the network: every part is local

# The pipelines export.py builds, which generate() draws with.
PIPELINES = (UNET_PIPELINE_NAME, *(family.pipeline for family in FAMILIES.values()))

# The flags whose default, with --checkpoint, is the value its run recorded, each with what a recorded None meant.
RECORDED_FLAGS = {
    'model_name': None,
    'prediction_type': "the model's own prediction type",
    'tokenizer': 'the default tokenizer',
}


class GenerateError(ConfigError):
    """Bad input to generate.py, reported as one line."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(description='Generate images from a trained model, offline and seeded.')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--checkpoint', help="a Composer checkpoint file of benchmark.py (e.g. 'latest-rank0.pt')")
    source.add_argument('--pipeline', help="a Diffusers pipeline folder (--export_pipeline's)")
    parser.add_argument(
        '--model_name',
        help="with --checkpoint: the run's --model_name, a built-in or a folder (default: the one the checkpoint "
        'records; an older checkpoint records none)',
    )
    parser.add_argument(
        '--prediction_type',
        choices=['epsilon', 'v_prediction'],
        help="with --checkpoint: the run's (default: the one the checkpoint records)",
    )
    parser.add_argument(
        '--tokenizer',
        help="with --checkpoint: the run's --tokenizer folder, T5's for a T5 model (default: the one the checkpoint "
        'records)',
    )
    parser.add_argument('--ema', action='store_true', help="with --checkpoint: the run's EMA weights (--use_ema)")
    parser.add_argument(
        '--trust_checkpoint',
        action='store_true',
        help='with --checkpoint: load it even where it names code that loading runs (refused by default: '
        'checkpoints are read weights-only); only for a file whose writer you trust',
    )
    parser.add_argument('--prompt', action='append', default=[], help='a prompt (repeat the flag for more)')
    parser.add_argument('--prompts', help='a file of prompts, one a line')
    parser.add_argument('--out', required=True, help='a new or empty folder for the PNGs')
    parser.add_argument('--seed', type=int, default=0, help='image i is drawn from seed + i (default: %(default)s)')
    parser.add_argument('--batch_size', type=int, default=4, help='images per pipeline call (default: %(default)s)')
    parser.add_argument('--steps', type=int, default=25, help='sampling steps (default: %(default)s)')
    parser.add_argument('--guidance_scale', type=float, default=7.5, help='(default: %(default)s)')
    parser.add_argument(
        '--scheduler',
        choices=sorted(SAMPLERS),
        help="sampler of a DDPM model (default: ddim, or the folder's); Flux and SD3.5 sample with their flow's",
    )
    parser.add_argument(
        '--image_size',
        type=int,
        help="pixels per side (default: the size the run trained at, else the model's sample size)",
    )
    parser.add_argument('--clip_model', metavar='DIR', help='print the CLIP score with this local CLIP model')
    parser.add_argument('--fid_reference', metavar='DIR', help='print the FID against this MDS split of images')
    parser.add_argument('--fid_weights', metavar='FILE', help="torchvision's Inception v3 weights file, for the FID")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[GenerateSettings, list[str]]:
    """The settled flags and the prompts, once every flag is checked; GenerateError names the first bad one."""
    prompts = list(args.prompt)
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise GenerateError(f'--prompts {args.prompts}: no such file (one prompt a line)')
        prompts += [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise GenerateError('no prompt: pass --prompt TEXT (repeatable) or --prompts FILE')
    transformer = False  # a diffusion transformer's: images in multiples of 16 pixels (2x2 latent patches)
    settings = GenerateSettings(**{**vars(args), 'prompt': tuple(args.prompt)})
    if args.checkpoint:
        if not Path(args.checkpoint).is_file():
            raise GenerateError(
                f'--checkpoint {args.checkpoint}: no such file (sharded FSDP checkpoints: not supported)'
            )
        problem = not_a_checkpoint(args.checkpoint)
        if problem:
            raise GenerateError(
                f'--checkpoint {args.checkpoint}: {problem}; give a checkpoint of benchmark.py --save_folder '
                '(e.g. latest-rank0.pt)'
            )
        recorded = recorded_beside(args.checkpoint, 'remove it (the checkpoint holds the record too)')
        if recorded is not None:  # else the record inside the checkpoint, once torch loads it (main)
            settings = settle_checkpoint_flags(settings, recorded)
    else:
        index = Path(args.pipeline) / 'model_index.json'
        if not index.is_file():
            raise GenerateError(f'--pipeline {args.pipeline}: no model_index.json there (not a pipeline folder)')
        try:
            components = json.loads(index.read_text())
            kind = components.get('_class_name')
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise GenerateError(f'--pipeline {args.pipeline}: its model_index.json is not a JSON object')
        if kind not in PIPELINES:
            raise GenerateError(f'--pipeline {args.pipeline}: a {kind}; generate.py draws with {", ".join(PIPELINES)}')
        problem = missing_part(Path(args.pipeline), components)
        if problem:
            raise GenerateError(
                f'--pipeline {args.pipeline}: {problem}; give a whole pipeline folder (export it again)'
            )
        transformer = kind != UNET_PIPELINE_NAME
        given = [flag for flag in ('model_name', 'prediction_type', 'tokenizer', 'ema') if getattr(args, flag)]
        if given:
            raise GenerateError(f'--{given[0]}: applies to --checkpoint only (a pipeline folder holds its own)')
    out = Path(args.out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise GenerateError(
            f'--out {args.out}: is a file or not empty; give a new folder (images are never overwritten)'
        )
    for flag in ('batch_size', 'steps', 'image_size'):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise GenerateError(f'--{flag} {value}: must be positive')
    check_image_size(settings, transformer)
    if args.clip_model and not (Path(args.clip_model) / 'config.json').is_file():
        raise GenerateError(f'--clip_model {args.clip_model}: no CLIP model folder (config.json) there')
    if bool(args.fid_reference) != bool(args.fid_weights):
        raise GenerateError('--fid_reference and --fid_weights: the FID needs both (reference images and weights)')
    if args.fid_weights and not Path(args.fid_weights).is_file():
        raise GenerateError(f'--fid_weights {args.fid_weights}: no such file')
    if args.fid_reference and not (Path(args.fid_reference) / 'index.json').is_file():
        raise GenerateError(f'--fid_reference {args.fid_reference}: no MDS split (index.json) there')
    return settings, prompts


def settle_checkpoint_flags(settings: GenerateSettings, recorded: dict) -> GenerateSettings:
    """The flags a checkpoint's run record settles (RECORDED_FLAGS), and the model folder they name, read once;
    then those that depend on its model, checked. Prints the lines recorded_flags says."""
    taken, lines = recorded_flags(settings, recorded)
    for line in lines:
        print(line)
    settled = dataclasses.replace(settings, **taken)
    try:
        model_dir = resolve_model_dir(settled.model_name)  # once, for the model and its tokenizer's padding
    except ConfigError as error:
        raise GenerateError(str(error))
    settled = dataclasses.replace(settled, model_folder=read_model_folder(model_dir))
    transformer = settled.model_folder.is_transformer
    if transformer:
        if settled.tokenizer is None:
            raise GenerateError(
                f"--tokenizer: {settled.model_name} reads prompts with T5: pass the run's --tokenizer folder (T5's)"
            )
        if settled.prediction_type:
            raise GenerateError(f'--prediction_type: a UNet option; {settled.model_name} is a diffusion transformer')
    if settled.tokenizer is not None:
        check_tokenizer_file(settled.tokenizer, caption_inputs(settled.model_folder))  # another family's is named now
    check_image_size(settled, transformer)
    return settled


def check_image_size(settings: GenerateSettings, transformer: bool) -> None:
    multiple = LATENT_DOWNSAMPLE * (2 if transformer else 1)
    if settings.image_size is not None and settings.image_size % multiple:
        raise GenerateError(f'--image_size {settings.image_size}: must be a multiple of {multiple}')


def missing_part(folder: Path, components: dict) -> str | None:
    """The first part of a pipeline folder that its model_index.json lists and that is not there whole (a folder, a
    model's weights), or None; read before Diffusers loads, which would stop with a traceback."""
    for name, entry in components.items():
        if name.startswith('_') or not isinstance(entry, list) or not entry or entry[0] is None:
            continue  # the pipeline's own fields, and parts left out (a safety checker)
        part = folder / name
        if not part.is_dir():
            return f'no {name}/ folder, which its model_index.json lists ({entry[-1]})'
        if name not in WEIGHT_FILES or not (part / 'config.json').is_file():
            continue  # a scheduler or tokenizer: no weights
        files = weight_files(part, name)
        if not files:
            return f'{name}/ holds no weights ({" or ".join(WEIGHT_FILES[name])})'
        for path in files:
            problem = weights_problem(path)
            if problem:
                return f'{path.relative_to(folder)}: {problem}'
    return None


def recorded_flags(settings: GenerateSettings, recorded: dict) -> tuple[dict, list[str]]:
    """Each of RECORDED_FLAGS not given, as the checkpoint's run recorded it, and the lines to print: the values
    taken, each flag given that differs from the record, and what an older checkpoint does not record.
    GenerateError where the checkpoint records no model and --model_name is not given."""
    if 'model_name' not in recorded:
        if settings.model_name:
            return {}, []
        raise GenerateError(
            f'--checkpoint {settings.checkpoint}: records no model (a checkpoint of an older version); pass the '
            "run's --model_name (e.g. tiny, sd2-base)"
        )
    lines = []
    for flag, default in RECORDED_FLAGS.items():
        given = getattr(settings, flag)
        if flag in recorded and given is not None and not names_the_same(given, recorded[flag]):
            trained = recorded[flag] or default
            lines.append(f"--{flag} {given}: given, where the checkpoint's run trained with {trained}; {given} is used")
    taken = {
        flag: recorded[flag]
        for flag in RECORDED_FLAGS
        if getattr(settings, flag) is None and recorded.get(flag) is not None
    }
    if taken:
        values = ' '.join(f'--{flag} {value}' for flag, value in taken.items())
        lines.insert(0, f"from the checkpoint's run: {values} (a flag given overrides)")
    unknown = [flag for flag in RECORDED_FLAGS if flag not in recorded and getattr(settings, flag) is None]
    if unknown:
        lines.append(
            f'{settings.checkpoint} records no {" or ".join(f"--{flag}" for flag in unknown)} (a checkpoint of an '
            f"older version): drawn with {' and '.join(RECORDED_FLAGS[flag] for flag in unknown)}; pass the run's "
            'if it gave others'
        )
    if 'tokenizer' in taken and not Path(taken['tokenizer']).is_dir():
        raise GenerateError(
            f"--tokenizer: the checkpoint's run read captions with {taken['tokenizer']}, which is no folder here; "
            'pass the tokenizer folder'
        )
    return taken, lines


def names_the_same(given: str, recorded: str | None) -> bool:
    """Whether a flag given names what the record does: the same text, or the same folder (the record holds a
    tokenizer folder's absolute path)."""
    if given == recorded:
        return True
    return recorded is not None and Path(given).is_dir() and Path(given).resolve() == Path(recorded).resolve()


def main(args: argparse.Namespace):
    """Checks the flags, then writes the images and prints the scores asked for; returns the images (N, 3, H, W)
    in [0, 1]."""
    settings, prompts = check_args(args)
    # Imported once the flags check out, not at the top: torch and Diffusers take seconds to load, and --help or a
    # bad flag answers without them.
    from runs import generation

    # After that import: importing Composer installs its own signal handlers, which exit without a line.
    with stop_on_signals(lambda signum: f'{SIGNALS[signum]}: generate stopped; nothing was written to {args.out}'):
        if settings.checkpoint and settings.model_folder is None:  # no record beside the checkpoint: the one inside
            recorded = generation.recorded_in(settings.checkpoint, settings.trust_checkpoint)
            settings = settle_checkpoint_flags(settings, recorded)
        return generation.draw(settings, prompts)


def cli(argv=None) -> None:
    try:
        main(parse_args(argv))
    except ConfigError as error:
        print(f'error: {error}', file=sys.stderr)
        sys.exit(2)
    except LibraryChanged as error:  # an installed library whose patched names changed (guards/library_patches.py)
        print(f'error: {error}', file=sys.stderr)
        sys.exit(1)
    except Stopped as stopped:
        print(f'error: {stopped}', file=sys.stderr)
        sys.exit(stopped.exit_status)
    except OSError as error:  # a write that failed while drawing (a full disk): the partial folder removed
        print(f'error: {one_line(error)}', file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    cli()
