"""The prediction of report.py --predict for one table: the cluster and settings its flags give, checked against
the measured runs (a CPU's predicts no GPU cluster; the predicted runs' batch), and the step models calibrated on
them, with the notes on what they assume. Any problem is one line, a ReportError.
"""

from dataclasses import replace

from costs import calibration, step_model
from costs.measurements import UNNAMED_GPU, ReportError, microbatch_curve
from costs.prediction_text import assumed_batch_notes, other_cluster_note, prediction_notes
from costs.tables import phase_order

# The published run's batch and microbatch: what --predict assumes of a throughput given by hand.
PUBLISHED_BATCH, PUBLISHED_MICROBATCH = 2048, 4


def predict(points, args, gpu, label):
    """--predict for one table: calibration.prediction_models on the cluster and settings the flags give, its errors
    as one-line ReportErrors. Returns the models, their bands, notes, and the cluster preset where it is another
    GPU's than the measured one (else None)."""
    cluster_name = args.cluster or gpu
    refuse_a_cpu_run(points, cluster_name)
    if cluster_name not in step_model.CLUSTERS:
        raise ReportError(
            f'--predict: no cluster preset for GPU type {gpu!r}; pass --cluster '
            f'({", ".join(sorted(step_model.CLUSTERS))}), adjusted with --nvlink_gb_s, --network_gb_s, --memory_gb_s'
        )
    overrides = {
        field: getattr(args, field)
        for field in ('gpus_per_node', 'nvlink_gb_s', 'network_gb_s', 'memory_gb_s')
        if getattr(args, field) is not None
    }
    assumptions = step_model.Assumptions(
        replace(step_model.CLUSTERS[cluster_name], **overrides),
        link_efficiency=args.link_efficiency,
        overlap=not args.no_overlap,
        rail_aligned=args.rail_aligned,
        fixed_seconds=None if args.fixed_ms is None else args.fixed_ms / 1000,
        scale_loss=args.scale_loss,
    )
    settings = calibration.PredictionSettings(
        global_batch=predicted_batch(points, args),
        microbatch=args.microbatch,
        trained_parameters=args.trained_parameters,
        gradient_value_bytes=args.gradient_value_bytes,
        images_per_gpu=args.images_per_gpu,
        measured_batch=args.measured_batch,
        microbatch_curve=microbatch_curve(args.microbatch_curve, points),
    )
    phases = phase_order(args.budget)
    try:
        models, bands = calibration.prediction_models(points, phases, args.predict, assumptions, settings, label)
    except calibration.PredictionError as error:  # complete: it names the results file or the flag
        raise ReportError(str(error))
    except step_model.ScalingError as error:  # the step model's: say that --predict led to it
        raise ReportError(f'--predict: {error}')
    notes = prediction_notes(models, bands, args.predict, label) + assumed_batch_notes(points, settings, label)
    if gpu in (cluster_name, UNNAMED_GPU):
        return models, bands, notes, None
    # Another GPU's compute on this cluster's links: said in the step model's heading, the figure and a note.
    return models, bands, [*notes, other_cluster_note(label, gpu, cluster_name)], cluster_name


def refuse_a_cpu_run(points, cluster_name):
    """A CPU's step time says nothing of a GPU's: a prediction for a GPU cluster from it would read as measured
    there."""
    cpu = next((p for p in points if p.device_type == 'cpu'), None)
    if cpu is None:
        return
    known = cluster_name in step_model.CLUSTERS
    raise ReportError(
        f'--predict: {cpu.source} was measured on a CPU ({cpu.gpu}), whose step time predicts nothing of '
        + (f'the {cluster_name} cluster; measure on {cluster_name}s' if known else 'a GPU cluster; measure on GPUs')
        + f', or give their throughput by hand: --gpu_type {cluster_name if known else "H100"} --throughput GPUS=IMG_S'
    )


def predicted_batch(points, args):
    """The global batch of the predicted runs: --global_batch, else the measured run's own (its results file's),
    else, for a throughput given by hand, the published run's."""
    if args.global_batch is not None:
        return args.global_batch
    runs = [p for p in points if p.run is not None]
    batches = {p.run.get('batch_size') for p in runs}
    if len(batches) > 1:
        listing = ', '.join(f'{p.source}: {p.run.get("batch_size")}' for p in runs)
        raise ReportError(
            f"--predict: the results files ran at different global batches ({listing}); give the predicted runs' "
            'with --global_batch'
        )
    batch = next(iter(batches), None)
    if not isinstance(batch, int) or batch <= 0:  # none, or a results file without one: calibration.py names it
        return PUBLISHED_BATCH
    for gpus in args.predict if args.images_per_gpu is None else []:
        if batch % gpus:
            raise ReportError(
                f"--predict: {gpus} GPUs do not divide the global batch of {batch}, the measured run's "
                f"({runs[0].source}); give the predicted runs' with --global_batch"
            )
    return batch
