"""The fit of throughput against GPU count, per GPU type and per resolution: seconds per image = a + b / N.

This is Amdahl's law at a fixed global batch (2048 in the published runs): each step's forward and
backward work (b) is split across N GPUs, while the per-step work that does not shrink as GPUs
are added (optimizer step and EMA on every replica, gradient all-reduce) costs a fixed a.
It implies a per-doubling efficiency that falls with scale:
    e(N -> 2N) = throughput(2N) / (2 throughput(N)) = (a + b/N) / (2a + b/N).
The fit minimizes relative error in 1/throughput, with a >= 0 and b >= 0.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class Fit:
    """seconds/image = a + b / N, fitted to measured throughputs."""

    a: float  # seconds per image that do not shrink with more GPUs
    b: float  # seconds per image on one GPU that do
    points: dict  # {gpus: measured img/s}

    def img_per_sec(self, gpus):
        return 1.0 / (self.a + self.b / gpus)

    def doubling_efficiency(self, gpus):
        return (self.a + self.b / gpus) / (2 * self.a + self.b / gpus)


def fit_scaling(points):
    """Fit seconds/image = a + b/N to {gpus: img/s}, minimizing relative error, a, b >= 0."""
    n = np.array(sorted(points), dtype=float)
    y = 1.0 / np.array([points[k] for k in sorted(points)])
    # Dividing each row by y turns least squares into least relative error.
    design = np.stack([np.ones_like(n), 1.0 / n], axis=1) / y[:, None]
    a, b = np.linalg.lstsq(design, np.ones_like(y), rcond=None)[0]
    if a < 0:  # superlinear data: best fit with perfect scaling
        a, b = 0.0, float(np.sum(1 / (n * y)) / np.sum(1 / (n * n * y * y)))
    if b < 0:  # more GPUs never helped: best fit with constant throughput
        a, b = float(np.sum(1 / y) / np.sum(1 / (y * y))), 0.0
    return Fit(float(a), float(b), dict(points))


def describe_fit(label, fit, extra, device='GPU'):
    """The fit's line of the report: its terms, its error at each measured count, and the efficiency of each doubling
    from the smallest measured count through the largest count shown (`extra`: the predicted ones)."""
    measured = sorted(fit.points)
    errors = [
        f'{k}: {fit.img_per_sec(k) / v - 1:+.1%}'.replace('-0.0%', '+0.0%') for k, v in sorted(fit.points.items())
    ]
    lines = [
        f'- **{label}**: seconds/image = {fit.a:.4g} + {fit.b:.4g} / N, fitted to '
        f'{len(measured)} measured counts ({", ".join(map(str, measured))} {device}s); '
        f'fit error {", ".join(errors)}'
    ]
    steps, top = [measured[0]], max(measured + extra)
    while 2 * steps[-1] <= top:
        steps.append(2 * steps[-1])
    lines.append(
        '  per-doubling efficiency: ' + ', '.join(f'{k}->{2 * k} {fit.doubling_efficiency(k):.1%}' for k in steps[:-1])
    )
    return '\n'.join(lines)
