"""The results file of a benchmark run (`benchmark.py --results_json`), and the GPU peak FLOP/s that MFU is
measured against. benchmark.py writes it; report.py and benchmarks/speed_sweep.py read it.

Version 1 of the schema: the fields of `Results`, in JSON, with 'schema': 'sd2-benchmark-results/1'.
A reader takes any file of that version; a field a writer left out reads as None.
"""

import dataclasses
import json
import math
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

SCHEMA = 'sd2-benchmark-results/1'

# Dense (no sparsity) BF16/FP16 tensor-core peak per GPU, from NVIDIA's datasheets: A100 (40 and 80 GB)
# 312 TFLOP/s; H100 SXM 989, PCIe 756, NVL 835; H200 989; B200 about 2250 (HGX B200).
# Matched by substring of the device name, most specific first.
PEAK_FLOPS = {'H100 PCIE': 756e12, 'H100 NVL': 835e12, 'A100': 312e12, 'H100': 989e12, 'H200': 989e12, 'B200': 2250e12}


class ResultsError(ValueError):
    """A results file that cannot be read, named in the message."""


@dataclass
class Results:
    """What one benchmark run measured: throughput over all devices, per device, FLOPs and MFU, with what is
    needed to compare runs (device, model, size, the resolved configuration, package versions, date)."""

    img_per_sec: float | None = None  # median of Composer's SpeedMonitor rolling windows, warm-up excluded
    img_per_sec_per_device: float | None = None
    flops_per_image: float | None = None  # training FLOPs: 3 x UNet forward + the frozen encoders' forward
    trained_flops_per_image: float | None = None  # the UNet's forward and backward: the share DDP overlaps
    trained_parameters: int | None = None  # the UNet's: their gradients are all-reduced, the optimizer updates them
    flops_per_sec: float | None = None
    mfu: float | None = None  # flops_per_sec / (num_devices x peak), against PEAK_FLOPS
    throughput_windows: int | None = None
    peak_gpu_memory_gb: float | None = None  # torch.cuda.max_memory_allocated of rank 0, in 1e9 bytes
    # torch.cuda.max_memory_reserved of rank 0: what the caching allocator held, the figure an out-of-memory meets
    peak_gpu_memory_reserved_gb: float | None = None
    device_train_microbatch_size: int | None = None  # what the run trained with; with 'auto', what Composer found
    bad_samples: int | None = None  # reads of bad samples, each replaced by the next good one
    bad_samples_distinct: int | None = None  # how many samples those were (each bad one is read every epoch)
    val_loss: float | None = None  # the held-out validation loss at the end (evaluation.py)
    val_loss_ema: float | None = None  # the same, of the EMA weights
    val_loss_curve: list | None = None  # [[samples seen, validation loss], ...], from the start
    val_loss_ema_curve: list | None = None
    train_seconds: float | None = None  # Composer's training clock, evaluation left out
    eval_seconds: float | None = None  # validation, both weights
    sample_seconds: float | None = None  # sample grids
    device_type: str | None = None  # 'gpu' or 'cpu'
    device_name: str | None = None
    num_devices: int | None = None
    world_size: int | None = None
    image_size: int | None = None
    model_name: str | None = None
    config: dict = field(default_factory=dict)  # benchmark.py's RunConfig
    versions: dict = field(default_factory=dict)
    # how the figures were made (runs/provenance.py): command, git commit, seconds to the first step's end and in
    # all, the GPU's driver, CUDA, cuDNN and NCCL versions, clocks and power limit
    provenance: dict = field(default_factory=dict)
    date: str | None = None  # ISO 8601, UTC
    schema: str = SCHEMA

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + '\n'

    @classmethod
    def from_dict(cls, data, source: str) -> 'Results':
        if not isinstance(data, dict) or not str(data.get('schema', '')).startswith('sd2-benchmark-results/'):
            raise ResultsError(f"{source}: not a benchmark.py results file (no 'schema': '{SCHEMA}')")
        if data['schema'] != SCHEMA:
            raise ResultsError(f'{source}: results schema {data["schema"]!r}; this version reads {SCHEMA!r}')
        names = {f.name for f in dataclasses.fields(cls)}
        results = cls(**{key: value for key, value in data.items() if key in names})
        if not isinstance(results.config, dict):
            results.config = {}
        return results

    def positive(self, name: str, kind: type, source: str, required: bool = True):
        """The field as a positive int or float, or None when it may be absent; ResultsError otherwise."""
        value = getattr(self, name)
        if value is None:
            if required:
                raise ResultsError(f'{source}: field {name!r} is missing or null')
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if kind is int:
            ok = ok and float(value).is_integer()
        if not ok or value <= 0:
            raise ResultsError(f'{source}: field {name!r} must be a positive {kind.__name__}, got {value!r}')
        return kind(value)


def load_results(path: str) -> Results:
    if Path(path).is_dir():
        raise ResultsError(f'{path}: is a folder, not a results file (give the .json files benchmark.py wrote)')
    try:
        with open(path, encoding='utf-8') as file:
            data = json.load(file)
    except OSError as error:
        raise ResultsError(f'{path}: cannot read results file ({error.strerror})')
    except json.JSONDecodeError as error:
        raise ResultsError(f'{path}: not valid JSON ({error})')
    except UnicodeDecodeError:  # an image, an archive, a checkpoint: bytes that are not text
        raise ResultsError(f'{path}: not a results file: binary data, not the JSON text benchmark.py writes')
    return Results.from_dict(data, str(path))


def gpu_key(name: str) -> str:
    """The PEAK_FLOPS key of a device name ('NVIDIA A100-SXM4-40GB' -> 'A100'), or the name itself."""
    upper = name.upper()
    return next((key for key in PEAK_FLOPS if key in upper), name)


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of one device, None when the table does not know it (a CPU, a new GPU)."""
    return PEAK_FLOPS.get(gpu_key(device_name)) if device_name else None


def mfu(flops_per_sec: float | None, num_devices: int, peak: float | None) -> float | None:
    """Model FLOP utilization: achieved training FLOP/s over the devices' peak."""
    if not flops_per_sec or not peak:
        return None
    return flops_per_sec / (num_devices * peak)


def cpu_name() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, str | None]:
    import torch  # here, not at the top: report.py reads results files without loading torch

    versions = {'python': platform.python_version(), 'cuda': torch.version.cuda}
    for package in ('torch', 'mosaicml', 'mosaicml-streaming', 'diffusers', 'transformers', 'xformers'):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions
