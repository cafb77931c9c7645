"""What the report says of a prediction by the step model (report.py --predict): each phase's inputs and step
breakdown, the range and what moves it most, the error against reference throughputs, and the notes on what the
prediction assumes. The numbers come from costs/step_model.py and costs/calibration.py; the words are written here.
"""

from costs.step_model import (
    FIXED_WORK_BAND,
    GRADIENT_DTYPES,
    LINK_EFFICIENCY_BAND,
    SCALE_LOSS_BAND,
    SMALLER_MICROBATCHES,
    ScalingModel,
    dominant_input,
    fixed_seconds,
    overall_img_per_sec,
    prediction_range,
    scaling_efficiency,
    uncertain_inputs,
)

# Each uncertain input's band, as the range's line names it.
BANDS_DESCRIBED = {
    'link efficiency': '{:.0%}-{:.0%}'.format(*LINK_EFFICIENCY_BAND),
    'fixed work': 'x{:g}-x{:g}'.format(*FIXED_WORK_BAND),
    'losses growing with the node count': '0-{:.1%} of the step per doubling of the nodes'.format(SCALE_LOSS_BAND[1]),
    'network layout': "every GPU's share over its own link or rail-aligned rings (the cluster's is not known)",
    SMALLER_MICROBATCHES: "as fast as measured to a whole measured microbatch's time (no --microbatch_curve)",
}


def describe_prediction(
    label: str,
    models: dict,
    bands: dict,
    budget: dict,
    counts: list[int],
    references: list[tuple[int, float]],
    base: tuple[int, dict],
) -> str:
    """The model's inputs, each predicted step's breakdown at `counts`, its range, and its error against
    `references` ([(GPUs, img/s)]). Scaling efficiency is against `base`, (GPUs, {phase: img/s}): the base row of
    the report's table, so that both give one figure for a row."""
    lines = []
    for phase, model in models.items():
        lines += model_lines(f'{label}' + (f' {phase}px' if phase else ''), model)
        lines += step_table_lines(model, bands[phase], counts, base[0], base[1][phase])
    lines.append(range_line(models, bands, counts))
    lines += reference_lines(models, bands, budget, references)
    return '\n'.join(lines) + '\n'


def origin(model: ScalingModel) -> str:
    """Where one image's compute time of `model` comes from."""
    if model.scaled_from is None:
        return 'solved from the measured run'
    size, ratio = model.scaled_from
    return f"the {size}px run's, scaled by the FLOPs per image ({ratio:.3f}x)"


def model_lines(heading: str, model: ScalingModel) -> list[str]:
    """The heading of one phase's step model and its inputs: compute, cluster, communication, fixed work and the
    losses growing with the node count."""
    w, a = model.workload, model.assumptions
    c = a.cluster
    fixed = fixed_seconds(w, a, 1)
    return [
        f'### {heading}: step model',
        '',
        f'- one image forward and backward on one GPU: {1000 * model.image_seconds:.2f} ms ({origin(model)}); '
        + (
            f'global batch {w.global_batch}'
            if w.images_per_gpu is None
            else f'{w.images_per_gpu} images per GPU per step (the global batch grows with the GPUs)'
        )
        + f', microbatch {w.microbatch}',
        f'- cluster: {c.description}: {c.gpus_per_node} GPUs per node, NVLink {c.nvlink_gb_s:g} GB/s and network '
        f'{c.network_gb_s:g} GB/s per GPU, at {a.link_efficiency:.0%} of the link rate'
        + (f'; NVLS inside a node ({c.nvls_gb_s:g} GB/s bus bandwidth)' if c.nvls_gb_s else '')
        + (
            "; rail-aligned rings (the network carries one GPU's share per node)"
            if (c.rail_aligned if a.rail_aligned is None else a.rail_aligned)
            else "; every GPU's share over its own network link"
        ),
        '- communication: ' + communication_text(model),
        f'- fixed work per step (optimizer step and EMA): {1000 * fixed:.1f} ms'
        + (
            ''
            if a.fixed_seconds is not None
            else f' ({w.fixed_bytes_per_parameter} bytes per parameter at {c.memory_gb_s:,.0f} GB/s)'
        )
        + (', divided among the GPUs under FSDP' if w.fsdp != 'none' else ''),
        f'- losses growing with the node count: {a.node_loss:.1%} of the step per doubling of the nodes '
        + (
            "(fitted to NeMo's published DGX A100 and H100 weak scaling; --scale_loss sets it)"
            if a.scale_loss is None
            else '(--scale_loss)'
        ),
        '',
    ]


def communication_text(model: ScalingModel) -> str:
    """What one step communicates: DDP's all-reduce of the gradients, or FSDP's gathers and reduce-scatters."""
    w = model.workload
    gradients = f'{w.gradient_bytes / 1e9:.2f} GB of {GRADIENT_DTYPES[w.gradient_value_bytes]} gradients'
    if w.fsdp == 'none':
        overlap = "overlapped with the last microbatch's backward" if model.assumptions.overlap else 'not overlapped'
        return f'{gradients} ({w.trained_parameters:,} parameters) all-reduced per step, {overlap}'
    return (
        f'FSDP {w.fsdp}: per microbatch, {2 if w.fsdp == "full_shard" else 1} gather(s) of '
        f'{w.param_bytes * w.trained_parameters / 1e9:.2f} GB of parameters and a reduce-scatter of '
        f'{gradients} ({w.trained_parameters:,} parameters)'
    )


def step_table_lines(
    model: ScalingModel, corners: dict, counts: list[int], base_gpus: int, base_img_per_sec: float
) -> list[str]:
    """One phase's step breakdown at each of `counts`, with its scaling efficiency against the base row and the
    range its uncertain inputs (`corners`) give."""
    lines = [
        '| GPUs | nodes | img/GPU/step | microbatches | compute s | communication s | exposed s | fixed s '
        f'| node losses s | step s | img/s | scaling eff. (vs {base_gpus:,}) | range img/s |',
        '|' + '---|' * 13,
    ]
    for gpus in counts:
        st = model.step(gpus)
        low, high = prediction_range({None: model}, {None: corners}, {None: 1}, gpus)
        efficiency = scaling_efficiency(st.img_per_sec, gpus, base_img_per_sec, base_gpus)
        lines.append(
            f'| {gpus:,} | {st.nodes} | {st.images_per_gpu:g} | {st.microbatches} | {st.compute:.3f} '
            f'| {st.communication:.3f} | {st.exposed:.3f} | {st.fixed:.3f} | {st.node_losses:.3f} '
            f'| {st.seconds:.3f} | {st.img_per_sec:,.1f} | {efficiency:.1%} | {low:,.1f}-{high:,.1f} |'
        )
    lines.append('')
    return lines


def range_line(models: dict, bands: dict, counts: list[int]) -> str:
    """The inputs the range spans, each with its band, and the one that moves the prediction most at the largest
    count."""
    first_phase = next(iter(models))
    workload = models[first_phase].workload
    inputs = uncertain_inputs(models[first_phase].assumptions, workload)
    if not any(workload.below_microbatch(gpus) for gpus in counts):
        inputs.pop(SMALLER_MICROBATCHES, None)  # no predicted step goes below the measured microbatch
    largest = counts[-1]
    return (
        'Range: how far each input not known for this cluster moves the prediction over its band, the moves '
        'combined in quadrature (the network layout and the losses growing with the node count added first, as '
        'one cluster sits at the same end of both): '
        + '; '.join(f'{name} {BANDS_DESCRIBED[name]}' for name in inputs)
        + f'. At {largest:,} GPUs {dominant_input(bands[first_phase], largest)} moves it most.\n'
    )


def reference_lines(models: dict, bands: dict, budget: dict, references: list[tuple[int, float]]) -> list[str]:
    """Each reference throughput against the prediction over the budget: its error, and whether the range holds
    it."""
    if not references:
        return []
    lines = ['Against the reference throughputs:\n']
    for gpus, reference in references:
        predicted = overall_img_per_sec(models, budget, gpus)
        low, high = prediction_range(models, bands, budget, gpus)
        inside = low <= reference <= high
        lines.append(
            f'- {gpus:,} GPUs: predicted {predicted:,.1f} img/s, reference {reference:,.1f}: '
            f'error {predicted / reference - 1:+.1%}; range {low:,.1f}-{high:,.1f} '
            + ('(inside)' if inside else '(OUTSIDE)')
        )
    return lines


# ------------------------------------------------------------------------------ the notes under the tables


def prediction_notes(models: dict, bands: dict, counts: list[int], label: str) -> list[str]:
    """What the calibrated models assume beyond the measured runs: a phase scaled from another's run, and steps
    below the measured microbatch."""
    return scaled_phase_notes(models, label) + small_microbatch_notes(models, bands, counts, label)


def scaled_phase_notes(models: dict, label: str) -> list[str]:
    """A line for each phase without a run of its own, whose compute is another size's scaled by the FLOPs."""
    notes = []
    for phase, model in models.items():
        if model.scaled_from is not None:
            size, ratio = model.scaled_from
            notes.append(
                f"{label}: no run at {phase}px: its compute is the {size}px run's scaled by the FLOPs per image "
                f'({ratio:.3f}x), which assumes the same MFU at both sizes (smaller images usually reach less)'
            )
    return notes


def small_microbatch_notes(models: dict, bands: dict, counts: list[int], label: str) -> list[str]:
    """Where a predicted step leaves each GPU fewer images than the measured microbatch and no curve measures it:
    one image's compute is taken as measured centrally, though a GPU given smaller microbatches usually computes
    each image more slowly; the note says how far that alone lowers the range."""
    notes = []
    for phase, model in models.items():
        workload = model.workload
        if workload.microbatch_curve:  # measured: the steps' compute follows the curve
            continue
        small = [gpus for gpus in counts if workload.below_microbatch(gpus)]
        if small:
            largest = small[-1]
            low = min(corner.img_per_sec(largest) for corner in bands[phase][SMALLER_MICROBATCHES])
            notes.append(
                f'{label}: at {", ".join(f"{gpus:,}" for gpus in small)} GPUs each GPU gets fewer than the measured '
                f"microbatch of {workload.microbatch} images per step, and one image's compute is taken as measured "
                'at that microbatch: smaller microbatches usually compute each image more slowly (fewer images '
                'to fill the GPU), so read these rows as upper bounds. Not knowing how much slower widens the '
                f'range: at {largest:,} GPUs its low end alone is {low:,.1f} img/s '
                f'({low / model.img_per_sec(largest) - 1:+.0%}), a smaller microbatch taking as long as a measured '
                'one; --microbatch_curve with runs at smaller microbatches measures it'
            )
            break
    return notes


def assumed_batch_notes(points, settings, label: str) -> list[str]:
    """A line for each throughput given by hand that is taken as measured at the predicted runs' batch (no
    --measured_batch): the batch a run trains sets how many images share a step's fixed work, so the batch it was
    really measured at changes the prediction. Results files record their own."""
    notes = []
    for point in points:
        if point.run is not None or settings.measured_batch is not None:
            continue
        if settings.images_per_gpu is not None:
            batch = settings.images_per_gpu * point.gpus
            taken = f'{settings.images_per_gpu} images per GPU (--images_per_gpu), a global batch of {batch:,}'
        else:
            taken = f"the predicted runs' global batch of {settings.global_batch:,}"
        notes.append(
            f'{label}: {point.source} is taken as measured at {taken}; if it ran at another, --measured_batch N '
            'gives it (it changes the prediction)'
        )
    return notes


def other_cluster_note(label: str, gpu: str, cluster_name: str) -> str:
    """Another GPU's compute on this cluster's links: said in the step model's heading, the figure and here."""
    return (
        f'{label}: predicted on the {cluster_name} cluster preset from a run measured on {gpu}: the compute per '
        f"image is the {gpu}'s as measured, only the interconnect and memory bandwidth are the {cluster_name}'s, so "
        f'these are not {cluster_name} figures; measure on {cluster_name}s, or give their throughput by hand: '
        f'--gpu_type {cluster_name} --throughput GPUS=IMG_S'
    )
