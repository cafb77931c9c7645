"""The data a run reads, settled before the batch is planned: the training dataset (--use_synth_data, the sample
dataset written on first use, or --remote/--local read through its index), the sample dataset's epoch, the image
size precomputed latents were made at, the held-out split the validation loss runs on, and the split's first
captions as the sample grids' prompts. config.py's `resolve_config` calls these in its order; nothing here reads a
sample's bytes beyond an index and the first shard (dataset_checks.py), but the check that the held-out split's
images are not trained on (split_overlap.py)."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from guards.arguments import ConfigError
from settings.dataset_checks import DataError, DatasetDescription, describe_dataset, first_captions, is_remote
from settings.durations import batches_of, parse_duration, parse_interval
from settings.families import FAMILIES
from settings.model_folder import LATENT_DOWNSAMPLE, ModelFolder, pooled_text_width, text_shapes
from settings.presets import (
    SAMPLE_DATASET,
    SAMPLE_PROMPTS,
    SAMPLE_SIZE,
    SAMPLE_VALIDATION_DATASET,
    SAMPLE_VALIDATION_SIZE,
)
from settings.split_overlap import check_split_overlap

# convert.py --validation_fraction writes its held-out split in this folder of the training data's
# (convert.VALIDATION_SPLIT; named here rather than imported, which would load PIL and tqdm for every flag check).
CONVERTED_VALIDATION_SPLIT = 'validation'


def check_image_size(image_size: int) -> None:
    if image_size <= 0 or image_size % LATENT_DOWNSAMPLE:
        raise ConfigError(
            f'--image_size {image_size}: must be a positive multiple of {LATENT_DOWNSAMPLE} '
            f'(the VAE downsamples {LATENT_DOWNSAMPLE}x)'
        )


@dataclass(frozen=True)
class TrainingData:
    """What the run trains on, read before the batch is planned (config.settle_data makes the data section of it)."""

    sample_data: bool  # no dataset given: the generated sample dataset at `local`, written on first use
    local: str | None
    image_size: int  # with precomputed latents: the size the data was precomputed at
    epoch_size: int | None  # samples per epoch of the sample dataset (None: the whole dataset)
    # The dataset's description (its samples, where it is, what identifies it); None for random tensors and the
    # sample dataset
    dataset: DatasetDescription | None


def read_training_data(flags: argparse.Namespace, model_name: str, folder: ModelFolder, notes: list) -> TrainingData:
    """The training data: precomputed latents fix the image size the run trains at, and the microbatch is planned
    for. The sample dataset's epoch spans the whole run. The data flags were checked together (check_data_flags)."""
    sample_data = not (flags.use_synth_data or flags.remote or flags.local)
    local, image_size, epoch_size, dataset = flags.local, flags.image_size, None, None
    if sample_data:
        local, epoch_size = str(SAMPLE_DATASET), sample_epoch(flags)
        notes.append(
            f'no --remote/--local given: training on the sample dataset {local} ({SAMPLE_SIZE} generated JPEGs '
            'with captions, built on first use); --use_synth_data trains on random tensors as published'
        )
    elif not flags.use_synth_data:
        try:
            dataset = describe_dataset(flags.remote, flags.local, precomputed=flags.precomputed_latents)
        except DataError as error:
            raise ConfigError(str(error))
        if flags.precomputed_latents:
            image_size = precomputed_image_size(model_name, folder, dataset, image_size, notes)
    check_image_size(image_size)  # a preset's, or one given (checked as given already)
    precomputed = flags.precomputed_latents and dataset is not None
    where = f'{dataset.location}: latents of {image_size}px' if precomputed else f'--image_size {image_size}'
    check_model_takes_size(model_name, folder, image_size, where)
    return TrainingData(sample_data, local, image_size, epoch_size, dataset)


def check_data_flags(flags: argparse.Namespace) -> None:
    """The data flags together: synthetic data or a dataset, and what precomputed latents leave out."""
    if flags.use_synth_data and (flags.remote or flags.local):
        raise ConfigError(
            '--use_synth_data trains on random tensors: leave out --remote/--local, or drop --use_synth_data'
        )
    if flags.precomputed_latents and not (flags.use_synth_data or flags.remote or flags.local):
        raise ConfigError(
            '--precomputed_latents needs a dataset written by precompute.py (--local DIR or --remote URL; '
            'e.g. python precompute.py --out data/sample-latents, then --local data/sample-latents), '
            'or --use_synth_data for random latents'
        )
    if flags.precomputed_latents and flags.encoders_bf16:
        raise ConfigError('--encoders_bf16: with --precomputed_latents there is no VAE or text encoder to keep in bf16')
    if flags.precomputed_latents and flags.tokenizer:
        raise ConfigError(
            '--tokenizer: precomputed captions are already embeddings (choose the tokenizer in precompute.py)'
        )


def sample_epoch(flags: argparse.Namespace) -> int:
    """The sample dataset's epoch: a few hundred images, so one epoch spans the whole run (at least one global
    batch), repeating samples."""
    batches = batches_of(parse_duration(flags.max_duration), flags.batch_size)  # None: a run of epochs
    wanted = flags.batch_size * (batches or 1)
    return -(-max(wanted, SAMPLE_SIZE) // flags.batch_size) * flags.batch_size


def check_model_takes_size(model_name: str, folder: ModelFolder, image_size: int, what: str) -> None:
    """A diffusion transformer reads 2x2 patches of the latents, and its position embedding has a largest size;
    `what` names where the size comes from."""
    if not folder.is_transformer:
        return
    patch = LATENT_DOWNSAMPLE * 2  # Flux's 2x2 latent packing, SD3's and PixArt's 2x2 patches
    if image_size % patch:
        raise ConfigError(f'{what}: {model_name} takes multiples of {patch}')
    transformer = folder.denoiser_config
    if image_size // patch > transformer.get('pos_embed_max_size', float('inf')):
        largest = transformer['pos_embed_max_size'] * patch
        raise ConfigError(f'{what}: {model_name} takes at most {largest}px')


def precomputed_image_size(
    name: str, folder: ModelFolder, dataset: DatasetDescription, image_size: int, notes: list
) -> int:
    """The size precomputed latents were made at, which the run trains at; their shapes must fit the model's
    denoiser."""
    denoiser = folder.denoiser_config
    if folder.is_transformer:
        shapes = text_shapes(folder.family, denoiser, FAMILIES[folder.family].t5_caption_length)
        expected_channels = folder.vae_config['latent_channels']
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
            f"{dataset.embedding_length} x {dataset.embedding_width}, but {name}'s {kind} takes "
            f'{expected_channels} and {expected_length} x {expected_width}: precompute it with the same --model_name'
        )
    if pooled != dataset.pooled_width:
        raise ConfigError(
            f'{dataset.location}: '
            + (
                f"no pooled text embedding of width {pooled}, which {name}'s {kind} takes"
                if dataset.pooled_width is None
                else f"a pooled text embedding, which {name}'s {kind} does not take"
            )
            + ': precompute it with the same --model_name'
        )
    if height != width:
        raise ConfigError(f'{dataset.location}: latents of {height}x{width}; square ones expected')
    if kind == 'transformer' and height % 2:
        raise ConfigError(
            f'{dataset.location}: latents of {height}x{width} ({height * LATENT_DOWNSAMPLE}px), but '
            f'{name} reads 2x2 patches of them: precompute at a multiple of 16 pixels'
        )
    if height * LATENT_DOWNSAMPLE != image_size:
        notes.append(
            f'--image_size {image_size}: the data was precomputed at {height * LATENT_DOWNSAMPLE}px, which is what '
            'this run trains at'
        )
    return height * LATENT_DOWNSAMPLE


@dataclass(frozen=True)
class ValidationSplit:
    """The held-out split the validation loss runs on, and how often (evaluation section's fields)."""

    eval_local: str | None
    eval_remote: str | None
    eval_interval: str | None  # None: no validation
    sample_validation: bool  # eval_local is the sample dataset's held-out split, written on first use


def settle_validation_split(
    flags: argparse.Namespace, sample_data: bool, image_size: int, num_batches: int, notes: list
) -> ValidationSplit:
    """The held-out split: --eval_local/--eval_remote; or the one convert.py --validation_fraction wrote in the
    training folder; or with the sample dataset its own held-out split (written on first use); and when the
    validation loss runs (see --eval_interval)."""
    local, remote = flags.eval_local, flags.eval_remote
    if local and remote:
        raise ConfigError('--eval_local and --eval_remote: give one (a folder, or a remote copied whole)')
    if remote and not is_remote(remote):
        local, remote = remote, None  # a bare folder is read in place
    given = bool(local or remote)
    interval = flags.eval_interval
    if interval is None:  # with a split given, at the start and the end; otherwise never
        interval = f'{num_batches}ba' if given else '0'
    interval = parse_interval('--eval_interval', interval)
    if not interval:
        return ValidationSplit(local, remote, None, False)
    found = not given and not sample_data
    if found:
        local = converted_validation_split(flags.remote or flags.local)
        if local is None:
            raise ConfigError(
                '--eval_interval: no held-out split to validate on: pass --eval_local DIR or --eval_remote URL '
                '(an MDS dataset written by convert.py, or by precompute.py with --precomputed_latents), or convert '
                f'with --validation_fraction, which writes one in the output folder ({CONVERTED_VALIDATION_SPLIT}/)'
            )
    elif not given:
        # Ours, written by the run before it builds its evaluators (run.write_sample_datasets): nothing to read.
        notes.append(
            f"validation loss on the sample dataset's held-out split {SAMPLE_VALIDATION_DATASET} "
            f'({SAMPLE_VALIDATION_SIZE} images) every {interval}, at the start and at the end (--eval_interval 0: '
            'never)'
        )
        return ValidationSplit(str(SAMPLE_VALIDATION_DATASET), None, interval, True)
    split = ValidationSplit(local, remote, interval, False)
    check_validation_split(split, flags.precomputed_latents, image_size, found, notes)
    if flags.use_synth_data or not (flags.remote or flags.local):  # no images, or the sample dataset's own
        return split
    training = flags.local if flags.remote is None else None if is_remote(flags.remote) else flags.remote
    not_checked = None
    if training is None or remote:
        not_checked = 'a remote dataset'
    elif flags.precomputed_latents:
        not_checked = 'precomputed latents'
    if not_checked:
        notes.append(f'validation split {remote or local}: not checked for images the run trains on ({not_checked})')
    else:
        check_split_overlap(training, local, notes)
    return split


def check_validation_split(
    split: ValidationSplit, precomputed: bool, image_size: int, found: bool, notes: list
) -> None:
    """A split given, or `found` beside the training data: read through its index, with samples, at the run's
    image size."""
    try:
        read = describe_dataset(split.eval_remote, split.eval_local, precomputed=precomputed)
    except DataError as error:
        raise ConfigError(f'--eval_{"interval" if found else "remote" if split.eval_remote else "local"}: {error}')
    if read.num_samples == 0:
        raise ConfigError(f'--eval_local/--eval_remote {read.location}: the split holds no samples')
    if found:
        notes.append(
            f'validation loss on {read.location} ({read.num_samples} images), the held-out split found beside the '
            f'training data (where convert.py --validation_fraction writes one), every {split.eval_interval}, at the '
            'start and at the end (--eval_local/--eval_remote: another split; --eval_interval 0: never)'
        )
    if read.latent_shape is not None and read.latent_shape[-1] * LATENT_DOWNSAMPLE != image_size:
        raise ConfigError(
            f'{read.location}: validation latents precomputed at {read.latent_shape[-1] * LATENT_DOWNSAMPLE}px, '
            f'but the run trains at {image_size}px: precompute the split at the same size'
        )


def converted_validation_split(folder: str | None) -> str | None:
    """The held-out split convert.py --validation_fraction wrote in the training folder, when the run reads that
    folder in place (--local alone, or --remote naming a folder). Not looked for on a remote, where telling a
    missing split from an unreachable server would cost a round of retries: pass it as --eval_remote."""
    if folder is None or is_remote(folder):  # --use_synth_data, or a remote
        return None
    split = Path(folder) / CONVERTED_VALIDATION_SPLIT
    return str(split) if (split / 'index.json').is_file() else None


def held_out_prompts(sample_interval: str | None, split: ValidationSplit, precomputed: bool, notes: list) -> tuple:
    """A run with sample grids and a held-out split of its own (a local folder of captions) draws the split's
    first captions: prompts of the data it trains on, none of them trained on. The sample dataset's shapes
    otherwise."""
    if not (sample_interval and split.eval_local) or split.sample_validation or precomputed:
        return ()
    prompts = first_captions(split.eval_local, len(SAMPLE_PROMPTS))
    if prompts:
        notes.append(
            f'sample grids: the first {len(prompts)} captions of the held-out split {split.eval_local} '
            '(--sample_prompts FILE: others)'
        )
    return prompts
