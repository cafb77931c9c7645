"""Speed paths, measured: training throughput of SD2 base on this machine's GPU with each speed flag of
benchmark.py alone on top of a baseline, then with every flag that helped together, at 256 and 512px,
with the encoders online and from precomputed latents. Prints a Markdown table of img/s per GPU, MFU
and peak GPU memory, and writes it to --out.

    .venv/bin/python benchmarks/speed_sweep.py                   # on a GPU: every row (estimated: an hour on one H100)
    .venv/bin/python benchmarks/speed_sweep.py --sizes 512 --modes precomputed --paths compile fused_adamw
    .venv/bin/python benchmarks/speed_sweep.py --model_name tiny # on a CPU: the paths that run there, tiny model
    .venv/bin/python benchmarks/speed_sweep.py --profile         # and profile the fastest row of each size and mode
    .venv/bin/python benchmarks/speed_sweep.py --time_limit 20 --resume  # 20 minutes now, then go on where it stopped

Each row is one `python benchmark.py --use_synth_data ... --results_json` in a process of its own, so
compile caches, allocator state and the peak-memory count never carry over between rows, and a row that
fails (out of memory, a compile error) is reported in the table instead of ending the sweep. The table is
rewritten after every row, so a sweep that is stopped keeps what it measured, and --resume takes up every row
already finished in --out with the same command instead of running it again. Throughput
is benchmark.py's: the median of SpeedMonitor's rolling windows, warm-up excluded, on one GPU.
The baseline is the published run's choices on today's stack: bf16 autocast, PyTorch SDPA attention,
fp32 frozen encoders run online, eager mode, AdamW's default (foreach) kernels, 8 loader workers and
pinned memory: the fast recipe's other speed paths turned off (SPEED_PATHS_OFF).
"""

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks import profile_summary
from costs.results import load_results
from costs.results import mfu as results_mfu
from guards.arguments import ConfigError
from settings.model_folder import read_model_folder, resolve_model_dir
from settings.presets import PRESETS, PUBLISHED_MODEL, SD2_BASE, default_model

os.environ.setdefault('HF_HUB_OFFLINE', '1')
REPO = Path(__file__).resolve().parent.parent


class SpeedPath(NamedTuple):
    flags: tuple[str, ...]
    gpu_only: bool = False  # needs CUDA (mixed precision, xFormers kernels, pinned memory, compile)
    online_only: bool = False  # acts on the VAE or text encoder, which precomputed runs do not have


SPEED_PATHS = {
    'baseline': SpeedPath(()),
    'fp16': SpeedPath(('--precision', 'amp_fp16'), gpu_only=True),
    'xformers': SpeedPath(('--attention', 'xformers'), gpu_only=True),
    'channels_last': SpeedPath(('--channels_last',)),
    'fused_adamw': SpeedPath(('--fused_adamw',)),
    'low_precision_norm': SpeedPath(('--low_precision_norm',), gpu_only=True),
    'encoders_bf16': SpeedPath(('--encoders_bf16',), online_only=True),
    'compile': SpeedPath(('--compile',), gpu_only=True),  # Inductor fails on this model's backward on CPU
    'workers_2': SpeedPath(('--num_workers', '2')),
    'no_pin_memory': SpeedPath(('--no-pin_memory',), gpu_only=True),
}
# The fast recipe's speed paths, off in every row (a row's own flags, after them, turn its one back on).
SPEED_PATHS_OFF = ('--no-channels_last', '--no-fused_adamw', '--no-low_precision_norm', '--no-encoders_bf16')
MODES = {'online': (), 'precomputed': ('--precomputed_latents',)}
# Samples per forward/backward on one 80 GB GPU: at 512px the published A100-40GB run fit 4 with
# xFormers, about 6 GB of activations each next to 15 GB of weights, gradients and AdamW state.
DEFAULT_MICROBATCH = {256: 32, 512: 8}
NOISE = 0.03  # a path "helps" when it beats the baseline by more than run-to-run noise
PROFILE_BATCHES = 4  # a profiled run: warm-up batches, the profiler's warm-up batch, the recorded one
# This repo's goal for SD2 base at 512px on one H100, as MFU, and the anchors it is measured against: img/s per
# GPU and MFU at 512px of the published benchmark (MosaicML's blog post, 8 x A100-40GB), of MosaicML's later
# diffusion training code, and of NVIDIA's MLPerf Training v4.1 submission (8 x H100).
GOAL_MFU = {'online': 0.35, 'precomputed': 0.40}
ANCHORS = {
    'online': 'the published benchmark, 16.0 img/s per A100 (~18% MFU)',
    'precomputed': 'MosaicML diffusion, 36.3 img/s per A100 (~28% MFU); NVIDIA MLPerf Training v4.1, '
    '137 img/s per H100 (~33% MFU)',
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        '--model_name',
        default=None,
        help='as in benchmark.py (default: sd2-base on a GPU, tiny without one)',
    )
    parser.add_argument(
        '--sizes',
        type=int,
        nargs='+',
        default=None,
        help='image sizes in pixels, run in this order (default for sd2-base: 512 256, the published size '
        'first; for other models their preset size)',
    )
    parser.add_argument(
        '--modes',
        nargs='+',
        choices=list(MODES),
        default=list(MODES),
        help='encoders online, and/or precomputed latents (default: both)',
    )
    parser.add_argument(
        '--paths',
        nargs='+',
        choices=list(SPEED_PATHS),
        default=list(SPEED_PATHS),
        metavar='PATH',
        help=f'speed paths to run (default: all): {", ".join(SPEED_PATHS)}',
    )
    parser.add_argument(
        '--microbatch',
        type=int,
        default=None,
        help=f'samples per forward/backward (default: {DEFAULT_MICROBATCH} by size, 8 otherwise); '
        'the combined row is also run at twice this',
    )
    parser.add_argument(
        '--accumulation',
        type=int,
        default=4,
        help='microbatches per optimizer step (default: %(default)s; the published run had 64, '
        'which makes the optimizer step a smaller share)',
    )
    parser.add_argument(
        '--batches',
        type=int,
        default=None,
        help='optimizer steps per row (default: 30 on a GPU, 12 without one); throughput windows are half of it',
    )
    parser.add_argument(
        '--peak_tflops',
        type=float,
        default=None,
        help="the GPU's dense bf16 peak, for MFU on GPUs Composer does not know",
    )
    parser.add_argument(
        '--profile',
        action='store_true',
        help='also profile the fastest row of each size and mode (a few batches with benchmark.py '
        '--profile) and say where its time went (benchmarks/profile_summary.py)',
    )
    parser.add_argument(
        '--out', default='results/speed_sweep', help='folder for the table, results and logs (default: %(default)s)'
    )
    parser.add_argument(
        '--resume',
        action='store_true',
        help='take up the rows an earlier sweep finished in --out (same size, mode, flags, microbatch, '
        'steps and model, on the same GPU and torch; failed rows included) instead of running them '
        'again',
    )
    parser.add_argument(
        '--time_limit',
        type=float,
        default=None,
        metavar='MINUTES',
        help='start no row that would likely end after this many minutes from the start (judged by '
        'the median time of the rows run so far); rows left out are listed as not run, for --resume',
    )
    args = parser.parse_args(argv)
    for flag in ('microbatch', 'accumulation', 'batches', 'peak_tflops', 'time_limit'):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f'--{flag} {value}: must be positive')
    if args.batches is not None and args.batches < 4:
        parser.error(f'--batches {args.batches}: at least 4 (throughput is measured on the steady half)')
    if args.model_name is None:  # the machine's defaults, looked up once the flags are checked
        args.model_name = default_model(gpu_available())
    if args.batches is None:
        args.batches = 30 if gpu_available() else 12
    if args.sizes is None:
        preset = PRESETS.get(args.model_name, SD2_BASE)
        args.sizes = [512, 256] if args.model_name == PUBLISHED_MODEL else [preset.image_size]
    if 'baseline' not in args.paths:
        args.paths.insert(0, 'baseline')  # every speedup is relative to it
    return args


def gpu_available() -> bool:
    import torch  # here, not at the top: --help and a bad flag answer without loading torch

    return torch.cuda.is_available()


def skip_reason(path: SpeedPath, mode: str, has_gpu: bool, transformer: bool = False) -> str | None:
    if path.gpu_only and not has_gpu:
        return 'needs a GPU'
    if path.online_only and mode == 'precomputed':
        return 'no encoders in a precomputed run'
    if '--attention' in path.flags and transformer:
        return 'the diffusion transformers run PyTorch SDPA attention only'
    if '--attention' in path.flags:
        try:
            import xformers  # noqa: F401
        except ImportError:
            return 'xformers is not installed'
    return None


def run_row(
    args,
    size: int,
    mode: str,
    name: str,
    flags: tuple[str, ...],
    microbatch: int,
    profile: Path | None = None,
    rows: list[dict] = (),
) -> dict:
    """One benchmark.py process; the row holds its results, or why it failed. With `profile`, a short run
    that records its last batch there instead (its throughput, profiler included, is not reported).
    Each finished row is saved beside its log, for --resume; `rows`, those so far, tell --time_limit's guess."""
    slug = re.sub(r'[^A-Za-z0-9_.+-]', '-', f'{size}px-{mode}-{name}-mb{microbatch}' + ('-profile' if profile else ''))
    results_json, log = Path(args.out) / f'{slug}.json', Path(args.out) / f'{slug}.log'
    saved_row = Path(args.out) / f'{slug}.row.json'
    batches = min(args.batches, PROFILE_BATCHES) if profile else args.batches
    benchmark_flags = [
        '--model_name',
        args.model_name,
        '--use_synth_data',
        '--image_size',
        str(size),
        '--batch_size',
        str(microbatch * args.accumulation),
        '--device_train_microbatch_size',
        str(microbatch),
        '--max_duration',
        f'{batches}ba',
        '--results_json',
        str(results_json),
        *MODES[mode],
        *SPEED_PATHS_OFF,
        *flags,
        *(['--profile', str(profile)] if profile else []),
    ]
    row = {
        'size': size,
        'mode': mode,
        'name': name,
        'flags': ' '.join(flags),
        'microbatch': microbatch,
        'command': benchmark_flags,
        'machine': this_machine(),
    }
    if args.resume and saved_row.is_file():
        saved = json.loads(saved_row.read_text())
        if (saved.get('command'), saved.get('machine')) == (benchmark_flags, row['machine']):
            return {**saved, 'resumed': True}
    if out_of_time(args, rows):
        return {**row, 'not_run': 'time limit reached (--resume goes on from here)'}
    saved_row.unlink(missing_ok=True)
    results_json.unlink(missing_ok=True)
    if profile:
        shutil.rmtree(profile, ignore_errors=True)
    start = time.perf_counter()
    with open(log, 'w') as output:
        finished = subprocess.run(
            [sys.executable, str(REPO / 'benchmark.py'), *benchmark_flags],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    row['seconds'] = time.perf_counter() - start
    if finished.returncode == 0 and results_json.is_file():
        row['results'] = dataclasses.asdict(load_results(str(results_json)))
    else:
        row['error'] = failure_reason(log.read_text())
    saved_row.write_text(json.dumps(row, indent=2) + '\n')
    return row


def this_machine() -> str:
    """What a row measured on, as far as --resume must match: rows of another GPU or torch are run again."""
    import torch  # here, not at the top: --help and a bad flag answer without loading torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine()
    return f'{device}, torch {torch.__version__}'


def failure_reason(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if any('out of memory' in line.lower() for line in lines):
        return 'out of memory'
    errors = [line for line in lines if line.startswith('error:') or 'Error' in line.split(':')[0]]
    return (errors or lines or ['exited with no output'])[-1][:120]


def per_gpu(row: dict) -> float | None:
    return row.get('results', {}).get('img_per_sec_per_device')


def mfu(row: dict, peak_tflops: float | None) -> float | None:
    """The run's own MFU (against results.py's peak table), else its FLOP rate against --peak_tflops."""
    results = row.get('results', {})
    if results.get('mfu'):
        return results['mfu']
    return results_mfu(
        results.get('flops_per_sec'), results.get('num_devices') or 1, peak_tflops * 1e12 if peak_tflops else None
    )


def sweep(args, rows: list[dict], profiles: list[str], report) -> None:
    """Appends the rows in order, and with --profile one line per size and mode on where the fastest row's time
    goes; calls report() after each."""
    has_gpu = gpu_available()

    def add(row):
        rows.append(row)
        report_progress(row)
        report()

    try:
        transformer = read_model_folder(resolve_model_dir(args.model_name)).is_transformer
    except ConfigError:  # a bad --model_name: every row's benchmark.py says why
        transformer = False
    for size in args.sizes:
        microbatch = args.microbatch or DEFAULT_MICROBATCH.get(size, 8)
        for mode in args.modes:
            baseline, helped, complete = None, [], True
            for name in args.paths:
                path = SPEED_PATHS[name]
                row = {
                    'size': size,
                    'mode': mode,
                    'name': name,
                    'flags': ' '.join(path.flags),
                    'microbatch': microbatch,
                }
                reason = skip_reason(path, mode, has_gpu, transformer)
                if reason:
                    add({**row, 'skipped': reason})
                    continue
                row = run_row(args, size, mode, name, path.flags, microbatch, rows=rows)
                add(row)
                complete = complete and 'not_run' not in row
                if name == 'baseline':
                    baseline = per_gpu(row)
                elif baseline and per_gpu(row) and per_gpu(row) > (1 + NOISE) * baseline:
                    helped.append(name)
            if baseline is None:
                continue
            # The paths that each beat the baseline, together, at the microbatch and at twice it; only once every
            # path was measured (a sweep cut short by --time_limit combines them when --resume completes it).
            combined = tuple(flag for name in helped for flag in SPEED_PATHS[name].flags)
            label = '+'.join(helped) if helped else 'baseline'
            for batch in (microbatch, 2 * microbatch) if helped else (2 * microbatch,):
                if complete:
                    add(run_row(args, size, mode, f'combined:{label}', combined, batch, rows=rows))
                else:
                    add(
                        {
                            'size': size,
                            'mode': mode,
                            'name': 'combined',
                            'flags': '',
                            'microbatch': batch,
                            'not_run': 'not every path was measured',
                        }
                    )
            if args.profile and complete:
                block = [row for row in rows if (row['size'], row['mode']) == (size, mode) and per_gpu(row)]
                profiles.append(profile_fastest(args, max(block, key=per_gpu), rows))
                report()


def out_of_time(args, rows: list[dict]) -> bool:
    """Whether a row started now would likely end after --time_limit: judged by the rows run so far."""
    if args.time_limit is None:
        return False
    ran = [row['seconds'] for row in rows if 'seconds' in row and not row.get('resumed')]
    expected = statistics.median(ran) if ran else 0
    return time.perf_counter() - args.started + expected > 60 * args.time_limit


def profile_fastest(args, row: dict, rows: list[dict]) -> str:
    """Profiles a row; returns one Markdown line on where its time went, the full summary written beside."""
    folder = Path(args.out) / f'profile-{row["size"]}px-{row["mode"]}'
    flags = tuple(row['flags'].split())
    run = run_row(args, row['size'], row['mode'], row['name'], flags, row['microbatch'], profile=folder, rows=rows)
    where = f'{row["size"]}px {row["mode"]}, fastest row {row["name"]} (microbatch {row["microbatch"]})'
    if 'not_run' in run:
        return f'- {where}: not profiled: {run["not_run"]}'
    traces = sorted(folder.glob('rank0.*.json'))
    if 'error' in run or not traces:
        return f'- {where}: profiling failed: {run.get("error", "no trace written")}'
    summary = profile_summary.summarize(profile_summary.load_trace(traces[0]))
    (folder / 'summary.md').write_text(profile_summary.report(summary) + '\n')
    if summary['gpu_by_class']:
        busy, classes = summary['gpu_busy_ms'], summary['gpu_by_class']
        lead = f'GPU busy {100 * busy / summary["step_ms"]:.1f}% of the step; of that, '
    else:
        busy, classes = sum(summary['host_by_class'].values()), summary['host_by_class']
        lead = 'no GPU; host operator time: '
    shares = ', '.join(
        f'{name} {100 * time / busy:.0f}%' for name, time in sorted(classes.items(), key=lambda item: -item[1])[:4]
    )
    return f'- {where}: {lead}{shares} ({folder / "summary.md"})'


def report_progress(row: dict) -> None:
    if 'results' in row:
        outcome = f'{per_gpu(row):.2f} img/s per GPU'
    elif 'error' in row:
        outcome = f'failed: {row["error"]}'
    else:
        outcome = f'skipped: {row["skipped"]}' if 'skipped' in row else f'not run: {row["not_run"]}'
    if row.get('resumed'):
        outcome += ' (from an earlier sweep)'
    elif 'seconds' in row:
        outcome += f' ({row["seconds"]:.0f} s)'
    print(f'[{row["size"]}px {row["mode"]}] {row["name"]} (microbatch {row["microbatch"]}): {outcome}', flush=True)


def table(rows: list[dict], peak_tflops: float | None) -> str:
    lines = [
        '| px | encoders | path | flags | microbatch | img/s per GPU | vs baseline | MFU | peak GPU memory (GB) |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    baselines = {(row['size'], row['mode']): per_gpu(row) for row in rows if row['name'] == 'baseline'}
    for row in rows:
        flags = f'`{row["flags"]}`' if row['flags'] else '-'
        start = f'| {row["size"]} | {row["mode"]} | {row["name"]} | {flags} | {row["microbatch"]} |'
        if 'skipped' in row:
            lines.append(f'{start} skipped: {row["skipped"]} | | | |')
        elif 'not_run' in row:
            lines.append(f'{start} not run: {row["not_run"]} | | | |')
        elif 'error' in row:
            lines.append(f'{start} failed: {row["error"]} | | | |')
        else:
            rate, baseline = per_gpu(row), baselines.get((row['size'], row['mode']))
            ratio = f'{rate / baseline:.2f}x' if rate and baseline else '-'
            utilization = mfu(row, peak_tflops)
            memory = row['results'].get('peak_gpu_memory_gb')
            lines.append(
                f'{start} {rate:.2f} | {ratio} | '
                f'{f"{100 * utilization:.1f}%" if utilization else "-"} | '
                f'{f"{memory:.1f}" if memory else "-"} |'
            )
    return '\n'.join(lines)


def header(rows: list[dict], argv: list[str]) -> str:
    measured = next((row['results'] for row in rows if 'results' in row), None)
    if measured is None:
        return 'No row ran.'
    versions = ', '.join(f'{name} {version}' for name, version in measured['versions'].items() if version)
    command = ' '.join(['python benchmarks/speed_sweep.py', *argv])
    dates = sorted(row['results']['date'][:10] for row in rows if 'results' in row)  # --resume: maybe several
    when = dates[0] if dates[0] == dates[-1] else f'{dates[0]} to {dates[-1]}'
    return f'{when}, {measured["device_name"]}, {measured["model_name"]}, synthetic data; {versions}.\n\n`{command}`'


def against_goal(rows: list[dict], peak_tflops: float | None) -> list[str]:
    """For SD2 base at 512px, a line per mode: its fastest row against the MFU goal and the anchors."""
    lines = []
    for mode in MODES:
        measured = [
            row
            for row in rows
            if (row['size'], row['mode']) == (512, mode)
            and per_gpu(row)
            and row['results']['model_name'] == PUBLISHED_MODEL
        ]
        if not measured:
            continue
        best = max(measured, key=per_gpu)
        utilization, goal = mfu(best, peak_tflops), GOAL_MFU[mode]
        verdict = (
            'MFU unknown (pass --peak_tflops)'
            if utilization is None
            else f'MFU {100 * utilization:.1f}% against the goal of {100 * goal:.0f}%: '
            f'{"met" if utilization >= goal else "missed"}'
        )
        lines.append(
            f'- 512px {mode}: fastest row {best["name"]} (microbatch {best["microbatch"]}), '
            f'{per_gpu(best):.2f} img/s per GPU on {best["results"]["device_name"]}, {verdict}. '
            f'Anchors: {ANCHORS[mode]}.'
        )
    return lines


def write_report(args, argv: list[str], rows: list[dict], profiles: list[str]) -> str:
    report = f'{header(rows, argv)}\n\n{table(rows, args.peak_tflops)}\n'
    goal = against_goal(rows, args.peak_tflops)
    if goal:
        report += '\nAgainst the goal (one H100, 512px) and the anchors:\n\n' + '\n'.join(goal) + '\n'
    if profiles:
        report += (
            '\nWhere the time goes (benchmark.py --profile, last of a few batches):\n\n' + '\n'.join(profiles) + '\n'
        )
    (Path(args.out) / 'speed_sweep.md').write_text(report)
    return report


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.started = time.perf_counter()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows, profiles = [], []
    sweep(args, rows, profiles, report=lambda: write_report(args, argv, rows, profiles))
    report = write_report(args, argv, rows, profiles)
    print(f"\n{report}\nwritten to {Path(args.out) / 'speed_sweep.md'} (each row's log and results JSON beside it)")
    if any('not_run' in row for row in rows):
        print(f'--time_limit {args.time_limit:g} reached: the same command with --resume runs the rows not run')
    return rows


if __name__ == '__main__':
    main()
