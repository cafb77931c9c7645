"""One benchmark run, from parsed flags to reported throughput: `main` resolves the flags into a RunConfig
(config.py), builds the model (stable_diffusion.py), writes the sample datasets where the run reads them
(sample_dataset.py), builds the Trainer (training.py), trains, and reports the throughput: printed, and with
--results_json written in the schema of results.py. `main_reporting_errors` turns each error a run can
meet into one line. benchmark.py is its command line.
"""

import contextlib
import datetime
import errno
import functools
import logging
import os
import re
import statistics
from pathlib import Path

import torch
import torch._dynamo  # its exceptions and counters: --compile's failures and CUDA graph skips
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.utils import dist, get_device, reproducibility

from costs.results import Results, cpu_name, mfu, package_versions, peak_flops
from datapath.loaders import loader_failure, loader_timeout, shared_memory_full
from datapath.sample_dataset import ensure_sample_dataset
from datapath.streaming_fixes import clean_stale_shared_memory
from ema import export_ema_unet
from guards.arguments import ConfigError, leave_verdict, stop
from guards.stopping import STOPS
from guards.writer_lock import one_writer_on_rank_zero
from models.diffusion_transformer import convert_to_float8
from models.kernels import attention_backends, use_kernels
from models.stable_diffusion import DiffusionModel, build_model, describe_weights
from runs.checkpoints import (
    CHECKPOINT_FILE,
    LATEST_LINK,
    CheckpointWriteError,
    check_resumable,
    checkpoint_files,
    finish_uploads,
    point_s3_link_at_newest,
    remote_checkpoint_savers,
    remove_s3_resume_copy,
    set_aside_incomplete,
)
from runs.composer_fixes import keep_failed_uploads
from runs.evaluation import ValidationReport
from runs.export import SampleGrid, export_pipeline
from runs.interrupts import StopOnSignal, Stopped
from runs.progress import ProgressLines
from runs.provenance import provenance
from runs.start_lines import start_lines
from runs.training import build_dataloader, build_trainer, log_summary_to_wandb
from runs.uploads import UploadFailed, settle_failed_uploads
from runs.versions import check_stack
from settings.config import RunConfig
from settings.dataset_checks import DataError
from settings.presets import SAMPLE_VALIDATION_SEED, SAMPLE_VALIDATION_SIZE
from settings.run_sections import (
    BatchSection,
    DataSection,
    EvaluationSection,
    ModelSection,
    ObjectiveSection,
    OutputSection,
    SpeedSection,
)
from settings.tokenizer import TokenizerError


def main(config: RunConfig, callbacks: tuple = (), announced: bool = False) -> Trainer:
    """Runs the benchmark of a settled configuration (settings.config.resolve_config); `callbacks` lets tests and
    scripts watch the run. Ctrl-C and SIGTERM end it with one line (interrupts.py), and the signal handlers there
    were before are back when it returns. A local --save_folder is this run's alone while it runs (writer_lock.py)."""
    check_stack()  # torch, numpy and transformers: silent on the pins, one line on others, an error on broken ones
    stop_on_signal = StopOnSignal(config.outputs, config.batch)
    with STOPS.handling(stop_on_signal.handle), save_folder_lock(config.outputs):
        return train(config, (stop_on_signal, *callbacks), stop_on_signal, announced)


def save_folder_lock(outputs: OutputSection):
    """Refuses a second run on a local --save_folder in one line (FolderBusy, exit status 2) before it builds
    anything, and holds the folder for this one; an s3:// folder is not locked."""
    if not outputs.save_folder or '://' in outputs.save_folder:
        return contextlib.nullcontext()
    fix = 'wait for it to end or stop it (then --autoresume continues its run), or pass another --save_folder'
    return one_writer_on_rank_zero(outputs.save_folder, f'--save_folder {outputs.save_folder}', fix)


def train(config: RunConfig, callbacks: tuple, stop_on_signal: StopOnSignal, announced: bool = False) -> Trainer:
    """The run's steps: start (announced unless `announced`: start_lines printed already, as benchmark.py does
    before torch loads), the model, resumption, the sample datasets, the Trainer, training, the results, the
    exports."""
    start(config, announced)
    model = build_run_model(config.model, config.data, config.speed, config.objective)
    prepare_resumption(config, model)
    write_sample_datasets(config.data, config.evaluation)
    sample_grids = (
        (SampleGrid(config.evaluation, config.data, config.model, config.objective.flux_guidance),)
        if config.evaluation.sample_interval
        else ()
    )
    if config.outputs.save_folder and '://' in config.outputs.save_folder:
        keep_failed_uploads(not_uploaded_folder(config.outputs))
    loader = build_dataloader(config.data, config.batch, config.speed, config.model.caption_inputs, model)
    trainer = build_trainer(config, model, loader, (*sample_grids, *callbacks))
    if config.outputs.autoresume and config.outputs.save_folder.startswith('s3://'):
        dist.barrier()  # every rank of the node has loaded the copy Composer downloaded
        if dist.get_local_rank() == 0:
            remove_s3_resume_copy(config.outputs.save_folder)
    stop_on_signal.save_checkpoint = trainer.save_checkpoint_to_save_folder if config.outputs.save_folder else None
    stop_on_signal.finish_uploads = functools.partial(finish_uploads, trainer)
    resumed_at = int(trainer.state.timestamp.batch)
    if trained_to_the_end(trainer):  # resumed from the last checkpoint of a finished run: Composer would raise
        exports = ' and exported below' if config.evaluation.export_pipeline or config.ema.export_ema_unet else ''
        announce(
            f'run {config.outputs.run_name!r} is complete: its checkpoints in {config.outputs.save_folder} hold all '
            f'{resumed_at} batches of --max_duration {config.batch.max_duration}; nothing to train and no results '
            f'written{exports} (a longer --max_duration trains on from there)'
        )
        export(trainer, config)
        return trainer
    if resumed_at:
        announce_resumed(config.outputs, config.batch, resumed_at)
    with attention_backends(config.model.attention):
        if trainer.state.evaluators:
            trainer.eval()  # the start of the learning curve, and the untrained model's samples
        try:
            trainer.fit()
        except RuntimeError as error:  # a loader worker that died or went silent: the batch reached checkpointed
            if (line := loader_failure(error, loader_timeout())) is None:
                raise
            raise IncompleteRun(line + checkpoint_of_batch_reached(trainer, config.outputs, stop_on_signal)) from None
        except UploadFailed as error:  # the bucket refused a checkpoint for good: it and the batch reached kept here
            raise IncompleteRun(
                f'--save_folder {config.outputs.save_folder}: {error}; {keep_batch_reached(trainer, config.outputs)}'
            )
    check_finished(trainer, config.batch)
    warn_of_cuda_graphs_skipped(config.speed)
    report(trainer, config, resumed_at)
    export(trainer, config)
    return trainer


def start(config: RunConfig, announced: bool) -> None:
    """The start's lines, the CPU threads, the batch's make-up, the process group and the seed."""
    warnings_as_lines()
    if not announced:
        for line in start_lines(config):
            announce(line)
    if config.data.cpu_threads:
        torch.set_num_threads(config.data.cpu_threads)
    microbatch = config.batch.device_train_microbatch_size
    accumulation = '?' if microbatch == 'auto' else config.batch.device_batch_size // microbatch
    devices, steps = config.batch.world_size, 'step' if accumulation == 1 else 'steps'
    announce(
        f'batch: global {config.batch.batch_size} = {devices} device{"s" if devices > 1 else ""} x microbatch '
        f'{microbatch} x {accumulation} accumulation {steps}'
    )
    # One process group for the whole run, made now through Composer (the Trainer then reuses it). Otherwise
    # Streaming makes and destroys one of its own (in StreamingDataset, and in its shared-memory cleaner where
    # that runs) before the Trainer makes its own, each time on MASTER_PORT, and a rank that reaches the next
    # one while rank 0 still serves the last joins the old one and waits forever (seen: two CPU ranks).
    dist.initialize_dist(get_device(None))
    reproducibility.seed_all(config.batch.seed)  # same random init on every run and rank


def build_run_model(
    model_section: ModelSection, data: DataSection, speed: SpeedSection, objective: ObjectiveSection
) -> DiffusionModel:
    """The model with the speed paths the config asks for (activation checkpointing, fp8, kernels), announced."""
    # On a GPU the random init runs there: Composer set this rank's device in initialize_dist.
    init_device = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else None
    model = build_model(
        model_section.model_folder,
        model_section.prediction_type,
        model_section.attention,
        data.precomputed_latents,
        speed.encoders_bf16,
        init_device,
        objective.recipe,
    )
    if speed.activation_checkpointing:
        model.denoiser.enable_gradient_checkpointing()  # Diffusers' own: each block recomputed in the backward
    if speed.fp8:
        converted = convert_to_float8(model.denoiser)
        announce(f"fp8: {converted} of the transformer's linear layers train in float8 (torchao)")
    for line in use_kernels(speed, model):
        announce(line)
    announce(describe_model(model_section, data, model))
    # Counted now, and kept (models.parts.counted_once): SpeedMonitor asks for a batch's FLOPs at each batch end,
    # after the batch's time is taken, and the first ask, which counts them, landed in its first window.
    model.flops_per_image(data.image_size, data.image_size)
    return model


def prepare_resumption(config: RunConfig, model: DiffusionModel) -> None:
    """Before the data and the Trainer: a killed run's Streaming shared memory cleaned, and with --autoresume on a
    local folder, its incomplete checkpoints set aside and the newest checked against this run (on S3, the latest
    link pointed at the newest checkpoint). The settling took the checkpoint's CPU thread count already
    (settings/run_record.py)."""
    if not config.data.use_synth_data:
        clean_stale_shared_memory()  # a killed run's Streaming shared memory would block this one
    autoresume, folder = config.outputs.autoresume, config.outputs.save_folder
    if autoresume and folder.startswith('s3://'):
        if dist.get_local_rank() == 0:
            remove_s3_resume_copy(folder)  # an earlier resumption's, which Composer would load
        if dist.get_global_rank() == 0 and (line := point_s3_link_at_newest(folder)):
            announce(f'warning: {line}')
        dist.barrier()  # every rank reads the link as rank 0 left it
    if not (autoresume and '://' not in folder and Path(folder).is_dir()):
        return
    if dist.get_global_rank() == 0:
        for change in set_aside_incomplete(Path(folder)):
            announce(f'warning: {change}')
    dist.barrier()  # every rank resumes from the folder as rank 0 left it
    check_resumable(Path(folder), config, model, dist.get_global_rank())


def write_sample_datasets(data: DataSection, split: EvaluationSection) -> None:
    """The generated sample dataset and its held-out split, where the run reads them (no dataset given), written
    once, on first use (sample_dataset.py), before the loaders and evaluators that read them are built."""
    if data.sample_data:
        ensure_sample_dataset(Path(data.local))
    if split.sample_validation:
        ensure_sample_dataset(Path(split.eval_local), SAMPLE_VALIDATION_SIZE, SAMPLE_VALIDATION_SEED, broken=False)


def announce_resumed(outputs: OutputSection, batch: BatchSection, resumed_at: int) -> None:
    folder = outputs.save_folder
    remote = '://' in folder  # Composer fetched the checkpoint its latest link names
    source = f'the latest in {folder}' if remote else Path(folder, LATEST_LINK).resolve().name
    announce(f'resumed run {outputs.run_name!r} from {source} (batch {resumed_at} of {batch.num_batches})')


def report(trainer: Trainer, config: RunConfig, resumed_at: int) -> None:
    """The results (rank 0): printed, logged to W&B, written to --results_json; and the profiler's traces."""
    if dist.get_global_rank() == 0:
        results = summarize(trainer, config)
        log_summary_to_wandb(trainer, results)
        leave_verdict(print_summary(results, trained=config.batch.num_batches - resumed_at, resumed=resumed_at > 0))
        if config.outputs.results_json:
            write_whole(Path(config.outputs.results_json), results.to_json())
            print(f'results written to {config.outputs.results_json}')
    if config.outputs.profile:
        traces = sorted(str(path) for path in Path(config.outputs.profile).glob('*.json'))
        announce(f'profiler traces: {", ".join(traces)} (python benchmarks/profile_summary.py {traces[0]})')


def export(trainer: Trainer, config: RunConfig) -> None:
    """The exports asked for, of the weights trained (or, for a finished run resumed, of its last checkpoint's)."""
    # After a failed export (a full disk), a run with checkpoints exports again without training again.
    again = 'rerun the same command with --autoresume, which exports its last checkpoint'
    again = again if config.outputs.save_folder and config.outputs.run_name else 'run again'
    if config.ema.export_ema_unet:
        export_ema_unet(trainer, config.ema.export_ema_unet, again)
        announce(f'EMA UNet saved to {config.ema.export_ema_unet}')
    if folder := config.evaluation.export_pipeline:
        pipeline = export_pipeline(trainer, folder, config.evaluation.sample_scheduler, config.data.tokenizer, again)
        announce(f'pipeline saved to {folder} ({pipeline}.from_pretrained loads it)')


def warn_of_cuda_graphs_skipped(speed: SpeedSection) -> None:
    """Inductor runs a graph it cannot capture (dynamic shapes, CPU work, mutated inputs) without CUDA graphs, and
    says so only in its log: one line says it here, as the run's launches are then not the one replay asked for."""
    skipped = torch._dynamo.utils.counters['inductor']['cudagraph_skips']
    if speed.compile == 'reduce-overhead' and skipped:
        announce(
            f'warning: --compile reduce-overhead: Inductor ran {skipped} graph(s) without CUDA graphs (its log line '
            '"skipping cudagraphs due to ..." says why); the throughput is of that run'
        )


def checkpoint_of_batch_reached(trainer: Trainer, outputs: OutputSection, stop_on_signal: StopOnSignal) -> str:
    """Where the run writes checkpoints (one process, as a signal's stop does), one of the last batch trained, and
    the words saying so. The batch in progress stops before its optimizer step, so the weights, the optimizer and
    the EMA are those of the batch reached."""
    batch = int(trainer.state.timestamp.batch)
    if not stop_on_signal.writes_checkpoint or batch == 0:
        return ''
    folder = outputs.save_folder
    local = '://' not in folder
    written = local and any(
        int(CHECKPOINT_FILE.match(path.name).group(2)) == batch for path in checkpoint_files(Path(folder))
    )
    if not written:
        stop_on_signal.save_checkpoint()
        if not local:
            stop_on_signal.finish_uploads()
    return f'; batch {batch} is checkpointed in {folder}: rerun the same command with --autoresume to continue'


def not_uploaded_folder(outputs: OutputSection) -> Path:
    """Where checkpoints that a remote --save_folder refused for good are kept, under their names there."""
    return Path('results', 'not-uploaded', outputs.run_name).resolve()


def keep_batch_reached(trainer: Trainer, outputs: OutputSection) -> str:
    """The checkpoint of the batch reached, written beside the files not uploaded (unless one of them is it; on one
    process: with several, the others are in a step's collectives, which a save here would wait on), and the words
    saying how to continue."""
    for saver in remote_checkpoint_savers(trainer):
        settle_failed_uploads(saver.remote_uploader)
    batch = int(trainer.state.timestamp.batch)
    folder = not_uploaded_folder(outputs) / outputs.save_folder.split('://', 1)[1].partition('/')[2]
    name = f'ep{int(trainer.state.timestamp.epoch)}-ba{batch}-rank0.pt'  # Composer's checkpoint name
    if dist.get_world_size() > 1:
        return (
            f'the checkpoints not uploaded are in {folder}: copy them to {outputs.save_folder} once it answers, '
            'then rerun the same command with --autoresume to continue from the newest'
        )
    kept = checkpoint_files(folder) if folder.is_dir() else []
    if not any(int(CHECKPOINT_FILE.match(path.name).group(2)) == batch for path in kept):
        trainer.save_checkpoint(str(folder / name))
    return (
        f'batch {batch} is checkpointed in {folder}: copy its files to {outputs.save_folder} once it answers, '
        'then rerun the same command with --autoresume to continue'
    )


class IncompleteRun(RuntimeError):
    """Training ended before the requested duration without an error of its own (e.g. data that ran out)."""


def check_finished(trainer: Trainer, batch: BatchSection) -> None:
    """A run that trained fewer batches than asked for must not look like a finished one: Composer ends an epoch
    when the loader runs dry, and counts it done, however few batches it held."""
    trained = int(trainer.state.timestamp.batch)
    if trained < batch.num_batches:
        raise IncompleteRun(
            f'training stopped after {trained} of the {batch.num_batches} batches of --max_duration '
            f'{batch.max_duration}: the data ran out early (a shard or remote that failed?); no results written'
        )


def trained_to_the_end(trainer: Trainer) -> bool:
    duration = trainer.state.max_duration
    return trainer.state.timestamp.get(duration.unit).value >= duration.value


def write_whole(path: Path, text: str) -> None:
    """Written whole or not at all: a full disk leaves the earlier file, or none, never a cut-off one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f'.{path.name}.partial')
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error  # the file asked for, not the partial one
    finally:
        partial.unlink(missing_ok=True)


def describe_model(model_section: ModelSection, data: DataSection, model: DiffusionModel) -> str:
    where = f'model {model_section.model_name!r} from {model_section.model_dir}'
    if data.precomputed_latents:
        return (
            f'{where}: {model.denoiser_name} only ({"weights loaded" if model.weights_loaded else "random init"}); '
            'no VAE or text encoder: the data holds their outputs'
        )
    return f'{where}: {describe_weights(list(model.parts()), model.weights_loaded)}'


class LevelLines(logging.Formatter):
    """`warning: message`: a level the way this repo's own lines name it."""

    def format(self, record: logging.LogRecord) -> str:
        line = f'{record.levelname.lower()}: {record.getMessage()}'
        return f'{line}\n{self.formatException(record.exc_info)}' if record.exc_info else line


def warnings_as_lines() -> None:
    """Logged warnings (a bad sample, a validation sample left out) as `warning: ...` lines. torchao, which
    Diffusers imports, calls logging.debug() at import, and that installs Python's default root handler, which
    prints `WARNING:data:` before each line: that handler, where it is the one there, prints them as lines."""
    for handler in logging.getLogger().handlers:
        if handler.formatter is not None and handler.formatter._fmt == logging.BASIC_FORMAT:
            handler.setFormatter(LevelLines())


def announce(message: str) -> None:
    if dist.get_global_rank() == 0:
        print(message, flush=True)


def summarize(trainer: Trainer, config: RunConfig) -> Results:
    """Median of the rolling-window throughputs SpeedMonitor logged, with what is needed to compare runs."""
    logged = next(logger for logger in trainer.logger.destinations if isinstance(logger, InMemoryLogger)).data

    def median(metric):
        values = [float(value) for _, value in logged.get(metric, [])]
        return statistics.median(values) if values else None

    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    has_gpu = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if has_gpu else cpu_name()
    flops_per_sec = median('throughput/flops_per_sec')
    # MFU against the dense bf16/fp16 tensor-core peak (results.PEAK_FLOPS): the peak of mixed precision.
    peak = peak_flops(device_name) if has_gpu and config.batch.precision != 'fp32' else None
    return Results(
        img_per_sec=median('throughput/samples_per_sec'),
        img_per_sec_per_device=median('throughput/device/samples_per_sec'),
        flops_per_image=model.flops_per_image(config.data.image_size, config.data.image_size),
        trained_flops_per_image=model.trained_flops_per_image(config.data.image_size, config.data.image_size),
        trained_parameters=sum(p.numel() for p in model.denoiser.parameters()),
        flops_per_sec=flops_per_sec,
        mfu=mfu(flops_per_sec, config.batch.world_size, peak),
        throughput_windows=len(logged.get('throughput/samples_per_sec', [])),
        peak_gpu_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if has_gpu else None,
        peak_gpu_memory_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if has_gpu else None,
        device_train_microbatch_size=trainer.state.device_train_microbatch_size,
        bad_samples=int(logged['data/bad_samples'][-1][1]) if logged.get('data/bad_samples') else 0,
        bad_samples_distinct=int(logged['data/bad_samples_distinct'][-1][1])
        if logged.get('data/bad_samples_distinct')
        else 0,
        device_type='gpu' if has_gpu else 'cpu',
        device_name=device_name,
        num_devices=config.batch.world_size,
        world_size=config.batch.world_size,
        image_size=config.data.image_size,
        model_name=config.model.model_name,
        **validation_results(trainer),
        config=config.as_dict(),
        versions=package_versions(),
        provenance=provenance(first_step_end(trainer)),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    )


def first_step_end(trainer: Trainer) -> float | None:
    progress = next((cb for cb in trainer.state.callbacks if isinstance(cb, ProgressLines)), None)
    return None if progress is None else progress.first_end_wall_clock


def validation_results(trainer: Trainer) -> dict:
    """The validation losses (final, and against samples seen) and the seconds evaluation took beside training's."""
    fields = {}
    report = next((cb for cb in trainer.state.callbacks if isinstance(cb, ValidationReport)), None)
    for weights in ('', '_ema'):
        curve = report.curves.get(f'val{weights}', []) if report is not None else []
        if curve:
            fields[f'val_loss{weights}'] = curve[-1][1]
            fields[f'val_loss{weights}_curve'] = curve
    if report is not None:
        fields['train_seconds'] = trainer.state.timestamp.total_wct.total_seconds()
        fields['eval_seconds'] = report.seconds.get('validation', 0.0)
        fields['sample_seconds'] = report.seconds.get('samples', 0.0)
    return fields


# Fewer rolling windows than this leave a median that a single slow batch moves: the throughput line says so.
FEW_WINDOWS = 3


def print_summary(results: Results, trained: int, resumed: bool) -> str:
    """Prints the results of a run that trained `trained` batches in this process; returns the first line, the
    throughput."""
    if results.img_per_sec is None:
        line = (
            f'throughput: none measured: this process trained {trained} batch(es){" after resuming" * resumed}, and '
            'a throughput window needs at least 2 (the first, which holds the setup, is never in one)'
        )
        print(line, flush=True)
        return line
    line = (
        f'throughput: {results.img_per_sec:.2f} img/s ({results.img_per_sec_per_device:.2f} per device, '
        f'{results.num_devices} x {results.device_name})'
    )
    if results.flops_per_sec:
        line += f', {results.flops_per_sec / 1e12:.3g} TFLOP/s'
    if results.mfu:
        line += f', MFU {100 * results.mfu:.1f}%'
    windows = results.throughput_windows
    throughput = line + f'; median of {windows} rolling window{"s" * (windows != 1)}'
    if windows < FEW_WINDOWS:
        throughput += ' (few: the figure varies from run to run; 20 batches or more give a steadier one)'
    print(throughput, flush=True)
    if results.peak_gpu_memory_gb is not None:
        line = (
            f'peak GPU memory: {results.peak_gpu_memory_gb:.1f} GB allocated, '
            f'{results.peak_gpu_memory_reserved_gb:.1f} GB reserved (rank 0)'
        )
        if results.config.get('device_train_microbatch_size') == 'auto':
            line += f'; --device_train_microbatch_size auto found {results.device_train_microbatch_size}'
        print(line, flush=True)
    if results.val_loss_curve:
        line = f'validation loss: {results.val_loss_curve[0][1]:.5f} at the start, {results.val_loss:.5f} at the end'
        if results.val_loss_ema is not None:
            line += f' ({results.val_loss_ema:.5f} with the EMA weights)'
        print(line, flush=True)
    if results.train_seconds:
        evaluated = results.eval_seconds + results.sample_seconds
        print(
            f'evaluation: {evaluated:.1f} s ({results.eval_seconds:.1f} s validation, {results.sample_seconds:.1f} s '
            f'samples), {100 * evaluated / (evaluated + results.train_seconds):.1f}% of the run; outside the '
            'throughput windows',
            flush=True,
        )
    if results.bad_samples:
        print(
            f'data: {results.bad_samples} bad read(s) of {results.bad_samples_distinct} bad sample(s), each read '
            'replaced by the next good sample (a bad sample is read once an epoch, and warned about once)',
            flush=True,
        )
    return throughput


def close_process_group() -> None:
    """Ends the run's process group once it has finished. Left to the interpreter's exit, its threads were seen to
    abort a torchrun rank after its results were written (SIGABRT, 'terminate called without an active
    exception'), and NCCL warns that destroy_process_group() was not called."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main_reporting_errors(config: RunConfig, callbacks: tuple = (), announced: bool = False) -> Trainer:
    """main() with each error it expects reported as one line and an exit status: 2 for bad input found before
    training, 1 for a run that could not finish."""
    try:
        return main(config, callbacks, announced)
    except torch.OutOfMemoryError as error:
        if config.batch.device_train_microbatch_size == 'auto':
            raise  # Composer's search catches an OOM in a step itself: one that escapes it is left as it is
        stop(1, out_of_memory(config.model, config.data, config.batch, error))
    except Stopped as stopped:
        stop(stopped.exit_status, str(stopped))
    except ConfigError as error:
        stop(2, str(error))
    except IncompleteRun as error:
        stop(1, str(error))
    except CheckpointWriteError as error:
        stop(1, f'--save_folder {error.file.parent}: {error}; {after_failed_checkpoint(error.file)}')
    except OSError as error:  # a write of the run failed (results, export, samples): a full disk, a removed folder
        if (line := shared_memory_full(error)) is not None:
            stop(1, line)
        where = f'{error.filename}: ' if error.filename else ''
        fix = '; nothing of it was written (an earlier file is as it was): free space there and run again'
        stop(1, f'{where}{error.strerror or error}{fix if error.errno == errno.ENOSPC else ""}')
    except torch._dynamo.exc.TorchDynamoException as error:  # --compile: tracing, compiling or a CUDA graph failed
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        reason = ' '.join(lines[:2]) if lines[0].endswith(':') else lines[0]  # "backend='inductor' raised:", why
        stop(1, f'--compile {config.speed.compile}: {reason}; run without --compile, or with another mode')
    except (DataError, TokenizerError) as error:  # found while training, e.g. a dataset of mostly bad samples
        # Raised in a dataloader worker, the message carries the worker's traceback: its last line is the reason.
        last_line = str(error).strip().splitlines()[-1]
        names = '|'.join(re.escape(f'{kind.__module__}.{kind.__name__}') for kind in (DataError, TokenizerError))
        stop(1, re.sub(rf'^({names}): ', '', last_line))
    except RuntimeError as error:
        if (line := loader_failure(error, loader_timeout())) is None:
            raise
        stop(1, line)


def after_failed_checkpoint(file: Path) -> str:
    """What a failed checkpoint write left (a partial file set aside now, so that --autoresume continues from the
    newest whole checkpoint; nothing, where the folder refused the file) and where the run can continue from."""
    folder, left = file.parent, 'nothing of it was left'
    if dist.get_global_rank() == 0 and folder.is_dir():
        with contextlib.suppress(OSError):  # a folder turned read-only cannot rename either: nothing was written
            set_aside_incomplete(folder)
        if file.with_name(file.name + '.incomplete').exists():
            left = f'set aside as {file.name}.incomplete (remove it to free its space)'
    whole = checkpoint_files(folder) if folder.is_dir() else []
    if not whole:
        return f'{left}; no complete checkpoint is there to continue from'
    return f'{left}, and --autoresume continues from the newest complete checkpoint, {whole[-1].name}'


def out_of_memory(model: ModelSection, data: DataSection, batch: BatchSection, error: torch.OutOfMemoryError) -> str:
    """What ran out of memory (the microbatch, with its plan's figures where memory_plan.py planned it), the peaks
    this process reached, and a smaller microbatch to try."""
    microbatch, device_batch = batch.device_train_microbatch_size, batch.device_batch_size
    on_gpu = torch.cuda.is_available()
    line = f'out of {"GPU " if on_gpu else ""}memory with microbatch {microbatch} of {model.model_name} at '
    line += f'{data.image_size}px'
    if batch.memory_plan is not None and batch.memory_plan.microbatch == microbatch:
        line += f' (planned: {batch.memory_plan.sum()})'
    tried = re.search(r'Tried to allocate ([\d.]+ \w+)', str(error))
    if tried:
        line += f', allocating {tried[1]}'
    if on_gpu:
        line += (
            f'; peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB allocated, '
            f'{torch.cuda.max_memory_reserved() / 1e9:.1f} GB reserved'
        )
    # The largest microbatch of at most half this one that divides the device batch, as a microbatch must.
    smaller = next((size for size in range(microbatch // 2, 0, -1) if device_batch % size == 0), None)
    if smaller is None:
        return f'{line}: microbatch 1 is the smallest: pass --activation_checkpointing, or shard with --fsdp full_shard'
    return (
        f"{line}: pass --device_train_microbatch_size auto (Composer's search for one that fits) or "
        f'--device_train_microbatch_size {smaller}'
    )
