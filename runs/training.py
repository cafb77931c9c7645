"""The Composer Trainer of a run, assembled from its RunConfig: the data loader (synthetic tensors or MDS shards
through Streaming), the published optimizer and its learning-rate schedule, the algorithms and callbacks the flags
ask for, FSDP units, the profiler, and the random state of a checkpoint resumed mid-epoch. run.py runs it;
benchmarks/framework_overhead.py times it against a bare loop.
"""

import os
import urllib.parse
import warnings
from collections import deque

import torch
from composer import Trainer
from composer.algorithms import ChannelsLast, LowPrecisionGroupNorm, LowPrecisionLayerNorm
from composer.callbacks import SpeedMonitor
from composer.core import Time
from composer.loggers import InMemoryLogger, WandBLogger
from composer.optim import ComposerScheduler, ConstantScheduler, ConstantWithWarmupScheduler
from composer.profiler import Profiler, cyclic_schedule
from composer.utils import dist
from torch.utils.data import DataLoader

from data import (
    BadSampleCounter,
    PrecomputedLatentsDataset,
    StreamingLAIONDataset,
    SyntheticImageCaptionDataset,
    SyntheticLatentsDataset,
    collate,
)
from datapath.loaders import StoppableDataLoader
from ema import EMA
from guards.arguments import ConfigError
from models.stable_diffusion import DiffusionModel
from runs.checkpoints import (
    CheckpointWriteError,
    RunDescription,
    composer_load,
    keep_newest_checkpoints,
    record_beside,
    remote_checkpoint_savers,
)
from runs.composer_fixes import (
    check_remote_checkpoints_often,
    load_checkpoints_weights_only,
    report_failed_writes,
    restore_random_state_mid_epoch,
)
from runs.evaluation import build_evaluators, evaluation_callbacks
from runs.progress import ProgressLines, draws_a_bar
from runs.stability import stability_algorithms
from settings.config import RunConfig
from settings.dataset_checks import DataError
from settings.model_folder import LATENT_DOWNSAMPLE, CaptionInputs
from settings.presets import SYNTHETIC_SAMPLES
from settings.run_sections import BatchSection, DataSection, ObjectiveSection, OutputSection, SpeedSection
from settings.tokenizer import TokenizerError

# torch.compile options that --compile adds to its own (Inductor, in the mode it names, at static shapes): none for a
# run; tests set a backend here (aot_eager, one that fails) to trace on a CPU without Inductor.
EXTRA_COMPILE_OPTIONS: dict = {}


def compile_config(mode: str | None) -> dict | None:
    """Composer's compile_config for --compile MODE (torch.compile's own default mode is given as no mode), at static
    shapes: every microbatch has the same (the loader drops a last partial batch), and a graph Dynamo made dynamic
    after a recompile would be one that reduce-overhead's CUDA graphs skip."""
    if mode is None:
        return None
    return {**EXTRA_COMPILE_OPTIONS, 'dynamic': False, **({} if mode == 'default' else {'mode': mode})}


def build_dataloader(
    data: DataSection, batch: BatchSection, speed: SpeedSection, inputs: CaptionInputs, model: DiffusionModel
) -> DataLoader:
    """The training loader: random tensors shaped as the model takes them (--use_synth_data), else MDS shards."""
    if not data.use_synth_data:
        return build_streaming_dataloader(data, batch, speed, inputs)
    if data.precomputed_latents:
        dataset = SyntheticLatentsDataset(
            **model.precomputed_shapes(data.image_size // LATENT_DOWNSAMPLE),
            num_samples=SYNTHETIC_SAMPLES,
            seed=batch.seed,
        )
    else:
        dataset = SyntheticImageCaptionDataset(
            data.image_size,
            num_samples=SYNTHETIC_SAMPLES,
            seed=batch.seed,
            inputs=inputs,
            tokenizer=data.tokenizer,
        )
    # Composer's sampler gives each rank its own slice of every global batch.
    sampler = dist.get_sampler(dataset, shuffle=False, drop_last=True)
    return StoppableDataLoader(  # a job-wide Ctrl-C or SIGTERM is the main process's to handle
        dataset,
        batch_size=batch.device_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=data.num_workers,
        pin_memory=speed.pin_memory,
        persistent_workers=data.num_workers > 0,
    )


def build_streaming_dataloader(
    data: DataSection, batch: BatchSection, speed: SpeedSection, inputs: CaptionInputs
) -> DataLoader:
    """MDS shards through Streaming, which splits samples over ranks and workers itself (no sampler here) and,
    given the device batch size, lets Composer's checkpoints resume mid-epoch on exactly the remaining samples. The
    sample dataset, where the run trains on it, is there already: the run writes it first
    (run.write_sample_datasets)."""
    try:
        if data.precomputed_latents:
            dataset = PrecomputedLatentsDataset(
                remote=data.remote,
                local=data.local,
                batch_size=batch.device_batch_size,
                shuffle=True,
                seed=batch.seed,
            )
        else:
            dataset = StreamingLAIONDataset(
                remote=data.remote,
                local=data.local,
                image_size=data.image_size,
                tokenizer=data.tokenizer,
                inputs=inputs,
                batch_size=batch.device_batch_size,
                shuffle=True,
                seed=batch.seed,
                epoch_size=data.epoch_size,
            )
    except (DataError, TokenizerError) as error:
        raise ConfigError(str(error))
    return StoppableDataLoader(  # a job-wide Ctrl-C or SIGTERM is the main process's to handle
        dataset,
        batch_size=batch.device_batch_size,
        drop_last=True,
        num_workers=data.num_workers,
        collate_fn=None if data.precomputed_latents else collate,
        pin_memory=speed.pin_memory,
        persistent_workers=data.num_workers > 0,
    )


def build_optimizer(objective: ObjectiveSection, speed: SpeedSection, model: DiffusionModel) -> torch.optim.Optimizer:
    """The published optimizer for the UNets, a diffusion transformer's recipe's for it. fused=True: one kernel for
    all parameters, the same update."""
    settings = {'lr': 1e-4, 'weight_decay': 1e-3}
    if objective.recipe is not None:
        recipe = objective.recipe
        settings = {'lr': recipe.learning_rate, 'betas': recipe.betas, 'weight_decay': recipe.weight_decay}
    return torch.optim.AdamW(model.denoiser.parameters(), **settings, fused=speed.fused_adamw or None)


def build_lr_schedule(objective: ObjectiveSection) -> ComposerScheduler:
    """The optimizer's published constant learning rate, reached by a linear warmup from 0 over --lr_warmup when
    given (Composer's ConstantWithWarmupScheduler)."""
    if objective.lr_warmup is None:
        return ConstantScheduler()
    return ConstantWithWarmupScheduler(t_warmup=objective.lr_warmup)


def mark_fsdp_units(model: DiffusionModel) -> None:
    """Composer wraps each child module of the model (the denoiser, vae, text encoders) in FSDP, and inside it every
    module marked _fsdp_wrap (a ComposerModel's own fsdp_wrap_fn is never consulted for its children)."""
    for block in model.fsdp_blocks():
        block._fsdp_wrap = True  # one unit per block: full_shard gathers one block's weights at a time
    for encoder in model.frozen_encoders():
        # The frozen encoders stay whole on every GPU (1.7 GB in fp32): FSDP gathers weights only in forward(),
        # which encode() never calls, and their weights have no gradients or optimizer state to shard.
        encoder._fsdp_wrap = False
        if torch.cuda.is_available():  # under FSDP the Trainer moves only the modules FSDP wraps
            encoder.to(torch.device('cuda', torch.cuda.current_device()))


def build_trainer(config: RunConfig, model: DiffusionModel, dataloader: DataLoader, callbacks: tuple = ()) -> Trainer:
    optimizer = build_optimizer(config.objective, config.speed, model)
    if config.batch.fsdp != 'none':
        mark_fsdp_units(model)
    algorithms = []
    if config.ema.use_ema:  # evaluation.py evaluates both weights: the trained ones under 'val' and 'samples'
        half_life = Time(config.ema.ema_half_life.value, config.ema.ema_half_life.unit)  # parsed by config.py, once
        algorithms.append(EMA(half_life, offload=config.ema.ema_offload, trained_labels=('val', 'samples')))
    if config.speed.channels_last:
        algorithms.append(ChannelsLast())
    if config.speed.low_precision_norm:
        algorithms += [LowPrecisionGroupNorm(), LowPrecisionLayerNorm()]
    algorithms += stability_algorithms(config.objective, dataloader.dataset)
    if config.outputs.save_folder:
        report_failed_writes(CheckpointWriteError.of, record_beside)
        load_checkpoints_weights_only(composer_load(config.outputs.trust_checkpoint))
    bar = draws_a_bar()
    loggers = [InMemoryLogger()]
    if config.outputs.wandb_project:
        loggers.append(wandb_logger(config))
    trainer = Trainer(
        model=model,
        train_dataloader=dataloader,
        optimizers=optimizer,
        schedulers=build_lr_schedule(config.objective),
        max_duration=config.batch.max_duration,
        device_train_microbatch_size=config.batch.device_train_microbatch_size,
        precision=config.batch.precision,
        callbacks=[
            SpeedMonitor(window_size=speed_window(config.batch.num_batches)),
            BadSampleCounter(),
            RunDescription(config),
            *keep_newest_checkpoints(config.outputs),
            *evaluation_callbacks(config.evaluation),
            *(() if bar else (ProgressLines(config.batch.num_batches),)),
            *callbacks,
        ],
        eval_dataloader=build_evaluators(config, latent_shape(config.data, model)) or None,
        loggers=loggers,
        progress_bar=bar,
        seed=config.batch.seed,
        run_name=config.outputs.run_name,
        save_folder=composer_folder(config.outputs.save_folder),
        save_interval=config.outputs.save_interval,
        save_num_checkpoints_to_keep=config.outputs.save_num_checkpoints_to_keep,
        autoresume=config.outputs.autoresume,
        algorithms=algorithms,
        compile_config=compile_config(config.speed.compile),
        profiler=None if config.outputs.profile is None else build_profiler(config.outputs, config.batch),
        parallelism_config=None
        if config.batch.fsdp == 'none'
        else {
            'fsdp': {
                'sharding_strategy': config.batch.fsdp.upper(),
                'use_orig_params': True,
                'state_dict_type': config.batch.fsdp_state_dict_type,
            }
        },
    )
    restore_random_state_mid_epoch(trainer)
    if int(trainer.state.timestamp.batch) > 0:
        fit_speed_window(trainer, config.batch.num_batches - int(trainer.state.timestamp.batch))
        # Resumed at the end of an epoch, Composer first finishes that epoch, which has no batch left, and warns
        # that no batches were trained; a run that trains none at all ends in run.check_finished instead.
        warnings.filterwarnings('ignore', message='No batches were trained for global rank')
    check_remote_checkpoints_often(remote_checkpoint_savers(trainer))
    return trainer


def speed_window(batches: int) -> int:
    """Throughput is a rolling mean over this many batches (100 as published, fewer on short runs), so that the
    first batch a process trains, which holds one-off setup costs, is never inside a window."""
    return max(1, min(100, batches // 2))


def fit_speed_window(trainer: Trainer, batches: int) -> None:
    """A resumed run trains only the batches after its checkpoint: its SpeedMonitor window is sized for those, as
    a window longer than the batches trained is never full and the run would report no throughput at all."""
    monitor = next(callback for callback in trainer.state.callbacks if isinstance(callback, SpeedMonitor))
    window = speed_window(batches)
    for name in ('history_samples', 'history_tokens', 'history_wct', 'history_flops'):
        setattr(monitor, name, deque(maxlen=window + 1))  # SpeedMonitor keeps window + 1 batch ends


def latent_shape(data: DataSection, model: DiffusionModel) -> tuple[int, int, int]:
    side = data.image_size // LATENT_DOWNSAMPLE
    return (model.latent_channels, side, side)


# Per-token throughput: Composer counts the caption's token ids, which says nothing of an image model's speed.
UNLOGGED_TO_WANDB = ('throughput/tokens_per_sec', 'throughput/device/tokens_per_sec')

# The results file's headline figures, as the run's W&B summary (named as in the results JSON).
WANDB_SUMMARY = (
    'img_per_sec',
    'img_per_sec_per_device',
    'mfu',
    'flops_per_sec',
    'peak_gpu_memory_gb',
    'peak_gpu_memory_reserved_gb',
    'device_train_microbatch_size',
    'val_loss',
    'val_loss_ema',
    'train_seconds',
    'eval_seconds',
    'sample_seconds',
    'device_name',
    'num_devices',
)


class RunWandBLogger(WandBLogger):
    """Composer's W&B logger, with the run's resolved configuration as the W&B run's config and no per-token
    throughput. It never waits on W&B's servers in offline mode: wandb 0.18 asks the server for its version
    whenever an image is logged offline (allow_offline_artifacts, on by default), and retries forever where there
    is no network (seen: a run with sample grids still in that loop after 590 s)."""

    def __init__(self, config: RunConfig):
        init_kwargs = {'config': config.as_dict(), 'settings': offline_images_without_the_server()}
        super().__init__(project=config.outputs.wandb_project, name=config.outputs.wandb_name, init_kwargs=init_kwargs)

    def init(self, state, logger) -> None:
        """Composer's, less wandb's `URL not available in offline run` warning: Composer asks an offline run for
        its address, which it does not have."""
        from wandb.sdk.wandb_run import Run

        get_url = Run.get_url
        Run.get_url = lambda run: None if run_is_offline(run) else get_url(run)
        try:
            self.init_or_go_offline(state, logger)
        finally:
            Run.get_url = get_url

    def init_or_go_offline(self, state, logger) -> None:
        """An online run that cannot start its W&B run (no network, no API key: wandb gives up after its
        init_timeout, 90 s by default) logs offline instead, with a line saying so, rather than ending the run."""
        import wandb

        try:
            super().init(state, logger)
        except wandb.errors.Error as error:
            if self._init_kwargs.get('mode') == 'offline' or run_is_offline(wandb.setup()):
                raise
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            print(
                f'warning: W&B: {reason[:200]}: the run goes on logging to W&B offline (wandb sync uploads it later)',
                flush=True,
            )
            wandb.teardown()  # the failed start's service and settings, which a second init would reuse
            self._init_kwargs['mode'] = 'offline'
            super().init(state, logger)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        super().log_metrics({k: v for k, v in metrics.items() if k not in UNLOGGED_TO_WANDB}, step)


def run_is_offline(run) -> bool:
    return bool(getattr(run.settings, '_offline', False)) or getattr(run.settings, 'mode', None) == 'offline'


def offline_images_without_the_server() -> dict:
    """wandb's settings that keep an offline run's images local (the setting, where this wandb has it)."""
    import wandb

    try:
        wandb.Settings(allow_offline_artifacts=False)
    except (wandb.errors.UsageError, ValueError, TypeError):  # a wandb without the setting never asks
        return {}
    return {'allow_offline_artifacts': False}


def wandb_logger(config: RunConfig) -> WandBLogger:
    """Composer's W&B logger. Composer 0.32 reads the run's address with Run.get_url(), which wandb 0.29 removed
    for the `url` property: without the alias below, --wandb_project stopped the run on a current wandb."""
    from wandb.sdk.wandb_run import Run

    if not hasattr(Run, 'get_url'):
        Run.get_url = lambda run: run.url
    return RunWandBLogger(config)


def log_summary_to_wandb(trainer: Trainer, results) -> None:
    """The results file's headline figures as the W&B run's summary, where the run logs to W&B."""
    if not any(isinstance(destination, WandBLogger) for destination in trainer.logger.destinations):
        return
    import wandb

    if wandb.run is not None:
        headline = {name: getattr(results, name) for name in WANDB_SUMMARY}
        wandb.run.summary.update({name: value for name, value in headline.items() if value is not None})


def composer_folder(folder: str | None) -> str | None:
    """A folder as given, for Composer, which formats it as a template ({run_name}, {rank}): its braces doubled so
    that they stay as they are, and a local name that would read as a URL scheme ('run:2') made relative
    ('./run:2'). A --save_folder, whose paths Composer formats again as it saves, is given none (output_paths.py's
    refuse_what_composer_changes refuses braces there, and '#', '?', which no spelling keeps)."""
    if folder is None:
        return None
    if '://' not in folder and urllib.parse.urlparse(folder).scheme:
        folder = f'./{folder}'
    return folder.replace('{', '{{').replace('}', '}}')


def build_profiler(outputs: OutputSection, batch: BatchSection) -> Profiler:
    """PyTorch's profiler on the last batch (the one before it warms the profiler up), traces kept locally."""
    if not torch.cuda.is_available():
        # Kineto, PyTorch's tracer, asks for GPUs on a CPU-only machine too, and logs `ERROR: ... gpuGetDeviceCount
        # failed` in a run that goes on fine: its own logging, quietened to fatal errors (read when it starts).
        os.environ.setdefault('KINETO_LOG_LEVEL', '5')
    return Profiler(
        schedule=cyclic_schedule(skip_first=batch.num_batches - 2, wait=0, warmup=1, active=1, repeat=1),
        trace_handlers=[],
        sys_prof_cpu=False,
        torch_prof_folder=composer_folder(outputs.profile),
        torch_prof_remote_file_name=None,
        torch_prof_memory_remote_file_name=None,
        torch_prof_with_flops=False,  # FLOP counting adds CPU time to every op; SpeedMonitor counts FLOPs
    )
