"""Where a training step's time goes: reads a PyTorch profiler trace written by `benchmark.py --profile DIR`
and prints Markdown tables of time by class of work (matmul/conv, attention, normalization, optimizer and EMA,
data movement, other elementwise), the top kernels on the GPU, the top operators on the host, and how much
of the step the GPU was busy.

    .venv/bin/python benchmark.py --use_synth_data --max_duration 6ba --profile results/profile
    .venv/bin/python benchmarks/profile_summary.py results/profile/rank0.6.pt.trace.json

A GPU busy for most of the step with matmul/conv on top is compute bound (MFU is then the matmuls' own
efficiency); a GPU idle for much of it waits on the host (kernel launches, the data loader, Python).
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# First match wins: attention kernels are matmuls too, and norms and optimizers are elementwise.
CLASSES = (
    ('attention', r'flash|fmha|attention|scaled_dot_product|efficient_attention|cutlassf'),
    ('normalization', r'norm'),
    ('optimizer + EMA', r'adam|multi_tensor|_foreach|lerp'),
    (
        'matmul/conv',
        r'gemm|cutlass|xmma|wgmma|cudnn|conv|addmm|aten::mm\b|aten::bmm|matmul|linear|mkldnn|sm\d\d_|'
        r'ampere_|hopper_|winograd|implicit',
    ),
    (
        'data movement',
        r'memcpy|memset|copy|contiguous|aten::cat\b|cat_|transpose|permute|nchw|nhwc|clone|fill|'
        r'index|gather|scatter|pin_memory',
    ),
)
OTHER = 'other (elementwise, activations, ...)'


def classify(name: str) -> str:
    lowered = name.lower()
    for label, pattern in CLASSES:
        if re.search(pattern, lowered):
            return label
    return OTHER


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == '.gz' else open
    try:
        with opener(path, 'rt') as file:
            trace = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f'error: {path}: not a readable PyTorch profiler trace ({error})')
    events = trace.get('traceEvents') if isinstance(trace, dict) else None
    if not events:
        raise SystemExit(f'error: {path}: no traceEvents (is this a PyTorch profiler Chrome trace?)')
    return events


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by the intervals, overlaps counted once (kernels of several streams overlap)."""
    covered, end = 0.0, float('-inf')
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return covered


def self_times(ops: list[dict]) -> dict[str, float]:
    """Host time per operator name, excluding the operators it called (nested events on the same thread)."""
    totals: dict[str, float] = defaultdict(float)
    by_thread = defaultdict(list)
    for op in ops:
        by_thread[(op.get('pid'), op.get('tid'))].append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda op: (op['ts'], -op['dur']))
        stack: list[list] = []  # [end, name, self time]
        for op in thread_ops:
            start, end = op['ts'], op['ts'] + op['dur']
            while stack and stack[-1][0] <= start:
                _, name, own = stack.pop()
                totals[name] += own
            if stack:
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, op['name'], op['dur']])
        for _, name, own in stack:
            totals[name] += own
    return totals


def summarize(events: list[dict]) -> dict:
    """Times in milliseconds over the profiled steps (ProfilerStep#N annotations)."""
    complete = [event for event in events if event.get('ph') == 'X' and 'dur' in event]
    steps = [event for event in complete if event.get('name', '').startswith('ProfilerStep#')]
    if not steps:
        raise SystemExit('error: the trace has no ProfilerStep#N span: record it with benchmark.py --profile')
    windows = [(step['ts'], step['ts'] + step['dur']) for step in steps]

    def inside(event):  # GPU work lags its launch: a step's last kernels are cut, the previous one's counted
        return any(start <= event['ts'] < stop for start, stop in windows)

    kernels = [event for event in complete if event.get('cat') == 'kernel' and inside(event)]
    transfers = [event for event in complete if event.get('cat') in ('gpu_memcpy', 'gpu_memset') and inside(event)]
    host_ops = [event for event in complete if event.get('cat') == 'cpu_op' and inside(event)]
    step_ms = sum(stop - start for start, stop in windows) / 1000

    gpu_by_class, gpu_by_name, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for event in kernels + transfers:
        gpu_by_class[classify(event['name'])] += event['dur'] / 1000
        gpu_by_name[event['name']] += event['dur'] / 1000
        calls[event['name']] += 1
    busy = (
        sum(
            union_length(
                [
                    (max(e['ts'], start), min(e['ts'] + e['dur'], stop))
                    for e in kernels + transfers
                    if start <= e['ts'] < stop
                ]
            )
            for start, stop in windows
        )
        / 1000
    )
    host_by_name = {name: time / 1000 for name, time in self_times(host_ops).items()}
    host_by_class = defaultdict(float)
    for name, time in host_by_name.items():
        host_by_class[classify(name)] += time
    return {
        'steps': len(steps),
        'step_ms': step_ms,
        'gpu_busy_ms': busy,
        'gpu_by_class': dict(gpu_by_class),
        'gpu_by_name': dict(gpu_by_name),
        'gpu_calls': dict(calls),
        'host_by_class': dict(host_by_class),
        'host_by_name': host_by_name,
    }


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join(' --- ' for _ in header) + '|']
    return lines + ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows]


def shares(times: dict[str, float], total: float, limit: int | None = None) -> list[tuple]:
    ranked = sorted(times.items(), key=lambda item: -item[1])[:limit]
    return [(name, f'{time:.2f}', f'{100 * time / total:.1f}%') for name, time in ranked]


def report(summary: dict, top: int = 15) -> str:
    step = summary['step_ms']
    lines = [f'Profiled {summary["steps"]} step(s): {step:.2f} ms in all.', '']
    if summary['gpu_by_class']:
        busy = summary['gpu_busy_ms']
        lines += [
            f'GPU busy {busy:.2f} ms, {100 * busy / step:.1f}% of the step; idle {100 * (1 - busy / step):.1f}% '
            '(waiting on the host: launches, data, Python).',
            '',
            '**GPU time by class** (share of busy time)',
            '',
        ]
        lines += table(('class', 'ms', 'share'), shares(summary['gpu_by_class'], busy)) + ['']
        lines += [f'**Top {top} GPU kernels**', '']
        rows = [
            (name[:90].replace('|', '/'), summary['gpu_calls'][name], ms, share)
            for name, ms, share in shares(summary['gpu_by_name'], busy, top)
        ]
        lines += table(('kernel', 'calls', 'ms', 'share'), rows) + ['']
    else:
        lines += ['No GPU kernels in the trace (a CPU run): the host times below are the step.', '']
    host = sum(summary['host_by_class'].values())
    lines += ['**Host operator self time by class** (all threads; share of their sum)', '']
    lines += table(('class', 'ms', 'share'), shares(summary['host_by_class'], host)) + ['']
    lines += [f'**Top {top} host operators** (self time)', '']
    lines += table(('operator', 'ms', 'share'), shares(summary['host_by_name'], host, top))
    return '\n'.join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('trace', type=Path, help='a trace from benchmark.py --profile (.json or .json.gz)')
    parser.add_argument('--top', type=int, default=15, help='rows of kernels and operators (default: %(default)s)')
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f'error: {args.trace}: no such file', file=sys.stderr)
        return 2
    print(report(summarize(load_trace(args.trace)), args.top))
    return 0


if __name__ == '__main__':
    sys.exit(main())
