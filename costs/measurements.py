"""The inputs of a report, read and checked: throughputs measured by `benchmark.py --results_json` or given by hand
(each a Point), grouped into one table per GPU type (and model), the microbatch curve of --microbatch_curve, and
the training budget. Any problem is named in one line, a ReportError.
"""

import math
from dataclasses import dataclass

from costs.results import ResultsError, gpu_key
from costs.results import load_results as read_results

# "2.9 billion samples" in the published table is exactly 2,867,200,000 samples:
# 550k steps x 2048 at 256px + 850k steps x 2048 at 512px (SD2-base model card schedule).
PUBLISHED_SAMPLES = 2_867_200_000
# The model those samples trained, as benchmark.py's --model_name names it (settings/presets.py's PUBLISHED_MODEL: the
# report reads results files without the settings).
PUBLISHED_MODEL = 'sd2-base'
# The GPU type of a throughput given by hand without --gpu_type.
UNNAMED_GPU = 'GPU'


class ReportError(ValueError):
    """Input the report cannot use, named in the message; report.py's main turns it into exit status 2."""


def parse_budget(items, parser):
    """{image size or None: samples}; None means one phase at whatever resolution was measured."""
    if len(items) == 1 and '=' not in items[0]:
        return {None: samples_count(items[0], parser)}
    budget = {}
    for item in items:
        res, sep, n = item.partition('=')
        if not sep:
            parser.error(f'--samples: expected RES=N for each phase, got {item!r}')
        budget[positive_number(res, int, '--samples image size', parser)] = samples_count(n, parser)
    return budget


def samples_count(text, parser):
    """A --samples count, written 2867200000, 2,867,200,000, 2_867_200_000 or 2.8672e9."""
    return round(positive_number(text.replace(',', '').replace('_', ''), float, '--samples', parser))


def positive_number(text, kind, what, parser=None):
    """`text` as a positive `kind` (int or float); else the error, through `parser` where one is given."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        message = f'{what}: expected a positive number, got {text!r}'
        if parser:
            parser.error(message)
        raise ReportError(message)
    return value


@dataclass
class Point:
    """One throughput: of a results file, or given by hand (--throughput, --reference)."""

    gpu: str  # GPU type key, e.g. 'A100', or a device name not in PEAK_FLOPS
    gpus: int
    img_per_sec: float
    image_size: int
    flops_per_image: float | None = None
    peak: float | None = None  # per-GPU peak FLOP/s when a results file implies one
    model: str | None = None
    source: str = 'hand'
    precomputed: bool | None = None  # trained from precompute.py's latents (the UNet alone); None: not known
    run: dict | None = None  # the results file's configuration (batch, microbatch, fsdp, ...); None: by hand
    trained_parameters: int | None = None
    trained_flops_per_image: float | None = None
    device_type: str | None = None  # 'gpu' or 'cpu', as a results file says; None: given by hand, a GPU


def parse_throughput(item, gpu, what='--throughput', unet_only=False):
    """'[RES:]GPUS=IMG_S' -> Point; unet_only: trained from precomputed latents (else not known: encoders online)."""
    res, colon, rest = item.rpartition(':')
    gpus, sep, thr = (rest if colon else item).partition('=')
    if not sep:
        raise ReportError(f'{what}: expected GPUS=IMG_S (e.g. 8=128.2), got {item!r}')
    image_size = positive_number(res, int, f'{what} {item!r}: image size') if colon else 512
    gpus = positive_number(gpus, int, f'{what} {item!r}: GPU count')
    img_per_sec = positive_number(thr, float, f'{what} {item!r}: img/s')
    return Point(gpu, gpus, img_per_sec, image_size, source=f'{what} {item}', precomputed=True if unet_only else None)


def load_results(path):
    """One results JSON from benchmark.py -> Point, naming the file and field on any problem."""
    try:
        results = read_results(path)
        gpus = results.positive('num_devices', int, path)
        img_per_sec = results.positive('img_per_sec', float, path)
        flops = results.positive('flops_per_image', float, path, required=False)
        trained_flops = results.positive('trained_flops_per_image', float, path, required=False)
        trained_parameters = results.positive('trained_parameters', int, path, required=False)
        mfu = results.positive('mfu', float, path, required=False)
        image_size = results.positive('image_size', int, path)
    except ResultsError as error:
        raise ReportError(str(error))
    name = results.device_name
    if not isinstance(name, str) or not name.strip():
        raise ReportError(f"{path}: missing field 'device_name'")
    # mfu = img/s x FLOPs per image / (GPUs x peak): recovers the peak the benchmark assumed.
    peak = img_per_sec * flops / (gpus * mfu) if flops and mfu else None
    return Point(
        gpu_key(name),
        gpus,
        img_per_sec,
        image_size,
        flops,
        peak,
        results.model_name,
        path,
        bool(results.config.get('precomputed_latents')),
        results.config,
        trained_parameters,
        trained_flops,
        results.device_type,
    )


def collect_points(args):
    """All throughputs, grouped by GPU type (and with --per_model, by model): {label: points}. Mixing types
    needs --per_gpu_type; mixing models in one table is refused."""
    points = [load_results(path) for path in args.results]
    types = sorted({p.gpu for p in points})
    hand_gpu = gpu_key(args.gpu_type) if args.gpu_type else (types[0] if len(types) == 1 else UNNAMED_GPU)
    points += [parse_throughput(item, hand_gpu, unet_only=args.unet_only) for item in args.throughput]
    if not points:
        raise ReportError('no throughput given: pass results JSON files and/or --throughput GPUS=IMG_S')
    groups = {}
    for p in points:
        groups.setdefault(p.gpu, []).append(p)
    if len(groups) > 1 and not args.per_gpu_type:
        listing = '; '.join(f'{g}: ' + ', '.join(p.source for p in ps) for g, ps in groups.items())
        raise ReportError(
            f'inputs mix GPU types ({listing}); pass --per_gpu_type for one table per type, or give inputs of one type'
        )
    if args.per_model:
        groups = {}
        for p in points:
            groups.setdefault(p.gpu + (f' {p.model}' if p.model else ''), []).append(p)
    if args.reference and len(groups) > 1:
        raise ReportError('--reference is ambiguous with several tables; report one GPU type and model at a time')
    for gpu, pts in groups.items():
        models = {p.model for p in pts if p.model}
        if len(models) > 1:
            raise ReportError(
                f'{gpu}: results mix models ({", ".join(sorted(models))}); report one model at a time, or pass '
                '--per_model for one table per model'
            )
        if len({p.precomputed for p in pts if p.precomputed is not None}) > 1:
            raise ReportError(
                f'{gpu}: results mix training from precomputed latents with encoders online; report one at a time'
            )
        refuse_averaging_other_settings(gpu, pts)
    return groups


# The settings a results file records that change its throughput: runs at one GPU count are averaged into one row
# only where they agree on these. Random tensors (use_synth_data) leave data loading out of what is measured.
AVERAGED_ALIKE = ('device_train_microbatch_size', 'compile', 'run_recipe', 'precision', 'batch_size', 'use_synth_data')


def refuse_averaging_other_settings(gpu: str, points: list) -> None:
    by_count = {}
    for p in points:
        if p.run:
            by_count.setdefault(p.gpus, []).append(p)
    for count, runs in by_count.items():
        for name in AVERAGED_ALIKE:
            values = {str(p.run.get(name)) for p in runs}
            if len(values) > 1:
                sources = ', '.join(p.source for p in runs)
                raise ReportError(
                    f'{gpu}: {sources}: runs at {count} {device_word(runs)}{"s" * (count != 1)} with other {name} '
                    f'({", ".join(sorted(values))}), '
                    'which a table would average into one row; report one setting at a time (a microbatch curve: '
                    '--microbatch_curve FILE ...)'
                )


def microbatch_curve(paths, points) -> tuple:
    """((microbatch, img/s per GPU), ...) from results files of the measured runs' GPU, model and image size."""
    curve = {}
    for path in paths:
        run = load_results(path)
        for field in ('gpu', 'model', 'image_size', 'precomputed'):
            if getattr(run, field) != getattr(points[0], field):
                raise ReportError(
                    f'--microbatch_curve {path}: {field} {getattr(run, field)!r}, where the measured run '
                    f'({points[0].source}) has {getattr(points[0], field)!r}'
                )
        microbatch = run.run.get('device_train_microbatch_size')
        if not isinstance(microbatch, int):
            raise ReportError(f'--microbatch_curve {path}: no fixed microbatch ({microbatch!r})')
        curve[microbatch] = run.img_per_sec / run.gpus
    if len(curve) == 1:
        raise ReportError('--microbatch_curve: runs at one microbatch only; a curve needs two or more')
    return tuple(sorted(curve.items()))


def device_word(points) -> str:
    """What the report's counts count, and its price is per hour of: 'device' where a results file was measured on
    a CPU (its processes are no GPUs), else 'GPU'."""
    return 'device' if any(p.device_type == 'cpu' for p in points) else 'GPU'
