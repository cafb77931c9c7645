"""Datasets for the benchmark: synthetic image-caption pairs, and LAION-style Streaming (MDS) shards, with
the checks of a dataset's location and index made before a run builds anything (`describe_dataset`).

Every dataset yields dicts {'image': tensor (3, H, W), 'input_ids': long tensor (77,)}: captions as CLIP
token ids padded to the text encoder's 77 positions. For SDXL (see `CaptionInputs`) also 'input_ids_2' for its
second text encoder and 'time_ids', the image's size and crop (`images.size_conditions`). Synthetic images
are floats in [-1, 1], the VAE's input range; real images leave the loader as uint8 in [0, 255] and the model
maps them to [-1, 1] on its device (`images.unit_range`): a quarter of the bytes to batch, pin and copy, and no
float conversion in the loader, which at 512px cost more than the JPEG decode itself. The streaming dataset
adds 'sample_id' (the sample's position in the dataset) and 'bad_samples' (1 where a bad sample was
replaced), which the model ignores and `BadSampleCounter` logs.
"""

import atexit
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from boto3.s3.transfer import TransferConfig
from composer.core import Callback
from composer.utils import dist
from streaming import StreamingDataset
from streaming.base import dataset as streaming_dataset
from streaming.base import util as streaming_util
from streaming.base.compression import decompress
from streaming.base.dataset import _ShardState
from streaming.base.format import reader_from_json
from streaming.base.shared.prefix import _get_path, get_shm_prefix
from streaming.base.storage import download as streaming_download
from streaming.base.storage.download import CloudDownloader, S3Downloader
from torch.utils.data import Dataset, default_collate

from images import MAX_IMAGE_PIXELS, BadSample, decode_image, size_conditions
from tokenizer import CAPTION_LENGTH, CLIP_PAD_ID, CLIP_VOCAB_SIZE, CaptionTokenizer

log = logging.getLogger(__name__)
# Remote reads (index, shards): a connection must open within 10 s and each read return data within 20 s, with
# 2 retries after backoff (botocore's standard mode; Streaming's download_retry): a server that is down or
# hung is reported in about a minute, not after minutes of silence.
CONNECT_TIMEOUT, READ_TIMEOUT, RETRIES = 10, 20, 2


class S3DownloaderOneTransferAttempt(S3Downloader):
    """Streaming's S3 downloader, less the retries it inherits from boto3. s3transfer retries a GET whose body
    stops arriving 5 times (TransferConfig's default, kept by Streaming), inside each of Streaming's tries, and
    botocore retries each request (AWS_MAX_ATTEMPTS, see CheckedStreamingDataset): a server that hung in the
    middle of a download was reported after up to 15 reads of 20 s (seen: 122 s, not the 55 s of a hang between
    downloads). One attempt in each leaves Streaming's download_retry the only retries."""

    def _create_s3_client(self, *args, **kwargs) -> None:
        super()._create_s3_client(*args, **kwargs)
        download_file = self._s3_client.download_file

        def download_file_once(*args, Config=None, **kwargs):  # noqa: N803 (boto3's name)
            Config = Config or TransferConfig()  # noqa: N806
            Config.num_download_attempts = 1
            return download_file(*args, Config=Config, **kwargs)

        self._s3_client.download_file = download_file_once


streaming_download.DOWNLOADER_MAPPINGS[S3Downloader._client_identifier()] = S3DownloaderOneTransferAttempt


@dataclass(frozen=True)
class CaptionInputs:
    """What a model's batches carry beside the image: one column of caption token ids per text encoder, padded
    with that encoder's pad id ('input_ids', 'input_ids_2'), and for SDXL 'time_ids' (size and crop)."""

    pad_ids: tuple[int, ...] = (CLIP_PAD_ID,)
    size_conditions: bool = False

    @property
    def id_columns(self) -> list[str]:
        return ['input_ids'] + [f'input_ids_{n}' for n in range(2, len(self.pad_ids) + 1)]


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
    """Random images in [-1, 1] and random caption token ids, as in the published benchmark."""

    def __init__(
        self,
        image_size: int,
        num_samples: int = 100_000,
        seed: int = 17,
        vocab_size: int = CLIP_VOCAB_SIZE,
        caption_length: int = CAPTION_LENGTH,
        inputs: CaptionInputs = CaptionInputs(),
    ):
        super().__init__(num_samples, seed)
        self.image_size = image_size
        self.vocab_size = vocab_size
        self.caption_length = caption_length
        self.inputs = inputs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = self.generator(index)
        sample = {'image': torch.rand(3, self.image_size, self.image_size, generator=generator) * 2 - 1}
        for column in self.inputs.id_columns:
            sample[column] = torch.randint(0, self.vocab_size, (self.caption_length,), generator=generator)
        if self.inputs.size_conditions:
            sample['time_ids'] = synthetic_size_conditions(self.image_size, generator)
        return sample


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
    ):
        super().__init__(num_samples, seed)
        self.shape = (latent_channels, latent_size, latent_size)
        self.embedding_shape = (caption_length, embedding_dim)
        self.pooled_dim = pooled_dim  # SDXL: its pooled text embedding's width, and size/crop conditioning

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = self.generator(index)
        # About the spread of SD's VAE latents before scaling (scaling_factor 0.18215 makes them unit variance).
        mean = torch.randn(self.shape, generator=generator) * 5
        logvar = torch.full(self.shape, -10.0)
        text_embedding = torch.randn(self.embedding_shape, generator=generator)
        sample = {'latent_mean': mean.half(), 'latent_logvar': logvar.half(), 'text_embedding': text_embedding.half()}
        if self.pooled_dim:
            sample['pooled_text_embedding'] = torch.randn(self.pooled_dim, generator=generator).half()
            sample['time_ids'] = synthetic_size_conditions(self.shape[-1] * 8, generator)
        return sample


class DataError(RuntimeError):
    """The data cannot be trained on: an unreachable or missing dataset, or one that is mostly bad samples."""


# -------------------------------------------------------------------------------- streaming dataset


class NodeStopEvent(threading.Event):
    """Streaming's stop event for the threads of one loader worker, which also reads as set once a failure is
    recorded at `failure_path` by any worker or rank on the node (see CheckedStreamingDataset._record_failure).
    Streaming's threads and yield loop poll is_set, so they stop within a tick."""

    def __init__(self, failure_path: str):
        super().__init__()
        self.failure_path = failure_path

    def is_set(self) -> bool:
        return super().is_set() or os.path.exists(self.failure_path)


def get_shm_prefix_one_job_at_a_time(streams_local, streams_remote, world, *args, **kwargs):
    """Streaming's get_shm_prefix, with a machine-wide lock held by each job's local leader. Streaming picks the
    first shared-memory prefix no other dataset uses, then creates its `_locals` entry: two jobs starting at the
    same moment could pick the same one, and the second then stopped with `FileExistsError: '/000105_locals'`.
    Under the lock the second job sees the first's entry and picks the next prefix. The other ranks of a job only
    look up their leader's entry, so they take no lock (and cannot block a barrier their leader waits at)."""
    if not world.is_local_leader:
        return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
    # Opened read-only, which flock needs no more than: another user's jobs share the file (made 0o666 less umask).
    lock = os.open(Path(tempfile.gettempdir()) / 'sd2-streaming-prefix.lock', os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
    finally:
        os.close(lock)


streaming_dataset.get_shm_prefix = get_shm_prefix_one_job_at_a_time  # where StreamingDataset looks it up


class CheckedStreamingDataset(StreamingDataset):
    """Streaming's dataset over a checked location (see resolve_location), whose shards must hold the columns
    the subclass reads; and a download that fails in its background threads (a remote that died, a shard
    gone from the cache) ends the iteration with DataError. Streaming 0.13 only stops yielding samples then, as
    at the end of an epoch, and Composer counts the epoch done: a run would end early, exit 0, and report a
    throughput. A failed download also no longer leaves its shard waited for forever (see prepare_shard). The
    thread methods and shard states used here are Streaming's own (private in the pinned version)."""

    precomputed = False  # which columns the shards must hold (check_columns)
    _background_error: BaseException | None = None

    def __init__(
        self,
        *,
        remote: str | None = None,
        local: str | None = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 17,
        download_retry: int = RETRIES,
        download_timeout: float = READ_TIMEOUT,
        **streaming_kwargs,
    ):
        remote, local = resolve_location(remote, local, download_retry, download_timeout)
        self.location = remote or local
        # Streaming's S3 client keeps botocore's own retries (3 tries of --download_timeout each) inside each of
        # its download_retry + 1 tries: 9 reads of 20 s before a hung server is reported. One botocore try per
        # Streaming try bounds it to 3 (AWS_MAX_ATTEMPTS, which botocore reads when its Config sets no count).
        os.environ.setdefault('AWS_MAX_ATTEMPTS', '1')
        super().__init__(
            remote=remote,
            local=local,
            batch_size=batch_size,
            shuffle=shuffle,
            shuffle_seed=seed,
            download_retry=download_retry,
            download_timeout=download_timeout,
            **streaming_kwargs,
        )
        for shard in self.shards:
            columns = getattr(shard, 'column_names', None)
            check_columns(self.location, shard.raw_data.basename, columns, self.precomputed)
        self._failure_path = os.path.join(self._filelock_root, _get_path(self._shm_prefix_int, 'read_failure'))
        if self._unique_rank_world.is_local_leader:  # one left by a run killed before it could remove it
            Path(self._failure_path).unlink(missing_ok=True)
            atexit.register(Path(self._failure_path).unlink, missing_ok=True)

    def _prepare_thread(self, it) -> None:
        self._keep_failure(super()._prepare_thread, it)

    def _ready_thread(self, it) -> None:
        self._keep_failure(super()._ready_thread, it)

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        if (failure := self._failure_elsewhere()) is not None:  # not one more download of a dead remote
            raise failure
        try:
            super().prepare_shard(shard_id, blocking)
        except BaseException as error:
            failure = None
            if isinstance(error, Exception):  # not Ctrl-C
                if self.streams[self.stream_per_shard[shard_id]].remote is None:  # nowhere to fetch it from
                    name = self.shards[shard_id].raw_data.basename
                    failure = DataError(
                        f'{self.location}: shard {name} is gone or unreadable; it was whole at start (deleted, '
                        'moved or cut short while the run read it?)'
                    )
                else:
                    failure = self._reading_failed(error)
                self._record_failure(failure)  # before the shard state changes, which wakes the waiting workers
            # Streaming leaves a shard whose download failed in its PREPARING state, and every thread or loader
            # worker that needs the shard waits for it forever (seen: runs hung at 0% CPU after a server died).
            # Marked remote again, they wake, find the failure recorded, and stop with it.
            if self._shard_states[shard_id] == _ShardState.PREPARING:
                self._shard_states[shard_id] = _ShardState.REMOTE
            if failure is None:
                raise
            raise failure from error

    def _keep_failure(self, thread, it) -> None:
        try:
            thread(it)
        except Exception as error:  # kept for __iter__, which names it; no thread traceback on the console
            self._background_error = error
            self._record_failure(self._reading_failed(error))
            self._event.set()  # as Streaming does on a thread's failure: the other threads and the yield loop stop
            # A thread that raises never reports its exit, and the iterator's exit() waited for it forever when
            # the yield loop ended first (seen: loader workers hung at 0% CPU after a server died).
            it.on_exit()

    def __iter__(self):
        if (failure := self._failure_elsewhere()) is not None:
            raise failure
        if not hasattr(self, '_event'):  # made here, in the loader worker, as Streaming makes its own
            self._event = NodeStopEvent(self._failure_path)
        yield from super().__iter__()
        # Streaming's yield loop ends quietly, as at the end of the epoch, when its event is set.
        if self._background_error is not None:
            raise self._reading_failed(self._background_error)
        if (failure := self._failure_elsewhere()) is not None:
            raise failure

    def get_item(self, sample_id: int, retry: int = 7):
        try:
            return super().get_item(sample_id, retry)
        except DataError:
            raise
        except Exception as error:  # a shard deleted or cut short since the checks at start, a failed download
            if self._background_error is not None:  # Streaming's get_item only says a thread failed
                failure = self._reading_failed(self._background_error)
            else:
                failure = self._failure_elsewhere() or self._reading_failed(error, sample_id)
            self._record_failure(failure)
            raise failure from error

    # A read that fails in one loader worker or rank must stop the others on the node at once. The loader hands
    # batches over in worker order, so the run waits on the next worker's batch, not on the one that failed; and
    # that worker, woken by the shard marked remote again, fetched it itself: against a hung server, a second
    # minute of timeouts before the run ended (seen: 123 s instead of 55 s). The first failure is kept in a file
    # beside Streaming's locks, named with its shared-memory prefix, so one per dataset per node.

    def _record_failure(self, failure: DataError) -> None:
        """Keep the first failure on the node; written whole, then linked, so no reader sees half a line."""
        partial = f'{self._failure_path}.{os.getpid()}.{threading.get_ident()}'
        Path(partial).write_text(str(failure))
        try:
            os.link(partial, self._failure_path)
        except FileExistsError:
            pass
        finally:
            os.remove(partial)

    def _failure_elsewhere(self) -> DataError | None:
        # Checked for every sample (prepare_shard): a stat while there is no failure, not an open that raises.
        if not os.path.exists(self._failure_path):
            return None
        try:
            return DataError(Path(self._failure_path).read_text())
        except FileNotFoundError:  # removed at exit in between
            return None

    def _reading_failed(self, error: BaseException, sample_id: int | None = None) -> DataError:
        if isinstance(error, DataError):
            return error
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ''
        if sample_id is None:
            return DataError(f'{self.location}: reading shards failed: {type(error).__name__}: {reason}')
        shard_id, row = self.spanner[sample_id]
        shard = self.shards[shard_id].raw_data.basename
        return DataError(f'{self.location}: reading shard {shard} (row {row}) failed: {type(error).__name__}: {reason}')

    def where(self, sample_id: int) -> str:
        shard_id, row = self.spanner[sample_id]
        return f'{sample_id} (shard {self.shards[shard_id].raw_data.basename}, row {row}, of {self.location})'


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
        download_timeout: float = READ_TIMEOUT,
        max_bad_fraction: float = 0.5,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        keep_caption: bool = False,
        **streaming_kwargs,
    ):
        self.image_size = image_size
        self.max_bad_fraction = max_bad_fraction
        self.max_image_pixels = max_image_pixels
        self.keep_caption = keep_caption  # precompute.py stores the caption beside its embedding
        self.inputs = inputs
        self.tokenizers = {
            column: CaptionTokenizer(tokenizer, pad_id) for column, pad_id in zip(inputs.id_columns, inputs.pad_ids)
        }
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

    def transform(self, raw: dict) -> dict:
        caption = raw.get('caption')
        if not isinstance(caption, str):
            raise BadSample('missing or non-string caption', f'got {type(caption).__name__}')
        sample = {'image': decode_image(raw.get('jpg'), self.image_size, self.max_image_pixels)}
        for column, tokenize in self.tokenizers.items():
            sample[column] = tokenize(caption)
        if self.inputs.size_conditions:
            sample['time_ids'] = size_conditions(raw['jpg'], self.image_size)
        if self.keep_caption:
            sample['caption'] = caption
        return sample


# precompute.py's output: the VAE's latent distribution and the text encoder's output, fp16, and the caption;
# for SDXL also the pooled text embedding and the size/crop conditioning.
PRECOMPUTED_COLUMNS = {
    'latent_mean': 'ndarray:float16',
    'latent_logvar': 'ndarray:float16',
    'text_embedding': 'ndarray:float16',
    'caption': 'str',
}
SDXL_PRECOMPUTED_COLUMNS = {'pooled_text_embedding': 'ndarray:float16', 'time_ids': 'ndarray:float32'}


class PrecomputedLatentsDataset(CheckedStreamingDataset):
    """MDS shards written by precompute.py, streamed like StreamingLAIONDataset (same remotes, caches,
    resumption). Samples: 'latent_mean', 'latent_logvar' (C, H/8, W/8) and 'text_embedding' (77, D), fp16;
    for SDXL also 'pooled_text_embedding' (D2,) and 'time_ids' (6,)."""

    precomputed = True
    COLUMNS = ('latent_mean', 'latent_logvar', 'text_embedding', *SDXL_PRECOMPUTED_COLUMNS)

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        raw = super().get_item(sample_id, retry)
        return {name: torch.tensor(raw[name]) for name in self.COLUMNS if name in raw}


def check_columns(location: str, shard: str, columns: list[str] | None, precomputed: bool) -> None:
    """A shard (MDS: it names its columns) holds what the dataset reads: images and captions as convert.py
    writes them, or the latents and embeddings precompute.py writes."""
    if columns is None:
        return
    if precomputed and not set(PRECOMPUTED_COLUMNS) - {'caption'} <= set(columns):
        raise DataError(
            f"{location}: shard {shard} has columns {columns}, not precompute.py's latent_mean, "
            'latent_logvar and text_embedding: for images and captions leave out --precomputed_latents'
        )
    if not precomputed and not {'jpg', 'caption'} <= set(columns):
        raise DataError(
            f'{location}: shard {shard} has columns {columns}; expected jpg (image bytes) and caption '
            '(text), as convert.py writes'
        )


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


# ---------------------------------------------------------------------------------------- locations

_instances = itertools.count()


def default_cache_dir(remote: str) -> str:
    """A fresh cache folder for a remote, one per job and dataset instance, removed at exit.

    Streaming's own default (tempdir/hash(remote)) refuses to start when that folder exists, as after a
    killed run. The ranks of a node must agree on the folder: they share the launcher (composer,
    torchrun) as parent, so its pid names the job. Folders of jobs no longer alive are removed here.
    """
    job = os.getppid() if int(os.environ.get('LOCAL_WORLD_SIZE', '1')) > 1 else os.getpid()
    root = Path(tempfile.gettempdir()) / 'sd2-streaming'
    folder = root / f'{job}-{next(_instances)}-{hashlib.blake2s(remote.encode(), digest_size=6).hexdigest()}'
    if int(os.environ.get('LOCAL_RANK', '0')) == 0:
        for old in root.glob('*-*-*'):
            if old.name.split('-')[0].isdigit() and not pid_alive(int(old.name.split('-')[0])):
                shutil.rmtree(old, ignore_errors=True)
        atexit.register(shutil.rmtree, folder, True)
    return str(folder)


def clean_stale_shared_memory() -> None:
    """Removes the shared memory of Streaming datasets whose processes died (a killed run's would block the next),
    and nothing else. Streaming's own clean_stale_shared_memory removes every dataset's on the machine, a live
    job's too: a second job starting beside a running one crashed (FileNotFoundError) or made it fail. On Linux
    a segment is stale when no process of ours maps it; elsewhere Streaming's cleaner runs. Local rank 0 cleans
    while the node's other ranks wait."""
    shm = Path('/dev/shm')
    if not (shm.is_dir() and Path('/proc/self/maps').is_file()):
        streaming_util.clean_stale_shared_memory()
        return
    if dist.get_local_rank() == 0:
        names = {path.name for path in shm.glob('[0-9]' * 6 + '_*') if path.stat().st_uid == os.getuid()}
        mapped = set()  # /proc/PID/maps lines end with the mapped file: ... /dev/shm/000000_locals
        for maps in Path('/proc').glob('[0-9]*/maps'):
            try:
                lines = [line for line in maps.read_text().splitlines() if '/dev/shm/' in line]
            except OSError:  # a process that ended, or another user's
                continue
            mapped.update(line.rsplit('/dev/shm/', 1)[1].split()[0] for line in lines)
        for name in names - mapped:
            (shm / name).unlink(missing_ok=True)
    dist.barrier()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def s3_client(timeout: float = READ_TIMEOUT, attempts: int = RETRIES + 1, unsigned: bool = False):
    """boto3 S3 client at S3_ENDPOINT_URL (any S3-compatible server) or AWS, with bounded retries."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        connect_timeout=min(timeout, CONNECT_TIMEOUT),
        read_timeout=timeout,
        retries={'mode': 'standard', 'total_max_attempts': attempts},
        signature_version=UNSIGNED if unsigned else None,
    )
    return boto3.session.Session().client('s3', endpoint_url=os.environ.get('S3_ENDPOINT_URL') or None, config=config)


def resolve_location(remote: str | None, local: str | None, retries: int, timeout: float) -> tuple[str | None, str]:
    """(remote, local) for Streaming, checked: a bare folder is read in place rather than copied to a cache,
    and a remote without a local folder gets a fresh cache folder of its own."""
    if remote is not None and not urllib.parse.urlparse(remote).scheme and local is None:
        remote, local = None, remote
    if remote is None and local is None:
        raise DataError('no dataset: pass a remote (s3://bucket/path) and/or a local folder')
    if remote is not None and local is None:
        local = default_cache_dir(remote)
    check_dataset(remote, local, retries=retries, timeout=timeout)
    return remote, local


def check_dataset(remote: str | None, local: str | None, retries: int = RETRIES, timeout: float = READ_TIMEOUT) -> None:
    """Fail fast with a message naming the dataset when its index.json cannot be read: a missing folder,
    bucket or prefix, or a server that is down (after `retries` retries), rather than deep inside Streaming."""
    if remote is None:
        if not (Path(local) / 'index.json').is_file():
            raise DataError(
                f'no Streaming dataset at {local}: {local}/index.json is missing (write one with convert.py)'
            )
        return
    url = urllib.parse.urlparse(remote)
    if url.scheme != 's3':
        return  # other Streaming remotes (gs://, oci://, hf://, ...) are checked by Streaming itself
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, key = url.netloc, '/'.join(part for part in (url.path.strip('/'), 'index.json') if part)
    endpoint = os.environ.get('S3_ENDPOINT_URL') or 'AWS'
    for unsigned in (False, True):
        client = s3_client(timeout, retries + 1, unsigned)
        try:
            client.head_object(Bucket=bucket, Key=key)
            return
        except NoCredentialsError:
            continue  # a public bucket: Streaming also falls back to unsigned requests
        except ClientError as error:
            code = error.response.get('Error', {}).get('Code', '')
            if code in ('404', 'NoSuchKey', 'NotFound'):
                try:
                    client.head_bucket(Bucket=bucket)
                except ClientError:
                    raise DataError(f'{remote}: bucket {bucket!r} does not exist on {endpoint}')
                raise DataError(
                    f'{remote}: no index.json under this prefix on {endpoint} (wrong prefix? '
                    'write shards with convert.py)'
                )
            raise DataError(f'{remote}: {endpoint} refused access ({code}): check the credentials')
        except BotoCoreError as error:
            raise DataError(f'{remote}: cannot reach the S3 server {endpoint} after {retries + 1} attempts: {error}')


def check_local_shards(location: str, folder: Path, shards: list[dict]) -> None:
    """Each shard of a local dataset is there, whole, and holds the samples index.json counts (an MDS shard's
    header says how many), so that a damaged dataset stops the run at start, naming the shard, instead of
    failing deep in a loader worker or training on a part of it."""
    for shard in shards:
        name, size = shard['raw_data']['basename'], shard['raw_data'].get('bytes')
        path = folder / name
        if not path.is_file():
            packed = (shard.get('zip_data') or {}).get('basename')
            if packed and (folder / packed).is_file():
                continue  # compressed: Streaming checks it against its hash as it decompresses
            raise DataError(f'{location}: shard {name} is missing (index.json lists it)')
        if size is not None and path.stat().st_size != size:
            raise DataError(
                f'{location}: shard {name} has {path.stat().st_size} bytes where index.json says {size} '
                '(truncated or rewritten?)'
            )
        if shard.get('format') == 'mds':
            with open(path, 'rb') as file:
                held = int.from_bytes(file.read(4), 'little')  # an MDS shard starts with its sample count
            if held != shard['samples']:
                raise DataError(
                    f'{location}: shard {name} holds {held} samples where index.json says {shard["samples"]}'
                )


@dataclass(frozen=True)
class DatasetDescription:
    """What a run must know of a dataset before it is built (see describe_dataset)."""

    location: str
    num_samples: int
    latent_shape: tuple[int, int, int] | None = None  # precomputed latents: (C, H/8, W/8) of the first sample
    embedding_width: int | None = None  # precomputed latents: the text embedding's width
    pooled_width: int | None = None  # precomputed latents for SDXL: the pooled text embedding's width


def describe_dataset(
    remote: str | None,
    local: str | None,
    precomputed: bool = False,
    retries: int = RETRIES,
    timeout: float = READ_TIMEOUT,
) -> DatasetDescription:
    """The size of an MDS dataset, read from its index.json, its columns checked; for precomputed latents also
    the shapes of the first sample (its shard is read into a temporary folder when the dataset is remote)."""
    if remote is not None and not urllib.parse.urlparse(remote).scheme and local is None:
        remote, local = None, remote  # a bare folder is read in place
    check_dataset(remote, local, retries=retries, timeout=timeout)
    location = remote or local
    with tempfile.TemporaryDirectory(prefix='sd2-describe-') as work:
        folder = local if remote is None else work

        def fetch(basename: str) -> None:
            if remote is not None:
                CloudDownloader.direct_download(f'{remote.rstrip("/")}/{basename}', f'{work}/{basename}', timeout)

        fetch('index.json')
        try:
            shards = json.loads((Path(folder) / 'index.json').read_text())['shards']
            names = [shard['raw_data']['basename'] for shard in shards]
            num_samples = sum(int(shard['samples']) for shard in shards)
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f'{location}: index.json is not a Streaming index ({type(error).__name__}: {error})')
        for name, shard in zip(names, shards):
            check_columns(location, name, shard.get('column_names'), precomputed)
        if remote is None:  # a cache folder of a remote fills as it downloads: Streaming checks what it fetches
            check_local_shards(location, Path(local), shards)
        if not precomputed or num_samples == 0:
            return DatasetDescription(location, num_samples)
        shard = next(shard for shard in shards if shard['samples'])
        raw, packed = shard['raw_data']['basename'], (shard.get('zip_data') or {}).get('basename')
        if not (Path(folder) / raw).is_file():
            fetch(packed if packed and remote is not None else raw)
            if packed:  # Streaming keeps compressed shards in the remote, decompressing them into its cache
                data = decompress(shard['compression'], (Path(folder) / packed).read_bytes())
                folder = work
                (Path(work) / raw).write_bytes(data)
        sample = reader_from_json(folder, None, shard).get_item(0)
    pooled = sample.get('pooled_text_embedding')
    return DatasetDescription(
        location,
        num_samples,
        tuple(sample['latent_mean'].shape),
        sample['text_embedding'].shape[-1],
        None if pooled is None else pooled.shape[-1],
    )
