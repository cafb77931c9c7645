"""The step models of the runs report.py reads (costs/step_model.py's ScalingModel), one per phase of the budget:
each measured run's workload from its results file's configuration, or for a throughput given by hand the
published run's (batch, microbatch, SD2's UNet, DDP, AdamW and EMA); a phase with no run of its own scales another
phase's compute by the FLOPs per image. Numbers only: costs/prediction_text.py says what they assume.
"""

from dataclasses import dataclass, replace
from typing import Protocol

from costs.measurements import PUBLISHED_MODEL
from costs.step_model import (
    ADAMW_BYTES,
    EMA_BYTES,
    Assumptions,
    Measurement,
    ScalingError,
    Workload,
    band,
    calibrate,
    log2_interpolate,
)

# Training FLOPs per image (3 x UNet forward + VAE encoder forward + text encoder forward), counted
# analytically for SD2-base (UNet forward 0.80 TFLOP at 512px, VAE encoder 1.12, text encoder 0.045):
# used when a results file has none, here for the UNet's share and in the report for MFU.
FLOPS_PER_IMAGE = {512: 3.58e12, 256: 0.54e12 + 0.27e12 + 0.045e12}
# The UNet's share of them (forward and backward), and the parameters it trains: what a prediction assumes of a
# throughput given by hand.
TRAINED_FLOPS_PER_IMAGE = {512: 2.41e12, 256: 0.54e12}
SD2_UNET_PARAMETERS = 865_910_724


class PredictionError(ScalingError):
    """A measured run the prediction cannot start from. Unlike the step model's errors its message is complete:
    it names the results file or report.py's flag, so the report shows it as it is."""


class MeasuredRun(Protocol):
    """One measured throughput as report.py reads it (its Point): from a results file, or given by hand."""

    gpus: int
    img_per_sec: float
    image_size: int
    source: str  # the results file, or the flag and value given by hand
    model: str | None
    precomputed: bool | None  # trained from precomputed latents (the UNet alone); None: not known
    run: dict | None  # the results file's configuration (batch, microbatch, fsdp, ...); None: by hand
    trained_parameters: int | None
    flops_per_image: float | None
    trained_flops_per_image: float | None


@dataclass(frozen=True)
class PredictionSettings:
    """The batch of the predicted runs, and what a throughput given by hand is taken to be (a results file
    carries its own microbatch and parameter count)."""

    global_batch: int
    microbatch: int  # of a throughput given by hand
    trained_parameters: int | None = None  # of a throughput given by hand; None: SD2's UNet
    gradient_value_bytes: int = 4  # of a throughput given by hand: fp32 gradients reduced, as Composer's AMP does
    images_per_gpu: int | None = None  # weak scaling: the predicted runs' images per GPU per step, not global_batch
    # The global batch of a throughput given by hand where it differs from the predicted runs' (MLPerf's 8-GPU
    # runs train 256 images a step, its 64-GPU runs 1,024); None: global_batch, or images_per_gpu per GPU.
    measured_batch: int | None = None
    # Per-GPU throughput at several microbatches, ((microbatch, img/s per GPU), ...), of the measured runs' GPU,
    # model and image size: how one image's compute time changes with the microbatch. Empty: it does not.
    microbatch_curve: tuple[tuple[int, float], ...] = ()


def prediction_models(
    points: list[MeasuredRun],
    phases: list[int | None],
    counts: list[int],
    assumptions: Assumptions,
    settings: PredictionSettings,
    label: str,
) -> tuple[dict, dict]:
    """{phase: ScalingModel} calibrated on the one measured run of each phase, and {phase: {uncertain input: band
    corners}}. A phase with no run of its own (the 256px phase of the published schedule, when only 512px was
    measured) scales the other phase's compute time by the FLOP ratio: the same MFU at both sizes (its model's
    scaled_from says so)."""
    models, bands = {}, {}
    for phase in phases:
        runs = [p for p in points if phase is None or p.image_size == phase]
        if len(runs) > 1:
            raise PredictionError(
                f'--predict starts from one measured run per phase; got {len(runs)} at '
                f'{phase or runs[0].image_size}px ({", ".join(p.source for p in runs)}): pass one, or leave '
                'out --predict to fit them'
            )
        if runs:
            workload, batch, microbatch = prediction_workload(runs[0], settings)
            start = Measurement(runs[0].gpus, runs[0].img_per_sec, batch, microbatch)
            models[phase] = calibrate(workload, assumptions, start)
            bands[phase] = band(workload, assumptions, start)
    for phase in phases:
        if phase in models:
            continue
        source = next(iter(models.values()), None)
        size = next(p.image_size for p in points)
        if source is None or size not in FLOPS_PER_IMAGE or phase not in FLOPS_PER_IMAGE:
            raise PredictionError(f'--samples: no throughput measured at {phase}px for {label}')
        precomputed = bool(points[0].precomputed)
        ratio = scaled_flops(phase, precomputed) / scaled_flops(size, precomputed)
        workload = replace(source.workload, **shares(phase, precomputed))
        models[phase] = source.scaled(ratio, workload, size)
        bands[phase] = {
            name: [corner.scaled(ratio, workload, size) for corner in corners]
            for name, corners in bands[next(iter(bands))].items()
        }
    for model in models.values():
        for gpus in counts:
            model.step(gpus)  # each count must divide the batch: say so before printing anything
    return models, bands


def scaled_flops(image_size: int, precomputed: bool) -> float:
    return (TRAINED_FLOPS_PER_IMAGE if precomputed else FLOPS_PER_IMAGE)[image_size]


def shares(image_size: int, precomputed: bool) -> dict:
    """The UNet's share of an image's compute (its backward: two thirds of it), from the analytic SD2 FLOPs."""
    trained = 1.0 if precomputed else TRAINED_FLOPS_PER_IMAGE[image_size] / FLOPS_PER_IMAGE[image_size]
    return {'trained_share': trained, 'backward_share': 2 / 3 * trained}


def prediction_workload(point: MeasuredRun, settings: PredictionSettings) -> tuple[Workload, int, int]:
    """(Workload, measured batch, measured microbatch) of one measured run: a results file's own configuration,
    or for a value given by hand the published run's (batch settings.global_batch, microbatch settings.microbatch,
    SD2 UNet, DDP, AdamW and EMA)."""
    run = point.run
    if run is None:
        trained = settings.trained_parameters or SD2_UNET_PARAMETERS
        batch, microbatch = settings.global_batch, settings.microbatch
        if settings.measured_batch is not None:
            batch = settings.measured_batch
        elif settings.images_per_gpu is not None:  # weak scaling: the measured run had as many images per GPU
            batch = settings.images_per_gpu * point.gpus
        fsdp, precision, fused, ema = 'none', 'amp_fp16', False, True
        gradient_value_bytes = settings.gradient_value_bytes
    else:
        trained = point.trained_parameters or (SD2_UNET_PARAMETERS if point.model == PUBLISHED_MODEL else None)
        if trained is None:
            raise PredictionError(f"{point.source}: no 'trained_parameters' (written by newer benchmark.py runs)")
        batch, microbatch = run.get('batch_size'), run.get('device_train_microbatch_size')
        if not isinstance(batch, int) or not isinstance(microbatch, int):
            raise PredictionError(
                f"{point.source}: --predict needs the run's batch and a fixed microbatch (got batch {batch!r}, "
                f'microbatch {microbatch!r}); measure with --device_train_microbatch_size N'
            )
        fsdp, precision = run.get('fsdp', 'none'), run.get('precision', 'amp_bf16')
        fused, ema = bool(run.get('fused_adamw')), bool(run.get('use_ema'))
        gradient_value_bytes = 4  # benchmark.py's runs reduce fp32 gradients, under DDP and FSDP alike
    if point.flops_per_image and point.trained_flops_per_image:
        trained_share = point.trained_flops_per_image / point.flops_per_image
        split = {'trained_share': trained_share, 'backward_share': 2 / 3 * trained_share}
    elif point.image_size in FLOPS_PER_IMAGE:
        split = shares(point.image_size, bool(point.precomputed))
    else:
        raise PredictionError(f"{point.source}: --predict needs the UNet's FLOPs at {point.image_size}px")
    workload = Workload(
        global_batch=settings.global_batch,
        images_per_gpu=settings.images_per_gpu,
        microbatch_curve=relative_image_times(settings.microbatch_curve, microbatch, point.source),
        microbatch=microbatch,
        trained_parameters=trained,
        fsdp=fsdp,
        param_bytes=4 if precision == 'fp32' else 2,
        gradient_value_bytes=gradient_value_bytes,
        fixed_bytes_per_parameter=ADAMW_BYTES['fused' if fused else 'foreach'] + (EMA_BYTES if ema else 0),
        **split,
    )
    return workload, batch, microbatch


def relative_image_times(curve: tuple[tuple[int, float], ...], microbatch: int, source: str) -> tuple:
    """Per-GPU throughputs at several microbatches -> ((microbatch, one image's time relative to the measured
    run's microbatch), ...). The measured microbatch must lie within the curve."""
    if not curve:
        return ()
    times = tuple((m, 1 / rate) for m, rate in curve)  # seconds per image on one GPU
    microbatches = sorted(m for m, _ in curve)
    if not microbatches[0] <= microbatch <= microbatches[-1]:
        raise PredictionError(
            f'--microbatch_curve: covers microbatches {microbatches[0]}-{microbatches[-1]}, not the '
            f'microbatch {microbatch} of {source}: add a run at it'
        )
    reference = log2_interpolate(times, microbatch)
    return tuple((m, seconds / reference) for m, seconds in sorted(times))
