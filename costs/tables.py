"""The report's tables: one row per GPU count and kind (measured, reference, predicted, and the limit at 100% of
peak), each with its days, GPU-hours, cost, scaling efficiency and MFU over the budget; printed as Markdown and
written as CSV.
"""

import csv
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from costs.calibration import FLOPS_PER_IMAGE, TRAINED_FLOPS_PER_IMAGE
from costs.fit import Fit, fit_scaling
from costs.measurements import ReportError, device_word, parse_throughput
from costs.results import PEAK_FLOPS
from costs.step_model import ScalingError, overall_img_per_sec, prediction_range, scaling_efficiency

SECONDS_PER_DAY = 86_400

Kind = Literal['measured', 'reference', 'predicted', 'limit']
KIND_ORDER = {'measured': 0, 'reference': 1, 'predicted': 2, 'limit': 3}


@dataclass(frozen=True)
class Row:
    """One GPU count of a table: its throughput per phase of the budget and over all of it, and what the budget
    takes at that throughput."""

    gpus: int
    kind: Kind
    phase_img_per_sec: dict  # {phase (image size, or None for one phase): img/s}
    img_per_sec: float  # over the whole budget
    days: float
    gpu_hours: float
    cost: float  # USD at the price per GPU-hour
    mfu: float | None  # None: the peak or the FLOPs per image not known
    efficiency: float | None = None  # throughput per GPU against the table's base row; None: the limit row
    img_per_sec_range: tuple[float, float] | None = None  # a predicted row's range (the step model's); else None


class Curve(NamedTuple):
    """Days to train against GPU count along the fit or the step model, for the figure."""

    gpus: list  # the counts shown (along the fit: 50 of them spanning the table's, as an array)
    days: list
    name: str  # 'fit', 'step model', ...


class Table(NamedTuple):
    """One table of the report: one GPU type (and with --per_model, one model)."""

    label: str
    rows: list[Row]
    curve: Curve | None
    base_gpus: int  # the count scaling efficiency is measured against


def phase_order(budget: dict) -> list:
    """The budget's phases by image size; a budget of one phase at any size is [None]."""
    return sorted(budget, key=lambda k: -1 if k is None else k)


@dataclass(frozen=True)
class Costing:
    """What turns throughputs into a row: the budget's samples by phase, the price per GPU-hour, and the budget's
    training FLOPs and the peak FLOP/s per GPU (for MFU; None where either is not known)."""

    budget: dict
    price: float
    total_flops: float | None
    peak: float | None

    def row(self, gpus: int, kind: Kind, phase_img_per_sec: dict) -> Row:
        seconds = sum(self.budget[ph] / phase_img_per_sec[ph] for ph in phase_order(self.budget))
        gpu_hours = seconds * gpus / 3600
        return Row(
            gpus=gpus,
            kind=kind,
            phase_img_per_sec=phase_img_per_sec,
            img_per_sec=sum(self.budget.values()) / seconds,
            days=seconds / SECONDS_PER_DAY,
            gpu_hours=gpu_hours,
            cost=gpu_hours * self.price,
            mfu=self.total_flops / (gpu_hours * 3600 * self.peak) if self.total_flops and self.peak else None,
        )


def build_rows(points, budget, extrapolate, references, price, peak, models=None):
    """Rows of one table (one GPU type): measured, reference and predicted counts, then the limit. Predictions
    come from `models` ({phase: step_model.ScalingModel}) when given, else from a fit per phase. Returns the rows,
    the fits (or the models), the notes on them, and the base row of scaling efficiency."""
    phases = phase_order(budget)
    flops = phase_flops(points, phases)
    total_flops = sum(budget[ph] * flops[ph] for ph in phases) if all(flops.values()) else None
    costing = Costing(budget, price, total_flops, peak)
    measured, notes = measured_throughputs(points, budget, models)
    fits = models if models is not None else {ph: fit_scaling(m) for ph, m in measured.items() if len(m) >= 2}
    notes += fit_miss_notes(points[0].gpu, fits)
    rows, batch_notes = measured_rows(costing, measured, models, points[0].gpu)
    notes += batch_notes
    rows += predicted_rows(costing, measured, fits, extrapolate, {r.gpus for r in rows}, points)
    for item in references:
        # A reference throughput is taken to hold for every phase of the budget.
        ref = parse_throughput(item, points[0].gpu, '--reference')
        rows.append(costing.row(ref.gpus, 'reference', {ph: ref.img_per_sec for ph in phases}))
    rows.sort(key=lambda r: (r.gpus, KIND_ORDER[r.kind]))
    rows, base = with_efficiency(rows)
    if total_flops and peak:
        # The best any run could do: every GPU at its dense peak, all FLOPs useful (MFU 100%).
        gpus = rows[-1].gpus
        rows.append(costing.row(gpus, 'limit', {ph: gpus * peak / flops[ph] for ph in phases}))
    else:
        notes.append(
            f'{points[0].gpu}: no MFU or limit row (peak FLOP/s or FLOPs per image unknown; pass --peak_tflops)'
        )
    return rows, fits, notes, base


def phase_flops(points, phases) -> dict:
    """FLOPs per image of each phase: results files first, then the analytic SD2 figures."""
    flops = {}
    for ph in phases:
        sizes = {p.image_size for p in points if ph is None or p.image_size == ph}
        if len(sizes) > 1:
            raise ReportError(
                f'{points[0].gpu}: throughputs at mixed image sizes '
                f'({", ".join(f"{k}px" for k in sorted(sizes))}); give one budget per phase, '
                'e.g. --samples 256=N 512=M (hand-given throughputs are 512px unless '
                'prefixed, e.g. 256:8=400)'
            )
        known = [p.flops_per_image for p in points if p.image_size in sizes and p.flops_per_image]
        # Without a results file's own count: SD2's, of the UNet alone where the throughput trained only it.
        unet_only = any(p.precomputed for p in points if p.image_size in sizes)
        analytic = TRAINED_FLOPS_PER_IMAGE if unet_only else FLOPS_PER_IMAGE
        flops[ph] = known[0] if known else analytic.get(next(iter(sizes), ph))
    return flops


def measured_throughputs(points, budget, models) -> tuple[dict, list[str]]:
    """({phase: {GPUs: img/s}}, notes): the throughputs measured in each phase of the budget, repeated runs at one
    GPU count averaged (a note says so). A phase without any is refused unless `models` predict it."""
    phases = phase_order(budget)
    by_phase = {}
    for p in points:
        phase = None if None in budget else p.image_size
        if phase not in budget:
            raise ReportError(
                f'{p.source}: measured at {p.image_size}px, which matches no phase of '
                f'--samples ({", ".join(f"{k}px" for k in phases)})'
            )
        by_phase.setdefault(phase, {}).setdefault(p.gpus, []).append(p.img_per_sec)
    for phase in phases:
        if phase not in by_phase and phase not in (models or {}):
            raise ReportError(f'--samples: no throughput measured at {phase}px for {points[0].gpu}')
    measured = {ph: {k: sum(v) / len(v) for k, v in by_phase.get(ph, {}).items()} for ph in phases}
    device = device_word(points)
    notes = [
        f'{points[0].gpu}, {ph or points[0].image_size}px: {len(v)} runs at {k} {device}{"s" * (k != 1)} averaged'
        for ph, d in by_phase.items()
        for k, v in d.items()
        if len(v) > 1
    ]
    return measured, notes


def fit_miss_notes(gpu: str, fits: dict) -> list[str]:
    """A line for each fit that misses a measured point by more than 5%."""
    return [
        f'{gpu}' + (f' {ph}px' if ph else '') + ': the fit misses a measured point '
        'by more than 5%; treat its predictions with care'
        for ph, fit in fits.items()
        if isinstance(fit, Fit) and any(abs(fit.img_per_sec(k) / v - 1) > 0.05 for k, v in fit.points.items())
    ]


def measured_rows(costing: Costing, measured: dict, models, gpu: str) -> tuple[list[Row], list[str]]:
    """The rows of the counts measured in every phase; where the step models predict another batch than the
    measured run's, the same count predicted at it too, with a note."""
    phases = phase_order(costing.budget)
    rows, notes = [], []
    for gpus in sorted(set().union(*measured.values())):
        if not all(gpus in m for m in measured.values()):
            continue
        rows.append(costing.row(gpus, 'measured', {ph: measured[ph][gpus] for ph in phases}))
        if (
            models
            and not why_unpredictable(models, gpus)
            and not all(models[ph].at_measured_batch(gpus) for ph in phases)
        ):
            # The predicted runs train another batch than the measured run: the same count at their batch.
            rows.append(costing.row(gpus, 'predicted', {ph: models[ph].img_per_sec(gpus) for ph in phases}))
            model = next(iter(models.values()))
            batch = model.workload.at(gpus).global_batch
            notes.append(
                f'{gpu}: measured at a global batch of {model.measured_batch:,}, predicted at {batch:,}: '
                f'the {gpus:,}-GPU count is shown both as measured and as predicted at {batch:,}'
            )
    return rows, notes


def predicted_rows(costing: Costing, measured: dict, fits: dict, extrapolate, shown: set, points) -> list[Row]:
    """The rows of `extrapolate` (default: one doubling past the largest measured count, as the published table
    did, where every phase has a fit) and of counts measured in only some phases, not `shown` yet: from the fits or
    models where a phase was not measured at the count."""
    phases = phase_order(costing.budget)
    counts = sorted(set().union(*measured.values()))
    if extrapolate is None:
        extrapolate = [2 * counts[-1]] if len(fits) == len(phases) else []
    rows = []
    for gpus in sorted(set(extrapolate) | {g for g in counts if g not in shown}):
        if gpus in shown:
            continue
        missing = [ph for ph in phases if gpus not in measured[ph] and ph not in fits]
        if missing:
            device = device_word(points)
            raise ReportError(
                f'{points[0].gpu}: cannot predict {gpus} {device}s: the fit needs at least '
                f'two measured {device} counts' + (f' at {missing[0]}px' if missing[0] else '')
            )
        throughputs = {ph: measured[ph].get(gpus) or fits[ph].img_per_sec(gpus) for ph in phases}
        rows.append(costing.row(gpus, 'predicted', throughputs))
    return rows


def with_efficiency(rows: list[Row]) -> tuple[list[Row], Row]:
    """The rows with their scaling efficiency, and the base row it is against: a measured row, else (a phase
    predicted from another's run) the smallest count the models or fits give."""
    base = next((r for r in rows if r.kind == 'measured'), None)
    base = base or next((r for r in rows if r.kind == 'predicted'), rows[0])
    efficiency = [scaling_efficiency(r.img_per_sec, r.gpus, base.img_per_sec, base.gpus) for r in rows]
    return [replace(r, efficiency=e) for r, e in zip(rows, efficiency)], base


def why_unpredictable(models: dict, gpus: int) -> str | None:
    """Why the step models cannot predict `gpus` GPUs (the predicted runs' batch does not split over them), or
    None where they can."""
    for model in models.values():
        try:
            model.step(gpus)
        except ScalingError as error:
            return str(error)
    return None


def prediction_line(rows: list[Row]) -> list[Row]:
    """The measured and predicted rows by GPU count; at a measured count also predicted (at another batch than
    the measured run's), the prediction."""
    line = {r.gpus: r for r in rows if r.kind == 'measured'}
    line |= {r.gpus: r for r in rows if r.kind == 'predicted'}
    return [line[gpus] for gpus in sorted(line)]


def with_prediction_ranges(rows: list[Row], models: dict, bands: dict, budget: dict) -> list[Row]:
    """The rows, each predicted one with its range of img/s, the step model's over the budget, scaled to the
    row's own throughput (a measured phase keeps its measured rate)."""
    ranged = []
    for r in rows:
        if r.kind == 'predicted':
            low, high = prediction_range(models, bands, budget, r.gpus)
            central = overall_img_per_sec(models, budget, r.gpus)
            r = replace(r, img_per_sec_range=(r.img_per_sec * low / central, r.img_per_sec * high / central))
        ranged.append(r)
    return ranged


def markdown_table(rows, label, base_gpus, phases, device='GPU'):
    hours = f'{label}-hours' if label in PEAK_FLOPS else f'{device}-hours'
    per_phase = [ph for ph in phases if ph is not None] if len(phases) > 1 else []
    header = (
        [f'{device}s', 'kind']
        + [f'img/s {ph}px' for ph in per_phase]
        + [
            'img/s' if not per_phase else 'img/s overall',
            'days',
            hours,
            'cost',
            f'scaling eff. (vs {base_gpus:,})',
            'MFU',
        ]
    )
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for r in rows:
        cells = (
            [f'{r.gpus:,}', r.kind]
            + [f'{r.phase_img_per_sec[ph]:,.1f}' for ph in per_phase]
            + [
                f'{r.img_per_sec:,.1f}',
                f'{r.days:,.2f}',
                f'{r.gpu_hours:,.0f}',
                f'${r.cost:,.0f}',
                '-' if r.efficiency is None else f'{r.efficiency:.1%}',
                '-' if r.mfu is None else f'{r.mfu:.1%}',
            ]
        )
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def write_csv(path, tables, phases):
    """The tables, [(label, rows)], as one CSV: a line per row, its label in the first column."""
    per_phase = [ph for ph in phases if ph is not None] if len(phases) > 1 else []
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(
            ['gpu_type', 'gpus', 'kind']
            + [f'img_per_sec_{ph}px' for ph in per_phase]
            + ['img_per_sec', 'days', 'gpu_hours', 'cost_usd', 'scaling_efficiency', 'mfu']
        )
        for label, rows in tables:
            for r in rows:
                values = (r.img_per_sec, r.days, r.gpu_hours, r.cost, r.efficiency, r.mfu)
                writer.writerow(
                    [label, r.gpus, r.kind]
                    + [f'{r.phase_img_per_sec[ph]:.6g}' for ph in per_phase]
                    + [f'{value:.6g}' if value is not None else '' for value in values]
                )
