"""precompute.py's work, once its flags are resolved: the frozen VAE and text encoder(s) run over an MDS dataset,
part by part over the ranks, each part written as its own MDS folder (resumable: a part with an index.json is
done), then the parts' indexes merged into one dataset (see precompute.py's docstring).
"""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shlex
import shutil
import time
import urllib.parse
from pathlib import Path

import numpy as np
import torch
from composer.utils import dist, get_device, reproducibility
from streaming import MDSWriter
from streaming.base.util import merge_index
from torch.utils.data import Subset
from tqdm import tqdm

from data import StreamingLAIONDataset, collate
from datapath.images import unit_range
from datapath.loaders import StoppableDataLoader, loader_failure, loader_timeout, shared_memory_full
from datapath.sample_dataset import ensure_sample_dataset
from datapath.streaming_fixes import clean_stale_shared_memory
from guards.arguments import ConfigError
from guards.outputs import DISK_FULL, WriteFailed, free_space_fix, system_reason
from guards.stopping import STOPS
from guards.writer_lock import contents, one_writer_on_rank_zero
from models.parts import build_frozen_encoders
from models.stable_diffusion import describe_weights, encode_captions
from runs.versions import check_stack
from settings.dataset_checks import (
    PRECOMPUTED_COLUMNS,
    SDXL_PRECOMPUTED_COLUMNS,
    SHARD_HASH,
    TRANSFORMER_PRECOMPUTED_COLUMNS,
    DataError,
    describe_dataset,
    is_remote,
    read_index,
    s3_client,
)
from settings.datasets import CONVERTED_VALIDATION_SPLIT
from settings.families import FAMILIES
from settings.model_folder import ModelFolder, caption_inputs
from settings.precompute_settings import PrecomputeSettings
from settings.tokenizer import TokenizerError

SETTINGS_FILE = 'precompute.json'  # what the output was made with, so a rerun never mixes two settings
# The held-out split convert.py --validation_fraction writes in its output folder (convert.VALIDATION_SPLIT), and
# where a run looks for one beside its training data (settings.datasets).
VALIDATION_SPLIT = CONVERTED_VALIDATION_SPLIT


# ------------------------------------------------------------------------------------ output folder


def read_text(out: str, name: str) -> str | None:
    """A small file of the output (local folder or s3://), or None when it does not exist."""
    if not is_remote(out):
        path = Path(out) / name
        return path.read_text() if path.is_file() else None
    url = urllib.parse.urlparse(out)
    if url.scheme != 's3':
        raise ConfigError(f'--out {out}: outputs are local folders or s3:// remotes')
    client = s3_client()
    try:
        return client.get_object(Bucket=url.netloc, Key=f'{url.path.strip("/")}/{name}')['Body'].read().decode()
    except client.exceptions.NoSuchKey:
        return None


def write_text(out: str, name: str, text: str) -> None:
    if not is_remote(out):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(text)
        return
    url = urllib.parse.urlparse(out)
    s3_client().put_object(Bucket=url.netloc, Key=f'{url.path.strip("/")}/{name}', Body=text.encode())


def check_settings(args: PrecomputeSettings, num_samples: int) -> None:
    """Rank 0: the output is new, or was started by the same command (then finished parts are kept)."""
    settings = {
        'input': args.remote or args.local,
        'model_name': args.model_name,
        'image_size': args.image_size,
        'precision': args.precision,
        'tokenizer': args.tokenizer,
        'seed': args.seed,
        'part_size': args.part_size,
        'num_samples': num_samples,
    }
    previous = read_text(args.out, SETTINGS_FILE)
    if previous is not None and json.loads(previous) != settings and not args.overwrite:
        raise ConfigError(
            f'--out {args.out} holds a precomputation made with other settings ({previous.strip()}); '
            'pass --overwrite to start over, or choose another --out'
        )
    if (
        previous is None
        and not is_remote(args.out)
        and Path(args.out).is_dir()
        and contents(Path(args.out))  # this job's lock file is not an earlier output
        and not args.overwrite
    ):
        raise ConfigError(
            f'--out {args.out} is not empty and was not made by precompute.py; pass --overwrite or choose another --out'
        )
    if args.overwrite and not is_remote(args.out) and Path(args.out).is_dir():
        for path in contents(Path(args.out)):  # all but this job's lock; a remote one is overwritten part by part
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    write_text(args.out, SETTINGS_FILE, json.dumps(settings, indent=2) + '\n')


def part_name(part: int) -> str:
    return f'part-{part:05d}'


def part_out(out: str, part: int) -> str:
    return f'{out.rstrip("/")}/{part_name(part)}'


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in record.getMessage() for fragment in self.fragments)


@contextlib.contextmanager
def without_streaming_notices():
    """merge_index warns of what is expected here (the output folder holds the parts; it uses a temporary folder),
    three or four WARNING lines on every run that read like problems."""
    loggers = [logging.getLogger('streaming.base.storage.upload'), logging.getLogger()]  # the second: root
    notices = _DropMessages('exists and not empty. But continue to mkdir', 'is created to store index files')
    for logger in loggers:
        logger.addFilter(notices)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(notices)


# ------------------------------------------------------------------------------------------ encoding


@torch.no_grad()
def encode(folder: ModelFolder, vae, text_encoders: list, batch: dict, device: torch.device) -> dict[str, np.ndarray]:
    """The columns precompute.py writes for a batch: the latent distribution's mean and log-variance and the text
    embedding(s) as fp16, exactly what the model's encode samples from online (the log-variance is Diffusers'
    clamped one); SDXL's size and crop conditioning as the loader made it; PixArt's mask of T5's padding."""
    images = unit_range(batch['image'].to(device)).to(vae.dtype)
    latent_dist = vae.encode(images).latent_dist
    token_ids = {name: ids.to(device) for name, ids in batch.items() if name.startswith('input_ids')}
    columns = {'latent_mean': latent_dist.mean, 'latent_logvar': latent_dist.logvar}
    columns.update(encode_captions(folder, text_encoders, token_ids))
    columns = {
        name: tensor.to(torch.uint8 if name == 'text_mask' else torch.float16) for name, tensor in columns.items()
    }
    if 'time_ids' in batch:
        columns['time_ids'] = batch['time_ids'].float()
    return {name: tensor.cpu().numpy() for name, tensor in columns.items()}


def output_columns(folder: ModelFolder) -> dict[str, str]:
    """The MDS columns of a model's precomputed dataset."""
    if folder.is_transformer:
        extra = FAMILIES[folder.family].caption_extra
        return PRECOMPUTED_COLUMNS | {extra: TRANSFORMER_PRECOMPUTED_COLUMNS[extra]}
    return PRECOMPUTED_COLUMNS | (SDXL_PRECOMPUTED_COLUMNS if folder.is_sdxl else {})


def precompute_part(dataset, indices: range, out: str, vae, text_encoders, device, args, progress) -> tuple[int, int]:
    """Encode one part's samples and write them as one MDS folder; returns (written, bad samples left out)."""
    loader = StoppableDataLoader(  # a job-wide Ctrl-C or SIGTERM is the main process's to handle
        Subset(dataset, indices),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        collate_fn=collate,
        pin_memory=device.type == 'cuda',
    )
    written = bad = 0
    # A local part absolute: Streaming reads a relative folder with a colon (`run:2`) as a URL of an unknown cloud.
    target = out if is_remote(out) else str(Path(out).resolve())
    writer = MDSWriter(out=target, columns=output_columns(args.model_folder), exist_ok=True, hashes=[SHARD_HASH])
    try:
        for batch in loader:
            STOPS.check()  # a Ctrl-C or SIGTERM that came while the loader started its workers
            encoded = encode(args.model_folder, vae, text_encoders, batch, device)
            for row, replaced in enumerate(batch['bad_samples'].tolist()):
                # A bad sample was replaced by the next good one, which has its own position too: keep it once.
                if replaced:
                    bad += 1
                    continue
                writer.write(
                    {**{name: array[row] for name, array in encoded.items()}, 'caption': batch['caption'][row]}
                )
                written += 1
            progress.update(len(batch['bad_samples']))
        writer.finish()  # the last shard and index.json: a full disk there leaves the part unfinished too
    except BaseException:
        # MDSWriter's own exit finishes the part, index.json included, on an error or Ctrl-C too: a part stopped
        # halfway would pass for a done one, and the rerun would skip it. Its shards go instead (a remote part's
        # uploaded ones stay without an index), and the rerun redoes it.
        writer.cancel_future_jobs()
        shutil.rmtree(writer.local, ignore_errors=True)
        raise
    return written, bad


@contextlib.contextmanager
def loader_failures():
    """A loader worker that died or went silent (loaders.loader_failure): a DataError, its line, once
    precompute_part has removed the part in progress."""
    try:
        yield
    except RuntimeError as error:
        if (line := loader_failure(error, loader_timeout())) is None:
            raise
        raise DataError(f'{line}; the parts finished are kept: the same command finishes the rest') from None


@contextlib.contextmanager
def part_write_failures(out: str, part: int):
    """A full disk (or another failed write) under a part: one line, WriteFailed, once precompute_part has removed
    the part's shards; the parts finished stay, and the same command redoes the rest."""
    try:
        yield
    except OSError as error:
        if (line := shared_memory_full(error)) is not None:
            raise DataError(f'{line}; the parts finished are kept: the same command finishes the rest') from None
        if error.errno not in DISK_FULL:  # a failed read of the input is not the output's
            raise
        left = f'{part_name(part)} was removed, the parts finished are kept'
        fix = free_space_fix(error, 'run the same command again to finish the rest')
        raise WriteFailed(f'--out {out}', system_reason(error), left, fix) from error


def merge_parts(out: str, num_parts: int) -> None:
    """The parts' indexes merged into the output's index.json, each shard named by its part's folder, as Streaming's
    merge_index does. A remote output's parts are named to merge_index one by one (given the folder, it merges
    every index.json a level below, the validation split's too). A local output is merged here: merge_index reads
    its path as a URL, so a '#', '?' or ';' in it ended the path early, and the indexes of the folder above were
    merged in (seen: twice the samples)."""
    if is_remote(out):
        with without_streaming_notices():
            merge_index([f'{part_out(out, part)}/index.json' for part in range(num_parts)], out, keep_local=True)
        return
    shards = []
    for index in sorted(Path(out).glob('part-*/index.json')):
        for shard in read_index(f'--out {out}', str(index.parent)):  # a part of an earlier run's, perhaps
            for key in ('raw_data', 'zip_data', 'raw_meta', 'zip_meta'):
                if shard.get(key):
                    shard[key]['basename'] = f'{index.parent.name}/{shard[key]["basename"]}'
            shards.append(shard)
    partial = Path(out) / '.index.json.partial'
    try:  # whole or not at all: a run never reads half an index
        partial.write_text(json.dumps({'version': 2, 'shards': shards}))
        os.replace(partial, Path(out) / 'index.json')
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def merge_write_failures(out: str):
    """A full disk while merging the parts' indexes: no index.json of a part of the dataset is left."""
    try:
        yield
    except OSError as error:
        if not is_remote(out):
            (Path(out) / 'index.json').unlink(missing_ok=True)
        left = 'every part is written, but no index.json merges them'
        fix = free_space_fix(error, 'run the same command again, which merges them')
        raise WriteFailed(f'--out {out}', system_reason(error), left, fix) from error


def precompute(args: PrecomputeSettings) -> dict:
    """precompute.py's work, from its resolved flags (see its docstring); returns what it encoded and skipped."""
    check_stack()
    device = get_device(None)
    dist.initialize_dist(device)
    with output_lock(args.out):
        return precompute_into_locked_output(args, device)


def output_lock(out: str):
    """A second precompute.py onto a local --out is refused in one line before it reads or writes anything
    (writer_lock.py); an s3:// output is not locked."""
    if is_remote(out):
        return contextlib.nullcontext()
    return one_writer_on_rank_zero(out, f'--out {out}', 'wait for it to end or stop it, or choose another --out')


def precompute_into_locked_output(args: PrecomputeSettings, device) -> dict:
    """precompute(), with the output this job's alone: the dataset, then the held-out split convert.py
    --validation_fraction wrote beside it (a local input's validation/), into the output's own validation/, where a
    run with --precomputed_latents --local OUT finds it."""
    if args.sample_data:
        ensure_sample_dataset(Path(args.local))
    clean_stale_shared_memory()  # every rank calls it: local rank 0 cleans while the others wait at its barrier

    @functools.cache
    def encoders() -> tuple:
        """Built once, when the first split's dataset and output check out (a refusal comes before seconds of it)."""
        reproducibility.seed_all(args.seed)  # every rank, and every rerun, gets the same encoders
        # The encoders alone: the denoiser's weights (3.5 GB for SD2 base, 48 GB for Flux) are never read.
        vae, text_encoders, loaded = build_frozen_encoders(args.model_folder, init_device=device._device)
        dtype = torch.bfloat16 if args.precision == 'bf16' else torch.float32
        return vae.to(device._device, dtype), [encoder.to(device._device, dtype) for encoder in text_encoders], loaded

    done = precompute_split(args, device, encoders)
    split = None if is_remote(args.local or '') or args.remote else Path(args.local) / VALIDATION_SPLIT
    if split is not None and (split / 'index.json').is_file():
        out = f'{args.out.rstrip("/")}/{VALIDATION_SPLIT}'  # emptied with the output where --overwrite is given
        held_out = dataclasses.replace(args, local=str(split), out=out, overwrite=False)
        done['validation'] = precompute_split(held_out, device, encoders)
    return done


def precompute_split(args: PrecomputeSettings, device, encoders) -> dict:
    """One MDS dataset (args.remote or args.local) encoded into args.out, part by part over the ranks, then merged;
    `encoders()` gives the frozen encoders."""
    rank, world_size = dist.get_global_rank(), dist.get_world_size()
    try:
        describe_dataset(args.remote, args.local)  # a damaged dataset is named now, before any encoder runs
        dataset = StreamingLAIONDataset(
            remote=args.remote,
            local=args.local,
            image_size=args.image_size,
            tokenizer=args.tokenizer,
            inputs=caption_inputs(args.model_folder),
            shuffle=False,
            keep_caption=True,
        )
    except (DataError, TokenizerError) as error:
        raise ConfigError(str(error))
    num_samples = dataset.num_samples  # the whole dataset, not this rank's share (len)
    if rank == 0:
        check_settings(args, num_samples)
    dist.barrier()

    vae, text_encoders, loaded = encoders()
    num_parts = -(-num_samples // args.part_size)
    mine = [part for part in range(rank, num_parts, world_size)]
    todo = [part for part in mine if args.overwrite or read_text(part_out(args.out, part), 'index.json') is None]
    encoder_names = ['vae', *args.model_folder.text_encoder_folders]
    if rank == 0:
        print(
            f'precompute: {num_samples} samples of {args.remote or args.local} in {num_parts} part(s) of '
            f'{args.part_size} over {world_size} rank(s); {args.model_name} at {args.image_size}px, {args.precision} '
            f'({describe_weights(encoder_names, loaded)}); '
            f"{len(mine) - len(todo)} of this rank's {len(mine)} part(s) already done",
            flush=True,
        )
    start = time.perf_counter()
    written = bad = 0
    remaining = sum(len(range(p * args.part_size, min((p + 1) * args.part_size, num_samples))) for p in todo)
    with tqdm(total=remaining, unit='img', desc='precompute', disable=rank != 0) as progress:
        for part in todo:
            indices = range(part * args.part_size, min((part + 1) * args.part_size, num_samples))
            with part_write_failures(args.out, part), loader_failures():
                part_written, part_bad = precompute_part(
                    dataset, indices, part_out(args.out, part), vae, text_encoders, device._device, args, progress
                )
            written, bad = written + part_written, bad + part_bad
    totals = torch.tensor([written, bad], dtype=torch.long, device=device._device)
    dist.all_reduce(totals)
    dist.barrier()
    if rank == 0:
        if not is_remote(args.out):  # Streaming's merge will not replace the index of an earlier run
            (Path(args.out) / 'index.json').unlink(missing_ok=True)
        with merge_write_failures(args.out):
            merge_parts(args.out, num_parts)
        index = json.loads(read_text(args.out, 'index.json'))
        total = sum(shard['samples'] for shard in index['shards'])
        print(
            f'precompute: encoded {int(totals[0])} samples ({int(totals[1])} bad ones left out) in '
            f'{time.perf_counter() - start:.1f} s; {args.out} holds {total} samples in {len(index["shards"])} '
            f'shard(s). Train on it: composer benchmark.py --precomputed_latents '
            f'--{"remote" if is_remote(args.out) else "local"} {shlex.quote(args.out)} --model_name '
            f'{shlex.quote(args.model_name)}',
            flush=True,
        )
    return {
        'encoded': int(totals[0]),
        'bad': int(totals[1]),
        'parts': num_parts,
        'skipped_parts': len(mine) - len(todo),
    }
