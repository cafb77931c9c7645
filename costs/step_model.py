"""Predicting throughput at other GPU counts from one measured run: the step model behind report.py --predict.

The throughput of data-parallel training at any GPU count follows from one measured run and the cluster's
interconnect, step by step rather than fitted to several measured counts.

One optimizer step at a fixed global batch B on N GPUs, each running B/N images in microbatches of m:

    step      = (compute + exposed communication + fixed work) x (1 + node loss x log2(nodes))
    compute   = (B / N) x t_image            t_image: one image's forward and backward on one GPU (measured)
    exposed   = communication - the compute that overlaps it (none when --no_overlap)
    fixed     = per-step work on each GPU that more GPUs do not shrink: the optimizer step and EMA update,
                memory-bound, so their bytes over the GPU's memory bandwidth
    node loss = what the rest leaves out and grows with the node count (latency, synchronisation, stragglers),
                a share of the step per doubling of the nodes fitted to published weak scaling (SCALE_LOSS)

Communication is ring collectives, which move (N-1)/N of a buffer per GPU for a reduce-scatter or all-gather
and 2(N-1)/N for an all-reduce (NCCL calls bytes / time of the latter "bus bandwidth"). Inside a node they run
over NVLink, with NVLink SHARP where the node has it (NVLS: the switches reduce, measured bus bandwidth). Once
the ring spans nodes, it depends on the node's design. On rail-optimized nodes (H100, H200 and B200 presets)
NCCL's rings pass through a node's GPUs over NVLink and cross the network once per node, one ring per network
card: a node's traffic goes over all its cards together, and the network carries one GPU's share per node.
Otherwise every GPU's share goes over its own link, which then sets the pace; for the A100 preset (the published
run's cluster, whose layout is not known) that is the central reading, and the range spans both.

- DDP (the published run): Composer skips gradient synchronization on all but the last microbatch of a step,
  so one all-reduce of the trained parameters' fp32 gradients per step, overlapped with the last microbatch's
  backward (DDP reduces gradient buckets as the backward fills them).
- FSDP: every microbatch gathers the parameters (in the autocast dtype) and reduce-scatters the fp32 gradients
  (Composer uses no_sync with DDP only); full_shard gathers twice (forward and backward). The collectives
  overlap that microbatch's UNet forward and backward. The optimizer step and EMA work on a 1/N shard.

t_image comes from the measured run by solving the same equation at its GPU count, so communication and
fixed work there are not counted as compute. Every assumption is a field of Assumptions, with its source; the
range of a prediction combines how far each uncertain one moves it over its band (prediction_range).

Numbers only: costs/calibration.py calibrates the model on the runs report.py reads (one per phase of the budget),
and costs/prediction_text.py writes each step's breakdown.
"""

import math
from dataclasses import dataclass, replace


class ScalingError(ValueError):
    """An input the model cannot use, named in the message."""


@dataclass(frozen=True)
class Cluster:
    """Per-GPU bandwidths of one kind of node, in GB/s (1e9 bytes per second), one direction."""

    description: str
    gpus_per_node: int
    nvlink_gb_s: float  # GPU to GPU inside a node
    network_gb_s: float  # this GPU's share of the node's network links
    memory_gb_s: float  # HBM, for the memory-bound optimizer step and EMA update
    # Rail-optimized nodes (one NIC per GPU, each on its own leaf switch): NCCL reduces inside the node first and
    # every NIC carries its share across nodes, so the node's NICs together pace the ring. False: every GPU's share
    # goes over its own NIC. None: not known (the published A100 cluster's): the central reading is False, and the
    # range spans both.
    rail_aligned: bool | None = None
    # The all-reduce bus bandwidth NCCL reaches inside a node with NVLink SHARP (NVLS), measured; None: no NVLS,
    # the ring at the link efficiency.
    nvls_gb_s: float | None = None


# NVIDIA datasheets: NVLink 3 moves 600 GB/s per A100 counting both directions (300 each way), NVLink 4
# 900 GB/s (H100, H200), NVLink 5 1.8 TB/s (B200). Networks: one NIC per GPU, 200 Gb/s HDR InfiniBand on 2022
# A100 clusters such as the published run's (25 GB/s), 400 Gb/s NDR on H100/H200/B200 nodes (50 GB/s).
# HBM: A100-40GB 1,555 GB/s, H100 SXM 3,350, H200 4,800, B200 8,000. H100, H200 and B200 nodes are rail-optimized
# (DGX SuperPOD reference designs; measured multi-node all-reduce 330-350 GB/s per node of 8 NDR NICs, nccl-tests
# issues 290 and 283), and NCCL uses NVLS inside the node: all-reduce bus bandwidth 480 GB/s on 8 H100 (ring:
# 370; NCCL issue 1442, nccl-tests issue 212), 475 on 8 H200 (nccl-tests issue 272), about 830 on 8 B200 (NCCL
# issue 1807). The A100 preset is the published run's cluster, read from its table (docs/report.md).
CLUSTERS = {
    'A100': Cluster('8x A100-SXM4-40GB per node, NVLink 3, 8x 200 Gb/s HDR InfiniBand', 8, 300, 25, 1555),
    'H100': Cluster(
        '8x H100 SXM per node, NVLink 4 with NVLS, 8x 400 Gb/s NDR InfiniBand, rail-optimized',
        gpus_per_node=8,
        nvlink_gb_s=450,
        network_gb_s=50,
        memory_gb_s=3350,
        rail_aligned=True,
        nvls_gb_s=480,
    ),
    'H200': Cluster(
        '8x H200 SXM per node, NVLink 4 with NVLS, 8x 400 Gb/s NDR InfiniBand, rail-optimized',
        gpus_per_node=8,
        nvlink_gb_s=450,
        network_gb_s=50,
        memory_gb_s=4800,
        rail_aligned=True,
        nvls_gb_s=475,
    ),
    'B200': Cluster(
        '8x B200 per node, NVLink 5 with NVLS, 8x 400 Gb/s NDR InfiniBand, rail-optimized',
        gpus_per_node=8,
        nvlink_gb_s=900,
        network_gb_s=50,
        memory_gb_s=8000,
        rail_aligned=True,
        nvls_gb_s=830,
    ),
}

# Bytes each trained parameter moves through GPU memory in the per-step work, in fp32. AdamW: a fused kernel
# reads parameter, gradient and both moments and writes parameter and moments (28 bytes); PyTorch's default
# multi-tensor (foreach) AdamW makes about ten passes, each a read or read-modify-write (about 80 bytes). EMA:
# the average and the weights read, the average written (12 bytes).
ADAMW_BYTES = {'fused': 28, 'foreach': 80}
GRADIENT_DTYPES = {4: 'fp32', 2: 'bf16/fp16'}  # by bytes per gradient value
EMA_BYTES = 12

# nccl-tests typically reach 80-90% of the link rate as bus bandwidth (NCCL's protocol overhead is about 20%,
# nccl-tests issue 212): the central value is the middle, the band stretches down to 70% for a fabric shared with
# other jobs.
LINK_EFFICIENCY = 0.85
LINK_EFFICIENCY_BAND = (0.7, 0.9)
# The optimizer and EMA estimate is taken to be good within a factor of 2 either way.
FIXED_WORK_BAND = (0.5, 2.0)
# What the rest of the model leaves out and grows with the node count (collective latency along longer rings and
# deeper trees, synchronisation, stragglers, input), as a share of the step per doubling of the nodes. Only runs
# whose communication the model hides entirely measure it alone: NeMo's published weak scaling of SD2 at 32 images
# per GPU on DGX A100 and DGX H100, 1 to 64 nodes (docs/report.md). The central value is the least-squares fit to
# their 7 multi-node rows (2.54%, rounded); fitted to one GPU type's rows alone it is 1.0% (A100) or 3.7% (H100).
# Held out, MLPerf's multi-node pairs lost 0.9-2.4% per doubling. The band: nothing (NeMo's DGX A100 scaled at
# 100.7% from one node to two) to 4.5% (NeMo's DGX H100 at 64 nodes, 79% efficiency: 1/0.79 = 1 + 6 x 4.4%).
SCALE_LOSS = 0.025
SCALE_LOSS_BAND = (0.0, 0.045)
# Without a measured microbatch curve, a GPU given fewer images per microbatch than measured computes each of them
# somewhere between as fast as measured (it stays full) and a whole microbatch's time (it is not filled at all):
# the bounds, since fewer images never take longer. Centrally as measured, so those rows are upper bounds.
SMALLER_MICROBATCHES = 'one image at smaller microbatches'
UNFILLED_SHARE_BAND = (0.0, 1.0)
# Where the layout of a cluster's network is not known, it and the losses growing with the node count both say
# what crossing nodes costs on that cluster beyond the rest of the model: one cluster sits at the same end of
# both, so their moves add rather than in quadrature.
CORRELATED_INPUTS = {'network layout': 'across nodes', 'losses growing with the node count': 'across nodes'}


@dataclass(frozen=True)
class Workload:
    """What one step does, whatever the GPU count."""

    global_batch: int
    microbatch: int  # images per forward/backward on one GPU
    trained_parameters: int  # their gradients are reduced; the optimizer updates them
    backward_share: float  # the trained model's backward, as a share of an image's compute (overlaps collectives)
    trained_share: float  # the trained model's forward and backward, as a share of an image's compute
    fsdp: str = 'none'  # 'none' (DDP), 'shard_grad_op' or 'full_shard'
    param_bytes: int = 2  # bytes per parameter that FSDP gathers: the autocast dtype (4 for fp32 runs)
    fixed_bytes_per_parameter: int = ADAMW_BYTES['foreach'] + EMA_BYTES
    # Bytes per gradient value reduced: 4 under Composer's AMP (DDP reduces the fp32 gradients; FSDP's default
    # mixed precision reduces in fp32 too), 2 where a run reduces in bf16 or fp16.
    gradient_value_bytes: int = 4
    # Weak scaling: every GPU count gets this many images per GPU per step, and the global batch grows with the
    # GPUs; None: the global batch is fixed, and more GPUs share it.
    images_per_gpu: int | None = None
    # One image's compute time at other microbatches, relative to `microbatch`'s: ((microbatch, relative time), ...)
    # from measured runs (report.py --microbatch_curve). Empty: the same at every microbatch.
    microbatch_curve: tuple[tuple[int, float], ...] = ()

    @property
    def gradient_bytes(self) -> float:
        return float(self.gradient_value_bytes * self.trained_parameters)

    def image_time_factor(self, microbatch: float, unfilled_share: float = 0.0) -> float:
        """One image's compute time at `microbatch` over its time at this workload's microbatch: from the curve
        where one was measured; otherwise, below the measured microbatch, a microbatch's time taken as a part that
        shrinks with its images and a share (`unfilled_share`) that does not."""
        if self.microbatch_curve:
            return log2_interpolate(self.microbatch_curve, microbatch)
        if microbatch < self.microbatch:
            return 1 - unfilled_share + unfilled_share * self.microbatch / microbatch
        return 1.0

    def below_microbatch(self, gpus: int) -> bool:
        """Whether a step on `gpus` GPUs leaves each fewer images than the measured microbatch."""
        return self.at(gpus).global_batch / gpus < self.microbatch

    def at(self, gpus: int) -> 'Workload':
        """The workload of a step on `gpus` GPUs: its global batch as given, or images_per_gpu x gpus."""
        return self if self.images_per_gpu is None else replace(self, global_batch=self.images_per_gpu * gpus)


def log2_interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x from (x, y) points: linear in log2(x) between them (microbatches double), flat beyond them."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (low, low_y), (high, high_y) in zip(points, points[1:]):
        if low <= x <= high:
            return low_y + math.log2(x / low) / math.log2(high / low) * (high_y - low_y)
    raise AssertionError('unreachable: the points span x')


@dataclass(frozen=True)
class Assumptions:
    cluster: Cluster
    link_efficiency: float = LINK_EFFICIENCY
    overlap: bool = True
    rail_aligned: bool | None = None  # the network carries one GPU's share per node; None: as the cluster is
    fixed_seconds: float | None = None  # the per-step fixed work; None: estimated from memory traffic
    fixed_scale: float = 1.0  # multiplies the estimate (the band's corners)
    # Without a microbatch curve, the share of a measured microbatch's time that a smaller one keeps (kernels the
    # fewer images do not fill): 0 computes each image as fast as measured, 1 runs a smaller microbatch as long.
    unfilled_share: float = 0.0
    # What the model leaves out and grows with the node count: a share of the step per doubling of the nodes.
    # None: not known for this cluster, SCALE_LOSS centrally and SCALE_LOSS_BAND in the range.
    scale_loss: float | None = None

    @property
    def node_loss(self) -> float:
        return SCALE_LOSS if self.scale_loss is None else self.scale_loss


@dataclass(frozen=True)
class Step:
    """One optimizer step on `gpus` GPUs, in seconds."""

    gpus: int
    images_per_gpu: float
    microbatches: int
    compute: float
    communication: float
    exposed: float
    fixed: float
    global_batch: int
    nodes: int
    scale_loss: float = 0.0  # the share of the step added per doubling of the node count (Assumptions.node_loss)

    @property
    def node_losses(self) -> float:
        """Seconds the step loses to what grows with the node count (none on one node)."""
        return (self.compute + self.exposed + self.fixed) * self.scale_loss * math.log2(self.nodes)

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed + self.fixed + self.node_losses

    @property
    def img_per_sec(self) -> float:
        return self.global_batch / self.seconds


def bus_bandwidth(assumptions: Assumptions, gpus: int) -> float:
    """Bytes per second each GPU's share of a ring collective moves at."""
    cluster = assumptions.cluster
    rail_aligned = bool(cluster.rail_aligned if assumptions.rail_aligned is None else assumptions.rail_aligned)
    if gpus <= cluster.gpus_per_node and cluster.nvls_gb_s is not None:
        # Measured at about the central efficiency: the band's corners move it in proportion.
        return cluster.nvls_gb_s * 1e9 * assumptions.link_efficiency / LINK_EFFICIENCY
    if gpus <= cluster.gpus_per_node:
        link = cluster.nvlink_gb_s
    elif rail_aligned:  # the node's cards carry the ring together, at most at NVLink's pace
        link = min(cluster.nvlink_gb_s, cluster.network_gb_s * cluster.gpus_per_node)
    else:
        link = cluster.network_gb_s
    return link * 1e9 * assumptions.link_efficiency


def fixed_seconds(workload: Workload, assumptions: Assumptions, gpus: int) -> float:
    if assumptions.fixed_seconds is not None:
        seconds = assumptions.fixed_seconds
    else:
        traffic = workload.trained_parameters * workload.fixed_bytes_per_parameter
        seconds = traffic / (assumptions.cluster.memory_gb_s * 1e9)
    if workload.fsdp != 'none':  # each GPU updates its shard of the parameters and their EMA
        seconds /= gpus
    return seconds * assumptions.fixed_scale


def step(workload: Workload, assumptions: Assumptions, gpus: int, image_seconds: float) -> Step:
    """The step's time on `gpus` GPUs given one image's compute time on one GPU."""
    workload = workload.at(gpus)
    images = workload.global_batch / gpus
    microbatch = min(workload.microbatch, images)
    microbatches = math.ceil(images / microbatch)
    image_seconds *= workload.image_time_factor(microbatch, assumptions.unfilled_share)  # fills the GPU less
    compute = images * image_seconds
    ring = (gpus - 1) / gpus
    bandwidth = bus_bandwidth(assumptions, gpus) if gpus > 1 else math.inf
    if workload.fsdp == 'none':
        communication = 2 * ring * workload.gradient_bytes / bandwidth
        hidden = workload.backward_share * microbatch * image_seconds  # the last microbatch's backward
    else:
        gathers = 2 if workload.fsdp == 'full_shard' else 1
        per_microbatch = ring * (gathers * workload.param_bytes * workload.trained_parameters + workload.gradient_bytes)
        communication = microbatches * per_microbatch / bandwidth
        hidden = workload.trained_share * images * image_seconds  # each microbatch's UNet forward and backward
    exposed = max(0.0, communication - hidden) if assumptions.overlap else communication
    return Step(
        gpus,
        images,
        microbatches,
        compute,
        communication,
        exposed,
        fixed_seconds(workload, assumptions, gpus),
        workload.global_batch,
        math.ceil(gpus / assumptions.cluster.gpus_per_node),
        assumptions.node_loss,
    )


def check_gpus(workload: Workload, gpus: int, what: str = '') -> None:
    prefix = f'{what}: ' if what else ''
    if isinstance(gpus, int) and gpus > 0:
        workload = workload.at(gpus)
    if not isinstance(gpus, int) or gpus <= 0:
        raise ScalingError(f'{prefix}GPU count must be a positive integer, got {gpus!r}')
    if gpus > workload.global_batch:
        raise ScalingError(
            f'{prefix}{gpus} GPUs exceed the global batch of {workload.global_batch} (each needs an image per step)'
        )
    if workload.global_batch % gpus:
        raise ScalingError(
            f'{prefix}{gpus} GPUs do not divide the global batch of {workload.global_batch} '
            '(each GPU takes an equal share of every step)'
        )
    images = workload.global_batch // gpus
    if images > workload.microbatch and images % workload.microbatch:
        raise ScalingError(
            f'{prefix}{gpus} GPUs leave {images} images per GPU per step, which do not split into microbatches '
            f'of {workload.microbatch}'
        )


@dataclass(frozen=True)
class ScalingModel:
    """Calibrated on one measured run: predicts a step at any GPU count."""

    workload: Workload
    assumptions: Assumptions
    image_seconds: float  # compute time of one image on one GPU, forward and backward
    # (image size, FLOP ratio) where the model is another size's run's scaled by the FLOPs per image; None: solved
    # from the measured run
    scaled_from: tuple[int, float] | None = None
    measured_batch: int | None = None  # the global batch of the run it was calibrated on; None: another phase's

    def step(self, gpus: int) -> Step:
        check_gpus(self.workload, gpus)
        return step(self.workload, self.assumptions, gpus, self.image_seconds)

    def at_measured_batch(self, gpus: int) -> bool:
        """Whether a predicted step on `gpus` GPUs trains the global batch of the run the model was solved from
        (at the measured count, then, it is that run)."""
        return self.workload.at(gpus).global_batch == self.measured_batch

    def img_per_sec(self, gpus: int) -> float:
        return self.step(gpus).img_per_sec

    def scaled(self, factor: float, workload: Workload, size: int) -> 'ScalingModel':
        """The same cluster at another image size: compute per image times `factor` (the FLOP ratio of that size to
        `size`, the measured one)."""
        return ScalingModel(workload, self.assumptions, self.image_seconds * factor, (size, factor))


@dataclass(frozen=True)
class Measurement:
    """The run the model starts from; batch and microbatch default to the workload's."""

    gpus: int
    img_per_sec: float
    batch: int | None = None
    microbatch: int | None = None


def calibrate(workload: Workload, assumptions: Assumptions, run: Measurement) -> ScalingModel:
    """Solve the step equation for t_image at the measured run's GPU count, batch and microbatch: the step
    time grows with t_image, so bisection finds the one value that fits."""
    gpus, img_per_sec = run.gpus, run.img_per_sec
    if not (img_per_sec > 0 and math.isfinite(img_per_sec)):
        raise ScalingError(f'measured throughput must be a positive number, got {img_per_sec!r}')
    measured = replace(
        workload,
        global_batch=run.batch or workload.global_batch,
        microbatch=run.microbatch or workload.microbatch,
        images_per_gpu=None,  # the measured run's own batch
    )
    check_gpus(measured, gpus, f'the measured run ({gpus} GPUs, batch {measured.global_batch})')
    seconds = measured.global_batch / img_per_sec
    low, high = 0.0, seconds / (measured.global_batch / gpus)
    if step(measured, assumptions, gpus, 0.0).seconds >= seconds:
        raise ScalingError(
            f'the measured {img_per_sec:,.1f} img/s on {gpus} GPUs leaves no time for compute: the assumed '
            'communication and fixed work alone take longer than its step; check the cluster figures'
        )
    for _ in range(200):
        middle = (low + high) / 2
        if step(measured, assumptions, gpus, middle).seconds < seconds:
            low = middle
        else:
            high = middle
    return ScalingModel(workload, assumptions, (low + high) / 2, measured_batch=measured.global_batch)


def uncertain_inputs(assumptions: Assumptions, workload: Workload) -> dict[str, tuple[str, tuple]]:
    """What the range of a prediction comes from: the inputs not known for this cluster and run, each {name:
    (field of Assumptions, the ends of its band)}. Link efficiency and the fixed work always; one image's time at
    microbatches below the measured one unless a curve measures it; the losses growing with the node count unless
    a flag gives them; the network layout where neither the preset nor a flag says it. DDP's overlap of the
    all-reduce with the backward is its known behaviour (--no_overlap where a run has none)."""
    inputs = {
        'link efficiency': ('link_efficiency', LINK_EFFICIENCY_BAND),
        'fixed work': ('fixed_scale', FIXED_WORK_BAND),
    }
    if not workload.microbatch_curve:
        inputs[SMALLER_MICROBATCHES] = ('unfilled_share', UNFILLED_SHARE_BAND)
    if assumptions.scale_loss is None:
        inputs['losses growing with the node count'] = ('scale_loss', SCALE_LOSS_BAND)
    if assumptions.rail_aligned is None and assumptions.cluster.rail_aligned is None:
        inputs['network layout'] = ('rail_aligned', (False, True))
    return inputs


def band(workload: Workload, assumptions: Assumptions, run: Measurement) -> dict[str, list[ScalingModel]]:
    """{uncertain input: the model calibrated at each of the two ends of its band, the other inputs central}."""
    return {
        name: [calibrate(workload, replace(assumptions, **{field: end}), run) for end in values]
        for name, (field, values) in uncertain_inputs(assumptions, workload).items()
    }


def dominant_input(corners: dict[str, list[ScalingModel]], gpus: int) -> str:
    """The uncertain input whose band alone moves the prediction at `gpus` most."""
    spread = {
        name: max(c.img_per_sec(gpus) for c in models) - min(c.img_per_sec(gpus) for c in models)
        for name, models in corners.items()
    }
    return max(spread, key=spread.get)


def scaling_efficiency(img_per_sec: float, gpus: int, base_img_per_sec: float, base_gpus: int) -> float:
    """Throughput per GPU relative to the base run's: 1 where more GPUs lose nothing. report.py's table and the step
    model's breakdown both compute it here, from the same base, so the two cannot disagree."""
    return (img_per_sec / gpus) / (base_img_per_sec / base_gpus)


def overall_img_per_sec(models: dict, budget: dict, gpus: int) -> float:
    """Throughput over the whole budget: each phase's samples at its own rate."""
    return sum(budget.values()) / sum(budget[ph] / models[ph].img_per_sec(gpus) for ph in models)


def prediction_range(models: dict, bands: dict, budget: dict, gpus: int) -> tuple[float, float]:
    """(lowest, highest) img/s at `gpus` over the budget's phases. Each uncertain input moves the central
    prediction by itself, at either end of its band (in the log of the throughput, which keeps the range
    positive). Inputs that describe the same thing move together, so their moves add (CORRELATED_INPUTS); the
    others are independent, and their moves add as independent errors do, in quadrature, rather than all at their
    worst ends together."""
    central = overall_img_per_sec(models, budget, gpus)
    down, up = {}, {}
    for name in next(iter(bands.values())):
        ends = [overall_img_per_sec({ph: bands[ph][name][end] for ph in bands}, budget, gpus) for end in (0, 1)]
        group = CORRELATED_INPUTS.get(name, name)
        down[group] = down.get(group, 0.0) + max(0.0, math.log(central / min(ends)))
        up[group] = up.get(group, 0.0) + max(0.0, math.log(max(ends) / central))
    return central * math.exp(-math.hypot(*down.values())), central * math.exp(math.hypot(*up.values()))
