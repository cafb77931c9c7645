"""The data a run reads, settled before anything is built: the training dataset (--use_synth_data, the sample
dataset written on first use, or --remote/--local read through its index), the batches of an epoch of it, the image
size precomputed latents were made at, the held-out split the validation loss runs on, and the split's first
captions as the sample grids' prompts. config.py's `resolve_config` calls these steps in its order; nothing here
reads a sample's bytes beyond an index and the first shard (dataset_checks.py)."""

import argparse
from pathlib import Path

from guards.arguments import ConfigError
from settings.dataset_checks import DataError, DatasetDescription, describe_dataset, first_captions, is_remote
from settings.durations import parse_duration, parse_interval
from settings.families import FAMILIES
from settings.model_folder import (
    LATENT_DOWNSAMPLE,
    pooled_text_width,
    text_shapes,
)
from settings.presets import (
    SAMPLE_DATASET,
    SAMPLE_PROMPTS,
    SAMPLE_SIZE,
    SAMPLE_VALIDATION_DATASET,
    SAMPLE_VALIDATION_SIZE,
)

# convert.py --validation_fraction writes its held-out split in this folder of the training data's
# (convert.VALIDATION_SPLIT; named here rather than imported, which would load PIL and tqdm for every flag check).
CONVERTED_VALIDATION_SPLIT = 'validation'


def check_data_flags(draft: argparse.Namespace) -> None:
    """The data flags together: synthetic data or a dataset, and what precomputed latents leave out."""
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


def read_data(draft: argparse.Namespace) -> DatasetDescription | None:
    """Which dataset, read before the batch is planned: a dataset's description (its samples, where it is, what
    identifies it), and for precomputed latents the image size they were made at, which the run trains at and the
    microbatch is planned for. None for random tensors and the sample dataset (the run writes it on first use)."""
    draft.sample_data = not (draft.use_synth_data or draft.remote or draft.local)
    draft.epoch_size = draft.dataset_identity = None
    if draft.use_synth_data or draft.sample_data:
        return None
    try:
        dataset = describe_dataset(draft.remote, draft.local, precomputed=draft.precomputed_latents)
    except DataError as error:
        raise ConfigError(str(error))
    draft.dataset_identity = dataset.identity
    if draft.precomputed_latents:
        settle_precomputed_shapes(draft, dataset)
    return dataset


def settle_epoch(draft: argparse.Namespace, dataset: DatasetDescription | None) -> int | None:
    """Once the batch is settled: the sample dataset's epoch, and the batches of an epoch of real data. Returns the
    samples of an epoch (None for random tensors)."""
    if draft.use_synth_data:
        return None
    duration = parse_duration(draft.max_duration)
    if draft.sample_data:
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
        num_samples, location = dataset.num_samples, dataset.location
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
    return num_samples


def settle_precomputed_shapes(draft: argparse.Namespace, dataset: DatasetDescription) -> None:
    """The stored shapes must fit this model's denoiser; the image size is the one the data was precomputed at."""
    folder = draft.model_folder
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
        # Ours, written by the run before it builds its evaluators (run.write_sample_datasets): nothing to read.
        draft.eval_local, draft.sample_validation = str(SAMPLE_VALIDATION_DATASET), True
        draft.notes.append(
            f"validation loss on the sample dataset's held-out split {draft.eval_local} ({SAMPLE_VALIDATION_SIZE} "
            f'images) every {draft.eval_interval}, at the start and at the end (--eval_interval 0: never)'
        )
        return
    check_validation_split(draft, found)


def check_validation_split(draft: argparse.Namespace, found: bool) -> None:
    """A split given, or `found` beside the training data: read through its index, with samples, at the run's
    image size."""
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
