"""The learning curve of one or more runs: validation loss against samples seen, from `benchmark.py
--results_json` files of runs with validation (--eval_interval), e.g. a speed path against the plain run.

    .venv/bin/python benchmarks/learning_curve.py results/plain.json results/bf16.json --out results/curve.png

Each file is one line (its label: --label, or the file name), the EMA weights' curve dashed beside it; the table
printed holds each run's loss at the start and at the end.
"""

import argparse
import sys
from pathlib import Path

from costs.results import ResultsError, load_results
from settings.presets import VALIDATION_TIMESTEPS


def read_curves(paths: list[str], labels: list[str]) -> list[tuple[str, list, list]]:
    """(label, curve, EMA curve or []) per results file; ResultsError names a file without a curve."""
    runs = []
    for path, label in zip(paths, labels):
        results = load_results(path)
        if not results.val_loss_curve:
            raise ResultsError(f'{path}: no validation loss in it: run benchmark.py with --eval_interval')
        runs.append((label, results.val_loss_curve, results.val_loss_ema_curve or []))
    return runs


def plot(runs: list[tuple[str, list, list]], out: Path) -> None:
    import matplotlib  # here, not at the top: --help and a bad flag answer without loading it

    matplotlib.use('Agg')  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, curve, ema_curve in runs:
        (line,) = axes.plot(*zip(*curve), marker='o', markersize=3, label=label)
        if ema_curve:
            axes.plot(*zip(*ema_curve), linestyle='--', color=line.get_color(), label=f'{label} (EMA weights)')
    axes.set_xlabel('samples seen')
    axes.set_ylabel(f'validation loss (mean over {VALIDATION_TIMESTEPS} fixed timesteps)')
    axes.set_title('Learning curve')
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description='Plot validation loss against samples seen from results files.'
    )
    parser.add_argument('results', nargs='+', help='benchmark.py --results_json files of runs with validation')
    parser.add_argument('--label', action='append', default=[], help='a label per file, in order (default: names)')
    parser.add_argument('--out', default='results/learning_curve.png', help='the PNG (default: %(default)s)')
    args = parser.parse_args(argv)
    if args.label and len(args.label) != len(args.results):
        print(f'error: --label given {len(args.label)} time(s) for {len(args.results)} file(s)', file=sys.stderr)
        return 2
    try:
        runs = read_curves(args.results, args.label or [Path(path).stem for path in args.results])
    except ResultsError as error:
        print(f'error: {error}', file=sys.stderr)
        return 2
    plot(runs, Path(args.out))
    print('| run | samples | validation loss at start | at end | EMA at end |')
    print('|---|---|---|---|---|')
    for label, curve, ema_curve in runs:
        ema = f'{ema_curve[-1][1]:.4f}' if ema_curve else '-'
        print(f'| {label} | {curve[-1][0]} | {curve[0][1]:.4f} | {curve[-1][1]:.4f} | {ema} |')
    print(f'figure written to {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
