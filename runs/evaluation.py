"""Does it learn? The validation loss and the sample images of a run, run by Composer's Evaluators.

Validation loss: the noise-prediction loss of a held-out MDS split, averaged over equidistant timesteps
(model.StableDiffusion.validation_losses, beside the training loss). Each sample's draws (the latent sample and one
noise per timestep) come from a generator seeded by the sample's index in the split, and the metric sums losses and
counts over ranks before dividing, so the same weights give the same value on any number of ranks and any batch
size.

Sample images: a grid of fixed prompts (presets.SAMPLE_PROMPTS) and seeds drawn through the model's Diffusers
pipeline by export.SampleGrid, saved as PNG and logged to W&B; here, the marker evaluator that triggers it.

Both run as Composer Evaluators ('val', 'samples', and with --use_ema 'val_ema', 'samples_ema', on which the EMA
algorithm swaps the averaged weights in). Composer runs evaluators between batches with the training clock
stopped: Trainer._train_loop takes the time of `_run_evaluators` out of `state.timestamp.total_wct`, which is
the only clock SpeedMonitor's throughput windows read (it adds evaluation up apart, as time/val). So evaluating
never slows a measured window.
"""

import atexit
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from composer.core import Callback, DataSpec, Evaluator, State
from composer.loggers import Logger
from composer.utils import dist
from streaming.base.compression import decompress
from streaming.base.format import reader_from_json
from streaming.base.storage.download import CloudDownloader
from torch.utils.data import DataLoader, Dataset

from data import ImageCaptionSample, PrecomputedLatentsDataset
from datapath.images import BadSample
from datapath.loaders import StoppableDataLoader
from settings.config import RunConfig
from settings.dataset_checks import read_index
from settings.model_folder import CaptionInputs
from settings.presets import VALIDATION_TIMESTEPS
from settings.run_sections import EvaluationSection

log = logging.getLogger(__name__)

VALIDATION_SEED = 0  # fixed, not --seed: runs with different seeds are compared on the same draws


def sample_draws(index: int, latent_shape: tuple[int, int, int], count: int = VALIDATION_TIMESTEPS) -> dict:
    """The fixed random draws of the sample at `index` of the split: the same wherever and with whatever it is
    batched."""
    generator = torch.Generator().manual_seed(VALIDATION_SEED * 1_000_003 + index)
    latent_noise = torch.randn(latent_shape, generator=generator)
    noise = torch.randn((count, *latent_shape), generator=generator)
    return {'latent_noise': latent_noise, 'noise': noise}


# ------------------------------------------------------------------------------------------ the split


def fetch_split(remote: str) -> str:
    """A remote split copied whole into a temporary folder (removed at exit): validation splits are small, and
    read in place they need none of Streaming's shared cache (which refuses two datasets on one folder)."""
    folder = tempfile.mkdtemp(prefix='sd2-validation-')
    atexit.register(shutil.rmtree, folder, True)
    CloudDownloader.direct_download(f'{remote.rstrip("/")}/index.json', f'{folder}/index.json')
    for shard in read_index(remote, folder):  # its names checked before any is fetched
        packed = (shard.get('zip_data') or {}).get('basename')
        name = packed or shard['raw_data']['basename']
        CloudDownloader.direct_download(f'{remote.rstrip("/")}/{name}', f'{folder}/{name}')
    return folder


class ValidationSplit(Dataset):
    """A held-out MDS split read in place (a local folder, or a remote copied by fetch_split): images and
    captions as convert.py writes them, or precompute.py's latents. Every sample carries its fixed draws and
    'valid': a bad sample (see images.py) is kept as a placeholder with valid 0, which the loss leaves out."""

    def __init__(
        self,
        folder: str,
        latent_shape: tuple[int, int, int],
        image_size: int,
        tokenizer: str | None = None,
        precomputed: bool = False,
        inputs: CaptionInputs | None = None,  # default: SD2's, one encoder
    ):
        self.folder, self.latent_shape, self.image_size, self.precomputed = (
            folder,
            latent_shape,
            image_size,
            precomputed,
        )
        self.shards = read_index(folder, folder)
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + int(shard['samples']))
        self.inputs = inputs = inputs or CaptionInputs()
        self.to_sample = ImageCaptionSample(image_size, tokenizer, inputs)
        self._readers = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def reader(self, shard_id: int):
        if shard_id not in self._readers:
            shard = self.shards[shard_id]
            raw, packed = shard['raw_data']['basename'], (shard.get('zip_data') or {}).get('basename')
            if not Path(self.folder, raw).is_file() and packed:  # decompressed once, next to the packed shard
                Path(self.folder, raw).write_bytes(
                    decompress(shard['compression'], Path(self.folder, packed).read_bytes())
                )
            self._readers[shard_id] = reader_from_json(self.folder, None, shard)
        return self._readers[shard_id]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f'index {index} out of range for {len(self)} validation samples')
        shard_id = next(i for i in range(len(self.shards)) if index < self.starts[i + 1])
        raw = self.reader(shard_id).get_item(index - self.starts[shard_id])
        sample = {**sample_draws(index, self.latent_shape), 'valid': torch.tensor(1)}
        if self.precomputed:
            for name in PrecomputedLatentsDataset.COLUMNS:
                if name in raw:
                    sample[name] = torch.tensor(raw[name])
            return sample
        try:
            sample.update(self.to_sample(raw))
        except BadSample as error:
            log.warning(f'validation sample {index} of {self.folder} left out: {error}')
            sample['image'] = torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8)
            if self.inputs.size_conditions:
                sample['time_ids'] = torch.tensor([self.image_size, self.image_size, 0, 0] + [self.image_size] * 2)
                sample['time_ids'] = sample['time_ids'].float()
            sample.update(self.to_sample.caption_ids(''))
            sample['valid'] = torch.tensor(0)
        return sample


# --------------------------------------------------------------------------------------- the evaluators


def whole_microbatches(loader: DataLoader) -> DataSpec:
    """The loader with Composer's split, less its warning: each batch is already one microbatch, and Composer
    warned "Cannot split tensor of length 4 into batches of size 8" of the last, shorter one at every validation
    of a small split. A batch split smaller (Composer drops the padding a distributed sampler repeats) is split
    as before."""
    spec = DataSpec(loader)
    split = spec.split_batch

    def split_batch(batch, microbatch_size):
        return [batch] if spec.get_num_samples_in_batch(batch) <= microbatch_size else split(batch, microbatch_size)

    spec.split_batch = split_batch
    return spec


def build_evaluators(config: RunConfig, latent_shape: tuple[int, int, int]) -> list[Evaluator]:
    """The evaluators a RunConfig asks for, with their averaged-weights twins under --use_ema. The sample dataset's
    held-out split, where the run validates on it, is there already: the run writes it first
    (run.write_sample_datasets)."""
    evaluators, evaluation, data = [], config.evaluation, config.data
    microbatch = config.batch.device_train_microbatch_size
    batch_size = config.batch.device_batch_size if microbatch == 'auto' else microbatch
    weights = ('', '_ema') if config.ema.use_ema else ('',)
    if evaluation.eval_interval:
        folder = evaluation.eval_local if evaluation.eval_remote is None else fetch_split(evaluation.eval_remote)
        split = ValidationSplit(
            folder, latent_shape, data.image_size, data.tokenizer, data.precomputed_latents, config.model.caption_inputs
        )
        loader = StoppableDataLoader(
            split,
            batch_size=batch_size,
            # Composer's sampler, without shuffling: Composer's eval loop drops the samples it repeats to even out
            # the ranks, so each sample counts once.
            sampler=dist.get_sampler(split, shuffle=False, drop_last=False),
            num_workers=data.num_workers,
            persistent_workers=data.num_workers > 0,
        )
        batches = loader if microbatch == 'auto' else whole_microbatches(loader)
        for suffix in weights:
            evaluators.append(
                Evaluator(
                    label=f'val{suffix}',
                    dataloader=batches,
                    metric_names=['ValidationLoss'],
                    eval_interval=evaluation.eval_interval,
                    device_eval_microbatch_size=microbatch,
                )
            )
    if evaluation.sample_interval:
        # One batch, the same on every rank (no sampler): every rank draws the whole grid.
        marker = DataLoader([{'sample_grid': torch.zeros(())}], batch_size=1)
        for suffix in weights:
            evaluators.append(
                Evaluator(
                    label=f'samples{suffix}',
                    dataloader=marker,
                    metric_names=[],
                    eval_interval=evaluation.sample_interval,
                )
            )
    return evaluators


class ValidationReport(Callback):
    """Prints each validation loss (rank 0), keeps the learning curves, and times every evaluator, for the share of
    the run they took. The curves are saved in every checkpoint (Composer keeps each callback's state_dict there), so
    a resumed run's results hold the points from before its resumption too."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._started = None
        self.curves: dict[str, list[list]] = {}  # by evaluator label ('val', 'val_ema'): [samples seen, loss], ...

    def state_dict(self) -> dict:
        return {'curves': self.curves}

    def load_state_dict(self, state: dict) -> None:
        self.curves = {label: [list(point) for point in points] for label, points in state.get('curves', {}).items()}

    def eval_start(self, state: State, logger: Logger) -> None:
        self._started = time.perf_counter()

    def eval_end(self, state: State, logger: Logger) -> None:
        label = str(state.dataloader_label)
        kind = 'samples' if label.startswith('samples') else 'validation'
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - self._started
        if kind != 'validation':
            return
        loss, samples = float(state.eval_metric_values['ValidationLoss']), int(state.timestamp.sample)
        # One point per sample count: a resumed run validates again where its checkpoint was written.
        points = [point for point in self.curves.get(label, []) if point[0] != samples]
        self.curves[label] = sorted([*points, [samples, loss]])
        if dist.get_global_rank() == 0:
            weights = ' (EMA weights)' if label.endswith('_ema') else ''
            print(
                f'validation loss{weights}: {loss:.5f} after {int(state.timestamp.sample)} samples '
                f'(batch {int(state.timestamp.batch)})',
                flush=True,
            )


def evaluation_callbacks(evaluation: EvaluationSection) -> list[Callback]:
    """The console lines and timing of the evaluators; the Trainer runs them before the sample grid (run.py adds
    export.SampleGrid after them), so that they time the grids too."""
    return [ValidationReport()] if evaluation.eval_interval or evaluation.sample_interval else []
