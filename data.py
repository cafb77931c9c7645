"""The datasets a run trains on: synthetic image-caption pairs or latents, and LAION-style Streaming (MDS) shards of
images and captions or of precomputed latents; how their samples are batched (`collate`), and the bad samples
counted (`BadSampleCounter`). The checks made before a run (dataset_checks.py) and Streaming's fixes
(streaming_fixes.py) live apart.

Every dataset yields dicts {'image': tensor (3, H, W), 'input_ids': long tensor (77,)}: captions as CLIP
token ids padded to the text encoder's 77 positions. For SDXL (see `CaptionInputs`) also 'input_ids_2' for its
second text encoder and 'time_ids', the image's size and crop (`images.size_conditions`). Synthetic images
are floats in [-1, 1], the VAE's input range; real images leave the loader as uint8 in [0, 255] and the model
maps them to [-1, 1] on its device (`images.unit_range`): a quarter of the bytes to batch, pin and copy, and no
float conversion in the loader, which at 512px cost more than the JPEG decode itself. The streaming dataset
adds 'sample_id' (the sample's position in the dataset) and 'bad_samples' (1 where a bad sample was
replaced), which the model ignores and `BadSampleCounter` logs.
"""

import logging
from collections import Counter

import torch
from composer.core import Callback
from composer.utils import dist
from torch.utils.data import Dataset, default_collate

from datapath.images import MAX_IMAGE_PIXELS, BadSample, decode_image, size_conditions
from datapath.streaming_fixes import CheckedStreamingDataset
from settings.dataset_checks import RETRIES, SDXL_PRECOMPUTED_COLUMNS, DataError
from settings.model_folder import CAPTION_LENGTH, T5_VOCAB_SIZE, CaptionInputs
from settings.tokenizer import CaptionTokenizer, column_tokenizers, empty_caption_ids

log = logging.getLogger(__name__)


def synthetic_size_conditions(size: int, generator: torch.Generator) -> torch.Tensor:
    """Plausible micro-conditioning for a synthetic image: an original of 1 to 2x the target on each side,
    center-cropped after resizing the shorter side to the target."""
    height, width = (int(v) for v in torch.randint(size, 2 * size + 1, (2,), generator=generator))
    scale = size / min(height, width)
    top, left = round((height - min(height, width)) / 2 * scale), round((width - min(height, width)) / 2 * scale)
    return torch.tensor([height, width, top, left, size, size], dtype=torch.float32)


class SyntheticDataset(Dataset):
    """Random samples that depend only on (seed, index), so every run, worker count and rank split sees the
    same data; the distributed sampler that splits indices across ranks comes from Composer."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def generator(self, index: int) -> torch.Generator:
        if not 0 <= index < self.num_samples:
            raise IndexError(f'index {index} out of range for {self.num_samples} synthetic samples')
        return torch.Generator().manual_seed(self.seed * 1_000_003 + index)


class SyntheticImageCaptionDataset(SyntheticDataset):
    """Random images in [-1, 1] and random caption token ids (each column's length, below its vocabulary size), as in
    the published benchmark. `tokenizer` (--tokenizer) gives only the empty caption (caption dropout)."""

    def __init__(
        self,
        image_size: int,
        num_samples: int = 100_000,
        seed: int = 17,
        inputs: CaptionInputs = CaptionInputs(),
        tokenizer: str | None = None,
    ):
        super().__init__(num_samples, seed)
        self.image_size = image_size
        self.inputs = inputs
        self.tokenizer = tokenizer

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = self.generator(index)
        sample = {'image': torch.rand(3, self.image_size, self.image_size, generator=generator) * 2 - 1}
        inputs = self.inputs
        for column, length, vocab_size in zip(inputs.id_columns, inputs.lengths, inputs.vocab_sizes, strict=True):
            sample[column] = torch.randint(0, vocab_size, (length,), generator=generator)
        if self.inputs.size_conditions:
            sample['time_ids'] = synthetic_size_conditions(self.image_size, generator)
        return sample

    def empty_caption_ids(self) -> dict[str, torch.Tensor]:
        """The ids of '' in each caption column, which caption dropout trains on. Random captions need no tokenizer,
        so none is held: CLIP's columns tokenize it here (--tokenizer's, or the built-in one where a T5 encoder is
        beside them), and T5's follow its convention, as a synthetic run needs no T5 tokenizer."""
        inputs = self.inputs
        clip_tokenizer = None if inputs.uses_t5 else self.tokenizer
        return {
            column: empty_caption_ids(pad, length)
            if vocab_size == T5_VOCAB_SIZE
            else CaptionTokenizer(clip_tokenizer, pad)('')
            for column, pad, length, vocab_size in zip(
                inputs.id_columns, inputs.pad_ids, inputs.lengths, inputs.vocab_sizes, strict=True
            )
        }


class SyntheticLatentsDataset(SyntheticDataset):
    """Random precomputed-style samples: a latent distribution (mean, log-variance) and a text embedding,
    fp16 as precompute.py stores them. Trains the UNet alone, as from real precomputed data, with no VAE
    or text encoder anywhere."""

    def __init__(
        self,
        latent_channels: int,
        latent_size: int,
        embedding_dim: int,
        num_samples: int = 100_000,
        seed: int = 17,
        caption_length: int = CAPTION_LENGTH,
        pooled_dim: int | None = None,
        size_conditions: bool = False,
    ):
        super().__init__(num_samples, seed)
        self.shape = (latent_channels, latent_size, latent_size)
        self.embedding_shape = (caption_length, embedding_dim)
        self.pooled_dim = pooled_dim  # SDXL, Flux, SD3: the pooled text embedding's width
        self.size_conditions = size_conditions  # SDXL: the image's size and crop

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = self.generator(index)
        # About the spread of SD's VAE latents before scaling (scaling_factor 0.18215 makes them unit variance).
        mean = torch.randn(self.shape, generator=generator) * 5
        logvar = torch.full(self.shape, -10.0)
        text_embedding = torch.randn(self.embedding_shape, generator=generator)
        sample = {'latent_mean': mean.half(), 'latent_logvar': logvar.half(), 'text_embedding': text_embedding.half()}
        if self.pooled_dim:
            sample['pooled_text_embedding'] = torch.randn(self.pooled_dim, generator=generator).half()
        if self.size_conditions:
            sample['time_ids'] = synthetic_size_conditions(self.shape[-1] * 8, generator)
        return sample


class ImageCaptionSample:
    """A raw sample of convert.py's columns (`jpg` image bytes, `caption` text) as the model takes it: the image
    decoded and resized (images.decode_image), the caption as token ids in each caption column, and for SDXL the
    image's size and crop. Raises BadSample for a sample that cannot be trained on. The training and validation
    datasets both read samples through it."""

    def __init__(
        self,
        image_size: int,
        tokenizer: str | None = None,
        inputs: CaptionInputs = CaptionInputs(),
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        self.image_size, self.inputs, self.max_image_pixels = image_size, inputs, max_image_pixels
        self.tokenizers = column_tokenizers(tokenizer, inputs)

    def __call__(self, raw: dict) -> dict:
        caption = raw.get('caption')
        if not isinstance(caption, str):
            raise BadSample('missing or non-string caption', f'got {type(caption).__name__}')
        sample = {'image': decode_image(raw.get('jpg'), self.image_size, self.max_image_pixels)}
        sample.update(self.caption_ids(caption))
        if self.inputs.size_conditions:
            sample['time_ids'] = size_conditions(raw['jpg'], self.image_size)
        return sample

    def caption_ids(self, caption: str) -> dict[str, torch.Tensor]:
        return {column: tokenize(caption) for column, tokenize in self.tokenizers.items()}


# -------------------------------------------------------------------------------- streaming datasets


class StreamingLAIONDataset(CheckedStreamingDataset):
    """LAION-style MDS shards, columns `jpg` (raw image bytes) and `caption` (str), streamed from `remote`
    (s3://..., another Streaming remote, or a folder) through the cache folder `local`, or read from `local`.

    Bad samples (empty, truncated, corrupt or non-image bytes, decompression bombs, missing or non-string
    captions) are replaced by the next good sample in the dataset, so the same position always gets the
    same data; each is logged once with its shard and row and counted in 'bad_samples'. More than
    `max_bad_fraction` bad samples (after 32 reads), or 100 in a row, stop the run with DataError.

    `batch_size` (per device) is what makes Streaming's mid-epoch resumption deterministic; Composer
    saves and restores the position itself. Streaming splits samples over ranks and workers itself.
    """

    MIN_READS = 32
    MAX_REPLACEMENTS = 100

    def __init__(
        self,
        *,
        remote: str | None = None,
        local: str | None = None,
        image_size: int = 512,
        tokenizer: str | None = None,
        inputs: CaptionInputs = CaptionInputs(),
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 17,
        download_retry: int = RETRIES,
        download_timeout: float | None = None,  # the read timeout in force (dataset_checks.read_timeout)
        max_bad_fraction: float = 0.5,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        keep_caption: bool = False,
        **streaming_kwargs,
    ):
        self.max_bad_fraction = max_bad_fraction
        self.keep_caption = keep_caption  # precompute.py stores the caption beside its embedding
        self.to_sample = ImageCaptionSample(image_size, tokenizer, inputs, max_image_pixels)
        super().__init__(
            remote=remote,
            local=local,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            download_retry=download_retry,
            download_timeout=download_timeout,
            **streaming_kwargs,
        )
        self._reads = 0
        self._bad = Counter()  # reason -> count, over this process's reads
        self._reported = set()

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        failures = []
        for offset in range(self.MAX_REPLACEMENTS + 1):
            index = (sample_id + offset) % self.num_samples
            try:
                sample = self.transform(super().get_item(index, retry))
                break
            except BadSample as error:
                failures.append((index, error))
        else:
            raise DataError(
                f'{self.location}: {len(failures)} bad samples in a row from sample {sample_id}, '
                f'e.g. {self.where(failures[0][0])}: {failures[0][1]}'
            )
        self._reads += 1
        if failures:
            self._bad[failures[0][1].kind] += 1
            for bad, reason in failures:
                if bad not in self._reported:
                    self._reported.add(bad)
                    log.warning(f'bad sample {self.where(bad)}: {reason}; trained on sample {index} instead')
            if self._reads >= self.MIN_READS and sum(self._bad.values()) > self.max_bad_fraction * self._reads:
                raise DataError(
                    f'{self.location}: {sum(self._bad.values())} of the {self._reads} samples read '
                    f'are bad ({dict(self._bad)}): check the dataset (convert.py skips bad samples)'
                )
        sample['sample_id'] = sample_id
        sample['bad_samples'] = int(bool(failures))
        return sample

    def empty_caption_ids(self) -> dict[str, torch.Tensor]:
        """The ids of '' in each caption column, by the tokenizers this dataset reads its captions with: what caption
        dropout trains on."""
        return self.to_sample.caption_ids('')

    def transform(self, raw: dict) -> dict:
        sample = self.to_sample(raw)
        if self.keep_caption:
            sample['caption'] = raw['caption']
        return sample


class PrecomputedLatentsDataset(CheckedStreamingDataset):
    """MDS shards written by precompute.py, streamed like StreamingLAIONDataset (same remotes, caches,
    resumption). Samples: 'latent_mean', 'latent_logvar' (C, H/8, W/8) and 'text_embedding' (tokens, D), fp16;
    for SDXL also 'pooled_text_embedding' (D2,) and 'time_ids' (6,); for Flux and SD3 'pooled_text_embedding', for
    PixArt 'text_mask' (tokens,)."""

    precomputed = True
    COLUMNS = ('latent_mean', 'latent_logvar', 'text_embedding', *SDXL_PRECOMPUTED_COLUMNS, 'text_mask')

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        raw = super().get_item(sample_id, retry)
        return {name: torch.tensor(raw[name]) for name in self.COLUMNS if name in raw}


def collate(samples: list[dict]) -> dict:
    """default_collate, with images stacked in their memory order (height, width, channels): a plain copy
    rather than a transposing one, 5-10x cheaper at 512px. The batch is still (B, 3, H, W), channels last
    in memory; `unit_range` makes it contiguous again on the model's device."""
    batch = default_collate([{**sample, 'image': sample['image'].permute(1, 2, 0)} for sample in samples])
    batch['image'] = batch['image'].permute(0, 3, 1, 2)
    return batch


class BadSampleCounter(Callback):
    """Logs data/bad_samples, the reads replaced so far, and at the end data/bad_samples_distinct, how many
    samples they were (a bad sample is read again every epoch), both summed over ranks. A replaced read's
    'sample_id' is the bad sample's own position: the first sample tried is the one asked for."""

    def __init__(self):
        self.total = 0
        self.distinct: set[int] = set()  # this rank's, gathered at the end

    def after_dataloader(self, state, logger) -> None:
        if not isinstance(state.batch, dict) or 'bad_samples' not in state.batch:
            return
        replaced = state.batch['bad_samples'].bool()  # still on the CPU at this event
        self.distinct.update(state.batch['sample_id'][replaced].tolist())
        count = replaced.sum()
        if dist.get_world_size() > 1:
            count = state.device.tensor_to_device(count)  # NCCL reduces GPU tensors only
            dist.all_reduce(count)
        self.total += int(count)
        logger.log_metrics({'data/bad_samples': self.total})

    def fit_end(self, state, logger) -> None:
        distinct = set().union(*dist.all_gather_object(self.distinct))
        logger.log_metrics({'data/bad_samples_distinct': len(distinct)})

    def state_dict(self) -> dict:
        return {'total': self.total, 'distinct': sorted(self.distinct)}

    def load_state_dict(self, state: dict) -> None:
        self.total = state['total']
        self.distinct = set(state.get('distinct', ()))  # checkpoints written before distinct was kept: none
