"""The report's figure: days to train (above) and their cost (below) against the cluster size, on log axes
labelled in plain round numbers.
"""

import math

import numpy as np

from costs.results import PEAK_FLOPS
from costs.tables import prediction_line

# Labelled ticks of a log axis are round values, m x 10^k for m in one of these sets, coarsest first.
LOG_TICK_MANTISSAS = ((1,), (1, 3), (1, 2, 5), (1, 2, 3, 5), (1, 1.5, 2, 3, 4, 5, 6, 8))
# Fewer labels give too little scale to read a point against.
FEWEST_Y_LABELS, FEWEST_X_LABELS = 4, 3
# A label nearer an end's than this share of the axis would overlap it.
LABEL_GAP = 0.1


def round_values(low, high, mantissas):
    """m x 10^k for m in `mantissas`, ascending, from a decade below `low` to a decade above `high`."""
    decades = range(math.floor(math.log10(low)) - 1, math.floor(math.log10(high)) + 2)
    return sorted(float(f'{m * 10.0**k:.12g}') for k in decades for m in mantissas)


def log_ticks(low, high):
    """The labelled ticks of a log axis that shows `low` to `high`: at its ends the nearest round values of the
    finest set that hold the data, so that no point sits above the last label and little of the axis is empty;
    between them the coarsest set that gives FEWEST_Y_LABELS labels in all."""
    finest = round_values(low, high, LOG_TICK_MANTISSAS[-1])
    first = max(i for i, value in enumerate(finest) if value <= low * (1 + 1e-9))
    last = min(i for i, value in enumerate(finest) if value >= high * (1 - 1e-9))
    while True:
        bottom, top = finest[first], finest[last]
        gap = LABEL_GAP * math.log(top / bottom)
        for mantissas in LOG_TICK_MANTISSAS:
            inner = [
                value
                for value in round_values(bottom, top, mantissas)
                if min(math.log(value / bottom), math.log(top / value)) > gap
            ]
            if len(inner) + 2 >= FEWEST_Y_LABELS:
                return [bottom, *inner, top]
        first, last = first - 1, last + 1  # a narrow range: widened by a round value on either side


def count_ticks(counts):
    """The GPU counts labelled on the x axis: every count shown, and doublings past the largest where fewer than
    FEWEST_X_LABELS are (a report of one run)."""
    ticks = sorted(counts)
    while len(ticks) < FEWEST_X_LABELS:
        ticks.append(2 * ticks[-1])
    return ticks


def padded(ticks):
    """Axis limits a little beyond the first and last tick (5% of the log span), so that a point on either shows
    whole."""
    pad = (ticks[-1] / ticks[0]) ** 0.05
    return ticks[0] / pad, ticks[-1] * pad


def plain_numbers(prefix=''):
    """Tick labels as plain numbers (0.1, 1, 1,000) with `prefix` ('$'), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _: f'{prefix}{x:,.12g}')


def samples_text(samples):
    return f'{samples / 1e9:.2f}B' if samples >= 1e9 else f'{samples:,}'


def figure(tables, budget, names, xlabel='Number of GPUs', price=2.0, device='GPU'):
    """Days to train (above) and their cost in USD (below) against the cluster size: the measured, predicted and
    reference rows as points, the fit or step model as a line with a prediction's range as a shaded band, and
    the limit at 100% of peak. `tables`: [(label, rows, curve)], curve (GPU counts, days, name) or None; `device`:
    what a count counts ('GPU', or 'device' for a CPU's runs), which the price is per hour of."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    fig = Figure(figsize=(6.4, 7.2), dpi=100)
    days_axes, cost_axes = fig.subplots(2, 1, sharex=True)

    def cost(gpus, days):  # GPU-hours at the price
        return np.asarray(days) * 24 * np.asarray(gpus) * price

    ticks = set()
    for color, (label, rows, curve) in zip(rcParams['axes.prop_cycle'].by_key()['color'], tables):
        for kind, style in (
            ('measured', dict(marker='o', zorder=3)),  # above a prediction at its count
            ('predicted', dict(marker='o', markerfacecolor='white')),
            ('reference', dict(marker='x', markersize=9)),
        ):
            pts = [r for r in rows if r.kind == kind]
            if pts:
                n, days = [r.gpus for r in pts], [r.days for r in pts]
                style = dict(linestyle='none', color=color, **style)
                days_axes.plot(n, days, label=f'{label} {kind}', **style)
                cost_axes.plot(n, cost(n, days), **style)
        if curve:
            n, days, name = curve
            days_axes.plot(n, days, color=color, linewidth=1, linestyle='--', label=f'{label} {name}')
            cost_axes.plot(n, cost(n, days), color=color, linewidth=1, linestyle='--')
        ranged = prediction_line(rows)
        if any(r.img_per_sec_range for r in ranged):
            # Days scale as 1/img/s: the highest throughput of the range gives the fewest days.
            n = np.array([r.gpus for r in ranged], float)
            days = np.array([r.days for r in ranged])
            low, high = np.array([r.img_per_sec_range or (r.img_per_sec,) * 2 for r in ranged]).T
            throughput = np.array([r.img_per_sec for r in ranged])
            fewest, most = days * throughput / high, days * throughput / low
            name = curve[2] if curve else 'prediction'
            days_axes.fill_between(n, fewest, most, color=color, alpha=0.2, linewidth=0, label=f'{label} {name} range')
            cost_axes.fill_between(n, cost(n, fewest), cost(n, most), color=color, alpha=0.2, linewidth=0)
        limit = [r for r in rows if r.kind == 'limit']
        if limit:  # days at the limit scale as 1/N, its GPU-hours not at all
            n = np.array([min(r.gpus for r in rows), limit[0].gpus], float)
            days = limit[0].days * limit[0].gpus / n
            days_axes.plot(n, days, color=color, linestyle=':', label=f'{label} at 100% of peak')
            cost_axes.plot(n, cost(n, days), color=color, linestyle=':')
        ticks |= {r.gpus for r in rows}
    for axes, ylabel, prefix in (
        (days_axes, 'Days to train', ''),
        (cost_axes, f'Cost (USD at ${price:,.2f} per {device}-hour)', '$'),
    ):
        axes.set_xscale('log', base=2)
        axes.set_yscale('log')
        axes.yaxis.set_major_formatter(plain_numbers(prefix))
        axes.yaxis.set_minor_formatter(NullFormatter())  # unlabelled: grid lines between the labels
        if axes.dataLim.y0 > 0:  # not at --price 0, whose costs a log axis cannot show
            # Labels chosen here, not by matplotlib's log locator, which can leave the highest points above the last.
            y_ticks = log_ticks(axes.dataLim.y0, axes.dataLim.y1)
            axes.set_ylim(*padded(y_ticks))
            axes.yaxis.set_major_locator(FixedLocator(y_ticks))
        axes.set_ylabel(ylabel)
        axes.grid(True, which='both', alpha=0.3)
    x_ticks = count_ticks(ticks)
    cost_axes.set_xlim(*padded(x_ticks))
    cost_axes.xaxis.set_major_locator(FixedLocator(x_ticks))
    cost_axes.xaxis.set_major_formatter(plain_numbers())
    cost_axes.xaxis.set_minor_locator(NullLocator())
    cost_axes.set_xlabel(xlabel)
    days_axes.set_title(f'Days and cost to train {", ".join(names)} on {samples_text(sum(budget.values()))} samples')
    days_axes.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(path, tables, budget, names, xlabel='Number of GPUs', price=2.0, device='GPU'):
    """The figure, written to `path` as PNG."""
    figure(tables, budget, names, xlabel, price, device).savefig(path)


def device_axis_label(devices: set[str]) -> str:
    """'Number of GPUs' for GPUs of the peak table, else the devices named (a CPU run's report)."""
    if all(device in PEAK_FLOPS for device in devices):
        return 'Number of GPUs'
    return f'Number of devices ({", ".join(sorted(devices))})'
