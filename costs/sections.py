"""The report of report.py, table by table: each table's section (its rows, the curve of its figure, its notes,
and the text of its fit or of its prediction by the step model), and the Markdown that prints them all.
"""

from dataclasses import dataclass

import numpy as np

from costs.fit import describe_fit
from costs.measurements import PUBLISHED_MODEL, PUBLISHED_SAMPLES, device_word
from costs.prediction import predict
from costs.prediction_text import describe_prediction
from costs.results import PEAK_FLOPS
from costs.tables import (
    SECONDS_PER_DAY,
    Curve,
    Table,
    build_rows,
    markdown_table,
    phase_order,
    prediction_line,
    why_unpredictable,
    with_prediction_ranges,
)


@dataclass(frozen=True)
class Section:
    """One table of the report and what is said of it."""

    table: Table
    notes: list[str]  # the lines under the tables
    prediction_text: str | None  # the step model's inputs, breakdown and range (--predict); else None
    fit_lines: list[str]  # the fit's terms and errors, and the predictions against the references (without --predict)


def build_section(label: str, points: list, args) -> Section:
    """The section of one table, of `points` (one GPU type, and with --per_model one model) as report.py's flags
    `args` ask: predicted by the step model (--predict) or fitted."""
    gpu = points[0].gpu
    peak = (
        args.peak_tflops * 1e12
        if args.peak_tflops
        else PEAK_FLOPS.get(gpu) or next((p.peak for p in points if p.peak), None)
    )
    models = bands = other_cluster = None
    notes = []
    if args.predict is not None:
        models, bands, notes, other_cluster = predict(points, args, gpu, label)
    counts = args.predict if models else args.extrapolate
    rows, fits, row_notes, base = build_rows(points, args.budget, counts, args.reference, args.price, peak, models)
    notes = [*notes, *row_notes, *measured_notes(label, points, args.samples)]
    if models:
        rows = with_prediction_ranges(rows, models, bands, args.budget)
        curve, reference_notes, text = predicted_part(label, rows, base, models, bands, other_cluster, args.budget)
        return Section(Table(label, rows, curve, base.gpus), notes + reference_notes, text, [])
    curve = fitted_curve(rows, fits, args.budget) if len(fits) == len(phase_order(args.budget)) else None
    return Section(Table(label, rows, curve, base.gpus), notes, None, fit_lines(label, rows, fits, device_word(points)))


def measured_notes(label: str, points: list, samples: list[str]) -> list[str]:
    """What the figures are of where that is not SD2 trained with its encoders online on the published budget:
    the smoke-test model, another model on SD2's budget, or the denoiser alone from precomputed latents."""
    notes = []
    tiny = sorted({p.model for p in points if p.model and p.model.startswith('tiny')})
    if tiny:
        notes.append(
            f'{label}: measured on the {tiny[0]!r} smoke-test model, not a real one: these days and costs '
            "are that model's, not what training the real model takes"
        )
    others = sorted({p.model for p in points if p.model and not p.model.startswith('tiny')} - {PUBLISHED_MODEL})
    if others and samples == [str(PUBLISHED_SAMPLES)]:
        notes.append(
            f"{label}: the budget is SD2 base's published {PUBLISHED_SAMPLES:,} samples, not {others[0]}'s own "
            'schedule: pass --samples for that'
        )
    if any(p.precomputed for p in points):
        notes.append(
            f'{label}: measured from precomputed latents (the denoiser alone): add the one-off pass of '
            'precompute.py (the VAE and text encoders over the data once) to the cost'
        )
    return notes


def predicted_part(label, rows, base, models, bands, other_cluster, budget) -> tuple[Curve, list[str], str]:
    """(curve, notes, text) of a table predicted by the step models: days against GPUs through the measured and
    predicted counts; a note for each reference at a count the models cannot predict; and the models' text."""
    line = prediction_line(rows)
    # Another GPU's cluster is named wherever the prediction is shown, never passed off as measured there.
    name = f'step model, {other_cluster} cluster' if other_cluster else 'step model'
    curve = Curve([r.gpus for r in line], [r.days for r in line], name)
    shown = {r.gpus: why_unpredictable(models, r.gpus) for r in rows if r.kind != 'limit'}
    table_counts = sorted(gpus for gpus, why in shown.items() if not why)
    references = [(r.gpus, r.img_per_sec) for r in rows if r.kind == 'reference']
    notes = [
        f'{label}: no prediction at {gpus:,} GPUs to compare --reference with: {shown[gpus]}'
        for gpus, _ in references
        if shown[gpus]
    ]
    references = [(gpus, img_per_sec) for gpus, img_per_sec in references if not shown[gpus]]
    text = describe_prediction(
        f'{label} measured, {other_cluster} cluster' if other_cluster else label,
        models,
        bands,
        budget,
        table_counts,
        references,
        (base.gpus, base.phase_img_per_sec),
    )
    return curve, notes, text


def fitted_curve(rows, fits, budget) -> Curve:
    """Days against GPUs along the fitted model, for the figure: 50 counts spanning the table's."""
    n = np.geomspace(min(r.gpus for r in rows), max(r.gpus for r in rows), 50)
    days = sum(budget[ph] / fits[ph].img_per_sec(n) for ph in phase_order(budget)) / SECONDS_PER_DAY
    return Curve(n, days, 'fit')


def fit_lines(label, rows, fits, device) -> list[str]:
    """Each phase's fit, and each count predicted by the fits against its reference throughput."""
    extra = [r.gpus for r in rows if r.kind == 'predicted']
    lines = [describe_fit(label + (f' {ph}px' if ph else ''), fit, extra, device) for ph, fit in fits.items()]
    refs = {r.gpus: r for r in rows if r.kind == 'reference'}
    return lines + [
        f'- {label} at {r.gpus} {device}s: predicted {r.img_per_sec:,.1f} img/s vs reference '
        f'{refs[r.gpus].img_per_sec:,.1f} img/s '
        f'({r.img_per_sec / refs[r.gpus].img_per_sec - 1:+.1%})'
        for r in rows
        if r.kind == 'predicted' and r.gpus in refs
    ]


def model_names(groups: dict) -> list[str]:
    """The models the report is of, as its title and figure name them."""
    return sorted({p.model for points in groups.values() for p in points if p.model}) or ['SD2']


def report_blocks(sections: list[Section], groups: dict, budget: dict, price: float) -> list[str]:
    """The report in Markdown, as the blocks printed one after another: its title and budget, the tables, the step
    model's text or the fits, and the notes."""
    budget_text = ' + '.join(f'{n:,} samples' + (f' at {ph}px' if ph else '') for ph, n in budget.items())
    device = device_word([p for points in groups.values() for p in points])
    blocks = [
        f'# {", ".join(model_names(groups))}: training time and cost\n\n'
        f'Budget: {budget_text}; ${price:.2f} per {device}-hour.\n'
    ]
    for section in sections:
        label, rows, _, base_gpus = section.table
        table = markdown_table(rows, label, base_gpus, phase_order(budget), device_word(groups[label]))
        blocks.append((f'## {label}\n\n' if len(sections) > 1 else '') + table + '\n')
    prediction_texts = [section.prediction_text for section in sections if section.prediction_text]
    if prediction_texts:
        blocks.append('\n'.join(prediction_texts))
    fitted = [line for section in sections for line in section.fit_lines]
    if fitted:
        blocks.append(
            "Scaling fit (seconds/image = a + b/N: Amdahl's law at a fixed global batch; "
            f'a is per-step work that does not shrink with more {device}s):\n\n' + '\n'.join(fitted) + '\n'
        )
    notes = [note for section in sections for note in section.notes]
    if notes:
        blocks.append('Notes:\n\n' + '\n'.join(f'- {n}' for n in notes) + '\n')
    return blocks
