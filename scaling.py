"""Scaling model: the throughput of data-parallel training at any GPU count, predicted from one measured run and
the cluster's interconnect, step by step rather than fitted to several measured counts. report.py --predict
prints it.

One optimizer step at a fixed global batch B on N GPUs, each running B/N images in microbatches of m:

    step      = compute + exposed communication + fixed work
    compute   = (B / N) x t_image            t_image: one image's forward and backward on one GPU (measured)
    exposed   = communication - the compute that overlaps it (none when --no_overlap)
    fixed     = per-step work on each GPU that more GPUs do not shrink: the optimizer step and EMA update,
                memory-bound, so their bytes over the GPU's memory bandwidth

Communication is ring collectives, which move (N-1)/N of a buffer per GPU for a reduce-scatter or all-gather
and 2(N-1)/N for an all-reduce (NCCL calls bytes / time of the latter "bus bandwidth"). Inside a node they run
over NVLink. Once the ring spans nodes, the central model sends every GPU's share over its own network link,
which then sets the pace. The other bound, rail-aligned rings (NCCL's rings pass through a node's GPUs over
NVLink and cross the network once per node, one ring per network card), moves a node's traffic over all its
cards together: the network then carries one GPU's share per node. The band spans both.

- DDP (the published run): Composer skips gradient synchronization on all but the last microbatch of a step,
  so one all-reduce of the trained parameters' fp32 gradients per step, overlapped with the last microbatch's
  backward (DDP reduces gradient buckets as the backward fills them).
- FSDP: every microbatch gathers the parameters (in the autocast dtype) and reduce-scatters the fp32 gradients
  (Composer uses no_sync with DDP only); full_shard gathers twice (forward and backward). The collectives
  overlap that microbatch's UNet forward and backward. The optimizer step and EMA work on a 1/N shard.

t_image comes from the measured run by solving the same equation at its GPU count, so communication and
fixed work there are not counted as compute. Every assumption is a field of Assumptions, with its source.
"""

import itertools
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


# NVIDIA datasheets: NVLink 3 moves 600 GB/s per A100 counting both directions (300 each way), NVLink 4
# 900 GB/s (H100, H200), NVLink 5 1.8 TB/s (B200). Networks: one NIC per GPU, 200 Gb/s HDR InfiniBand on 2022
# A100 clusters such as the published run's (25 GB/s), 400 Gb/s NDR on H100/H200/B200 nodes (50 GB/s).
# HBM: A100-40GB 1,555 GB/s, H100 SXM 3,350, H200 4,800, B200 8,000.
CLUSTERS = {
    'A100': Cluster('8x A100-SXM4-40GB per node, NVLink 3, 8x 200 Gb/s HDR InfiniBand', 8, 300, 25, 1555),
    'H100': Cluster('8x H100 SXM per node, NVLink 4, 8x 400 Gb/s NDR InfiniBand', 8, 450, 50, 3350),
    'H200': Cluster('8x H200 SXM per node, NVLink 4, 8x 400 Gb/s NDR InfiniBand', 8, 450, 50, 4800),
    'B200': Cluster('8x B200 per node, NVLink 5, 8x 400 Gb/s NDR InfiniBand', 8, 900, 50, 8000),
}

# Bytes each trained parameter moves through GPU memory in the per-step work, in fp32. AdamW: a fused kernel
# reads parameter, gradient and both moments and writes parameter and moments (28 bytes); PyTorch's default
# multi-tensor (foreach) AdamW makes about ten passes, each a read or read-modify-write (about 80 bytes). EMA:
# the average and the weights read, the average written (12 bytes).
ADAMW_BYTES = {'fused': 28, 'foreach': 80}
EMA_BYTES = 12

# nccl-tests typically reach 80-90% of the link rate as bus bandwidth: the central value is the middle, the band
# stretches down to 70% for a fabric shared with other jobs.
LINK_EFFICIENCY = 0.85
LINK_EFFICIENCY_BAND = (0.7, 0.9)
# The optimizer and EMA estimate is taken to be good within a factor of 2 either way.
FIXED_WORK_BAND = (0.5, 2.0)


@dataclass(frozen=True)
class Workload:
    """What one step does, whatever the GPU count."""

    global_batch: int
    microbatch: int  # images per forward/backward on one GPU
    trained_parameters: int  # their fp32 gradients are reduced; the optimizer updates them
    backward_share: float  # the trained model's backward, as a share of an image's compute (overlaps collectives)
    trained_share: float  # the trained model's forward and backward, as a share of an image's compute
    fsdp: str = 'none'  # 'none' (DDP), 'shard_grad_op' or 'full_shard'
    param_bytes: int = 2  # bytes per parameter that FSDP gathers: the autocast dtype (4 for fp32 runs)
    fixed_bytes_per_parameter: int = ADAMW_BYTES['foreach'] + EMA_BYTES

    @property
    def gradient_bytes(self) -> float:
        return 4.0 * self.trained_parameters


@dataclass(frozen=True)
class Assumptions:
    cluster: Cluster
    link_efficiency: float = LINK_EFFICIENCY
    overlap: bool = True
    rail_aligned: bool = False  # the network carries one GPU's share per node, not every GPU's
    fixed_seconds: float | None = None  # the per-step fixed work; None: estimated from memory traffic
    fixed_scale: float = 1.0  # multiplies the estimate (the band's corners)


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

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed + self.fixed

    @property
    def img_per_sec(self) -> float:
        return self.global_batch / self.seconds


def bus_bandwidth(assumptions: Assumptions, gpus: int) -> float:
    """Bytes per second each GPU's share of a ring collective moves at."""
    cluster = assumptions.cluster
    if gpus <= cluster.gpus_per_node:
        link = cluster.nvlink_gb_s
    elif assumptions.rail_aligned:  # the node's cards carry the ring together, at most at NVLink's pace
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
    images = workload.global_batch / gpus
    microbatch = min(workload.microbatch, images)
    microbatches = math.ceil(images / microbatch)
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
    )


def check_gpus(workload: Workload, gpus: int, what: str = '') -> None:
    prefix = f'{what}: ' if what else ''
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
    origin: str = 'solved from the measured run'

    def step(self, gpus: int) -> Step:
        check_gpus(self.workload, gpus)
        return step(self.workload, self.assumptions, gpus, self.image_seconds)

    def img_per_sec(self, gpus: int) -> float:
        return self.step(gpus).img_per_sec

    def scaled(self, factor: float, workload: Workload, origin: str) -> 'ScalingModel':
        """The same cluster at another image size: compute per image times `factor` (the FLOP ratio)."""
        return ScalingModel(workload, self.assumptions, self.image_seconds * factor, origin)


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
        workload, global_batch=run.batch or workload.global_batch, microbatch=run.microbatch or workload.microbatch
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
    return ScalingModel(workload, assumptions, (low + high) / 2)


def band(workload: Workload, assumptions: Assumptions, run: Measurement) -> list[ScalingModel]:
    """The model at each corner of the plausible inputs: link efficiency, overlap or none, fixed work, every
    GPU's share over the network or rail-aligned rings."""
    corners = []
    for efficiency, overlap, scale, rail_aligned in itertools.product(
        LINK_EFFICIENCY_BAND, (True, False), FIXED_WORK_BAND, (False, True)
    ):
        corner = replace(
            assumptions, link_efficiency=efficiency, overlap=overlap, fixed_scale=scale, rail_aligned=rail_aligned
        )
        corners.append(calibrate(workload, corner, run))
    return corners
