"""The GPU campaign in one command (`make gpu-campaign`): what a GPU's first minutes should measure, in order, in
slices that each end before --time_limit and resume where the last stopped.

    .venv/bin/python benchmarks/gpu_campaign.py                        # one slice of at most 9 minutes
    .venv/bin/python benchmarks/gpu_campaign.py --resume               # the next slice, keeping what was measured

The steps (each a process of its own: a failure is a row of the table, not the end of the campaign):

1. environment: the GPU, driver and versions; a bf16 matrix multiply's and a copy's measured ceilings;
2. SD2 base at 512px from precomputed latents, eager, at microbatch 4, 8, 16, 32, 64 (peak memory each; the
   microbatch memory_plan.py plans for this GPU marked);
3. a profile at microbatch 4 and at the fastest (benchmarks/profile_summary.py: busy share, classes of work);
4. at the fastest microbatch, each speed path alone (the others off) and all together: channels-last, fused AdamW,
   low-precision norms, fp16 against bf16, the compile modes, activation checkpointing;
5. the encoders online at the fastest configuration, and the published recipe as its reference row;
6. the gpu test tier, one test at a time, each with a timeout;
7. SD3.5 medium and PixArt-Sigma at their presets; Flux's transformer forward and backward per image at 256px in
   bf16, with and without --fp8, and report.py --predict for 16 and 72 GPUs from it.

Everything lands in one folder (--out) of at most 8 files: campaign.md (the table, printed last), campaign.json
(every row, for --resume), logs.tar.gz (each process's output) and the profile summaries. On a CPU it runs the
tiny twins' rows, which checks the campaign, not the hardware.
"""

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from results import Results

os.environ.setdefault('HF_HUB_OFFLINE', '1')
REPO = Path(__file__).resolve().parent.parent
STEPS = ('environment', 'sweep', 'profile', 'paths', 'online', 'gpu_tier', 'transformers')
# The speed paths of step 4: each alone over a row with every path off, then together (the fast recipe's own).
ALL_OFF = ('--no-channels_last', '--no-fused_adamw', '--no-low_precision_norm', '--no-encoders_bf16')
PATHS = {
    'all off': (),
    'channels_last': ('--channels_last',),
    'fused_adamw': ('--fused_adamw',),
    'low_precision_norm': ('--low_precision_norm',),
    'fp16': ('--precision', 'amp_fp16'),
    'activation_checkpointing': ('--activation_checkpointing',),
    'compile default': ('--compile',),
    'compile max-autotune-no-cudagraphs': ('--compile', 'max-autotune-no-cudagraphs'),
    'compile reduce-overhead': ('--compile', 'reduce-overhead'),
}
GPU_ONLY = {name for name in PATHS if name.startswith('compile')} | {'low_precision_norm', 'fp16'}
SLICE_MINUTES = 9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='results/gpu-campaign', help='the folder (default: %(default)s)')
    parser.add_argument(
        '--time_limit',
        type=float,
        default=SLICE_MINUTES,
        help='minutes: start no row that would likely end after them (default: %(default)s)',
    )
    parser.add_argument('--resume', action='store_true', help='keep the rows --out holds from this machine')
    parser.add_argument('--steps', nargs='+', choices=STEPS, default=list(STEPS), help='steps to run (default: all)')
    parser.add_argument('--batches', type=int, default=None, help='batches per run (default: 12 on a GPU, 3 on CPU)')
    parser.add_argument(
        '--test_timeout', type=int, default=300, help='seconds per gpu-tier test (default: %(default)s)'
    )
    args = parser.parse_args(argv)
    if not args.time_limit > 0:
        parser.error(f'--time_limit {args.time_limit}: must be positive (minutes)')
    if args.batches is not None and args.batches < 3:
        parser.error(f'--batches {args.batches}: at least 3 (a throughput window needs 2 after the first)')
    if args.test_timeout <= 0:
        parser.error(f'--test_timeout {args.test_timeout}: must be positive')
    return args


# ------------------------------------------------------------------------------------------------ rows


def benchmark_row(key: str, step: str, flags: tuple[str, ...], results: Path, batches: int) -> dict:
    argv = [str(REPO / 'benchmark.py'), '--use_synth_data', '--max_duration', f'{batches}ba', *flags]
    return {'key': key, 'step': step, 'kind': 'benchmark', 'argv': [*argv, '--results_json', str(results)]}


class Campaign:
    """The rows of each step, built from the rows measured before them (the fastest microbatch, say)."""

    def __init__(self, args: argparse.Namespace, on_gpu: bool, work: Path):
        self.args, self.on_gpu, self.work = args, on_gpu, work
        self.model, self.size = ('sd2-base', 512) if on_gpu else ('tiny', 64)
        self.microbatches = (4, 8, 16, 32, 64) if on_gpu else (1, 2, 4, 8)
        self.batches = args.batches or (12 if on_gpu else 3)

    def run(self, name: str, step: str, flags: tuple[str, ...], microbatch: int, accumulation: int = 2) -> dict:
        base = ('--model_name', self.model, '--image_size', str(self.size))
        batch = ('--batch_size', str(microbatch * accumulation), '--device_train_microbatch_size', str(microbatch))
        return benchmark_row(name, step, (*base, *batch, *flags), self.work / f'{slug(name)}.json', self.batches)

    def rows(self, step: str, done: dict) -> list[dict] | None:
        """The step's rows, or None while a step they depend on is unfinished."""
        precomputed = ('--precomputed_latents', *ALL_OFF)
        if step == 'environment':
            return [probe_row('environment', step, ['environment'])]
        if step == 'sweep':
            return [self.run(f'sweep mb{m}', step, precomputed, m) for m in self.microbatches]
        fastest = self.fastest(done)
        if fastest is None:
            return None
        if step == 'profile':
            rows = []
            for m in sorted({self.microbatches[0], fastest}):
                row = self.run(f'profile mb{m}', step, (*precomputed, '--profile', str(self.work / f'trace-mb{m}')), m)
                rows.append({**row, 'kind': 'profile', 'trace': str(self.work / f'trace-mb{m}')})
            return rows
        if step == 'paths':
            rows = [
                self.run(f'path {name}', step, (*precomputed, *flags), fastest)
                for name, flags in PATHS.items()
                if self.on_gpu or name not in GPU_ONLY
            ]
            together = ('--precomputed_latents',) + (() if self.on_gpu else ('--channels_last', '--fused_adamw'))
            return rows + [self.run('paths together (fast recipe)', step, together, fastest)]
        if step == 'online':
            return [
                self.run('online, fast recipe', step, (), fastest),
                self.run('online, published recipe', step, ('--recipe', 'published'), 4 if self.on_gpu else 1),
            ]
        if step == 'gpu_tier':
            return [{'key': 'gpu tier', 'step': step, 'kind': 'gpu_tier'}]
        return self.transformer_rows()

    def transformer_rows(self) -> list[dict]:
        rows = []
        for name in ('sd3.5-medium', 'pixart-sigma') if self.on_gpu else ('tiny-sd3.5-medium', 'tiny-pixart-sigma'):
            flags = ('--model_name', name, '--precomputed_latents')
            if not self.on_gpu:
                flags += ('--batch_size', '4')
            rows.append(
                benchmark_row(f'{name} preset', 'transformers', flags, self.work / f'{name}.json', self.batches)
            )
        flux = 'flux-schnell' if self.on_gpu else 'tiny-flux-schnell'
        size = '256' if self.on_gpu else '64'
        for fp8 in (False, True):
            if fp8 and not self.on_gpu:
                continue  # torchao's float8 matmuls need an H100 or newer
            argv = ['transformer_step', '--model_name', flux, '--image_size', size, '--microbatch', '4']
            rows.append(
                probe_row(f'{flux} {size}px step' + (' fp8' if fp8 else ''), 'transformers', argv + ['--fp8'] * fp8)
            )
        rows.append(
            {'key': f'{flux} predicted', 'step': 'transformers', 'kind': 'predict', 'from': f'{flux} {size}px step'}
        )
        return rows

    def fastest(self, done: dict) -> int | None:
        sweep = [done.get(f'sweep mb{m}') for m in self.microbatches]
        if any(row is None for row in sweep):
            return None
        measured = [
            (row['img_per_sec_per_device'], row['microbatch']) for row in sweep if row.get('img_per_sec_per_device')
        ]
        return max(measured)[1] if measured else self.microbatches[0]


def probe_row(key: str, step: str, argv: list[str]) -> dict:
    return {'key': key, 'step': step, 'kind': 'probe', 'argv': ['-m', 'benchmarks.campaign_probes', *argv]}


def slug(name: str) -> str:
    return ''.join(c if c.isalnum() else '-' for c in name)


# ------------------------------------------------------------------------------------------------ running


def execute(row: dict, seconds_left: float, args, work: Path) -> dict:
    """Runs one row's process (at most `seconds_left`), keeps its output in work/, returns what it measured."""
    log = work / f'{slug(row["key"])}.log'
    start = time.perf_counter()
    if row['kind'] == 'gpu_tier':
        return run_gpu_tier(args, log, seconds_left) | {'seconds': time.perf_counter() - start}
    if row['kind'] == 'predict':
        return {}  # filled by predict() from the row it names
    try:
        finished = subprocess.run(
            [sys.executable, *row['argv']], cwd=REPO, capture_output=True, text=True, timeout=seconds_left
        )
        output, status = finished.stdout + finished.stderr, finished.returncode
    except subprocess.TimeoutExpired as stopped:
        output, status = f'{stopped.stdout or ""}{stopped.stderr or ""}\ntimed out after {seconds_left:.0f} s', -1
    log.write_text(output if isinstance(output, str) else output.decode(errors='replace'))
    measured = {'seconds': time.perf_counter() - start, 'status': status}
    if status != 0:
        lines = [line for line in str(output).splitlines() if line.strip()]
        return measured | {'error': (lines or ['no output'])[-1][:200]}
    if row['kind'] == 'probe':
        return measured | json.loads(str(output).strip().splitlines()[-1])
    results = json.loads(Path(row['argv'][-1]).read_text())
    fields = ('img_per_sec_per_device', 'mfu', 'peak_gpu_memory_gb', 'device_train_microbatch_size', 'device_name')
    measured |= {field: results.get(field) for field in fields}
    measured['microbatch'] = results.get('device_train_microbatch_size')
    if row['kind'] == 'profile':
        from benchmarks import profile_summary

        traces = sorted(Path(row['trace']).glob('rank0.*.json'))
        if traces:
            measured['profile'] = profile_summary.report(
                profile_summary.summarize(profile_summary.load_trace(traces[0]))
            )
    return measured


def run_gpu_tier(args, log: Path, seconds_left: float) -> dict:
    """Each test of the gpu tier in a pytest process of its own (three at once ran out of memory)."""
    if not on_a_gpu():
        return {'skipped': 'no GPU'}
    listed = subprocess.run(
        [sys.executable, '-m', 'pytest', '-m', 'gpu', '--collect-only', '-q'], cwd=REPO, capture_output=True, text=True
    )
    tests = [line for line in listed.stdout.splitlines() if '::' in line]
    passed, failed, output, deadline = [], [], [], time.perf_counter() + seconds_left
    for test in tests:
        left = deadline - time.perf_counter()
        if left < 30:
            failed.append(f'{test}: not run (time limit)')
            continue
        try:
            one = subprocess.run(
                [sys.executable, '-m', 'pytest', '-q', '-x', test],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=min(args.test_timeout, left),
            )
            ok, text = one.returncode == 0, one.stdout[-3000:] + one.stderr[-2000:]
        except subprocess.TimeoutExpired:
            ok, text = False, f'timed out after {min(args.test_timeout, left):.0f} s'
        output.append(f'==== {test}\n{text}')
        (passed if ok else failed).append(test if ok else f'{test}: {text.strip().splitlines()[-1][:160]}')
    log.write_text('\n'.join(output))
    return {'passed': len(passed), 'failed': failed, 'tests': len(tests)}


def on_a_gpu() -> bool:
    probe = 'import torch; print(torch.cuda.is_available())'
    return subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout.strip() == 'True'


def predict(done: dict, row: dict, work: Path) -> dict:
    """report.py --predict 16 72 from the transformer step's throughput, as a one-GPU results file."""
    step = done.get(row['from'])
    if not step or 'img_per_sec' not in step:
        return {'error': f'no measurement of {row["from"]}'}
    if not step['on_gpu']:
        return {'skipped': "a CPU's throughput predicts no GPU cluster"}
    results = Results(
        img_per_sec=step['img_per_sec'],
        img_per_sec_per_device=step['img_per_sec'],
        flops_per_image=step['trained_flops_per_image'],  # precomputed: the transformer's forward and backward
        trained_flops_per_image=step['trained_flops_per_image'],
        trained_parameters=step['trained_parameters'],
        device_type='gpu' if step['on_gpu'] else 'cpu',
        device_name=step['device'],
        num_devices=1,
        world_size=1,
        image_size=step['image_size'],
        model_name=step['model_name'],
        device_train_microbatch_size=step['microbatch'],
        config={
            'model_name': step['model_name'],
            'precomputed_latents': True,
            'fsdp': 'full_shard',
            'batch_size': step['microbatch'],  # one GPU, one microbatch a step
            'device_train_microbatch_size': step['microbatch'],
        },
    )
    path = work / 'transformer-step.json'
    path.write_text(results.to_json())
    # A global batch that 16 and 72 GPUs both split into whole microbatches (144 = lcm(16, 72)).
    batch = str(144 * step['microbatch'])
    argv = [
        str(REPO / 'report.py'),
        str(path),
        '--predict',
        '16',
        '72',
        '--samples',
        '1000000',
        '--global_batch',
        batch,
    ]
    finished = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True)
    (work / 'predict.log').write_text(finished.stdout + finished.stderr)
    if finished.returncode:
        return {'error': (finished.stderr.strip().splitlines() or ['report.py failed'])[-1][:200]}
    return {'report': finished.stdout.strip()}


# ------------------------------------------------------------------------------------------------ the folder


def write_folder(out: Path, work: Path, state: dict) -> None:
    """campaign.json, campaign.md, logs.tar.gz (the logs so far, the earlier archive's kept), profile summaries."""
    (out / 'campaign.json').write_text(json.dumps(state, indent=1) + '\n')
    (out / 'campaign.md').write_text(table(state) + '\n')
    for key, row in state['rows'].items():
        if 'profile' in row:
            (out / f'{slug(key)}.md').write_text(row['profile'] + '\n')
    archive, kept = out / 'logs.tar.gz', {}
    if archive.is_file():
        with tarfile.open(archive) as old:
            kept = {member.name: old.extractfile(member).read() for member in old.getmembers() if member.isfile()}
    kept |= {log.name: log.read_bytes() for log in work.glob('*.log')}
    with tarfile.open(archive, 'w:gz') as new:
        for name, data in sorted(kept.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            new.addfile(info, io.BytesIO(data))


def table(state: dict) -> str:
    lines = [
        f'# GPU campaign on {state.get("machine")}',
        '',
        '| step | row | microbatch | img/s per GPU | MFU | peak memory GB | seconds | note |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for key, row in state['rows'].items():
        rate = row.get('img_per_sec_per_device') or row.get('img_per_sec')
        note = row.get('error') or row.get('skipped') or ''
        if row.get('planned'):
            note = 'planned microbatch ' + note
        if 'tests' in row:
            note = f'{row["passed"]} of {row["tests"]} passed' + ''.join(f'; {f}' for f in row['failed'][:5])
        if 'matmul_tflops' in row:
            matmul = f'{row["matmul_tflops"]:.1f} TFLOP/s {row["matmul_dtype"]}'
            note = f'{row["device"]}; matmul {matmul}, copy {row["copy_gb_s"]:.0f} GB/s'
        if 'tflops' in row:
            note = f'{row["tflops"]:.1f} TFLOP/s, {row["seconds_per_image"] * 1e3:.1f} ms per image'
        cells = (
            row.get('step', ''),
            key,
            row.get('microbatch') or '',
            f'{rate:.2f}' if rate else '',
            f'{row["mfu"]:.1%}' if row.get('mfu') else '',
            f'{row["peak_gpu_memory_gb"]:.1f}' if row.get('peak_gpu_memory_gb') else '',
            f'{row["seconds"]:.0f}' if 'seconds' in row else '',
            note,
        )
        lines.append('| ' + ' | '.join(str(cell) for cell in cells) + ' |')
    for key, row in state['rows'].items():
        if 'report' in row:
            lines += ['', f'## {key}', '', row['report']]
    left = state.get('left')
    lines += ['', f'{left} row(s) left: run again with --resume.' if left else 'Every step measured.']
    return '\n'.join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    out, on_gpu = Path(args.out), on_a_gpu()
    work = out.parent / f'.{out.name}-work'
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    machine = subprocess.run(
        [
            sys.executable,
            '-c',
            'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() '
            "else 'cpu', torch.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    saved = json.loads((out / 'campaign.json').read_text()) if (out / 'campaign.json').is_file() else {}
    rows = saved.get('rows', {}) if args.resume and saved.get('machine') == machine else {}
    state = {'machine': machine, 'rows': rows}
    campaign = Campaign(args, on_gpu, work)
    durations = [row['seconds'] for row in rows.values() if 'seconds' in row]
    left = 0
    for step in args.steps:
        planned = campaign.rows(step, rows)
        if planned is None:
            left += 1
            continue
        for row in planned:
            if row['key'] in rows:
                continue
            elapsed = time.perf_counter() - started
            expected = statistics.median(durations) if durations else 0
            seconds_left = 60 * args.time_limit - elapsed
            if elapsed + expected > 60 * args.time_limit or seconds_left < 10:
                left += 1
                continue
            print(f'[{step}] {row["key"]} ...', flush=True)
            measured = predict(rows, row, work) if row['kind'] == 'predict' else execute(row, seconds_left, args, work)
            rows[row['key']] = {'step': step, **measured}
            durations += [measured['seconds']] if 'seconds' in measured else []
            state['left'] = left
            write_folder(out, work, state)
    state['left'] = left
    mark_planned(rows, campaign)
    write_folder(out, work, state)
    print(table(state))
    return state


def mark_planned(rows: dict, campaign: Campaign) -> None:
    """Marks the sweep row at the microbatch memory_plan.py plans for this GPU (SD2 base, precomputed, no EMA)."""
    if not campaign.on_gpu:
        return
    probe = (
        'import config, flags; print(config.resolve_config(flags.parse_args(["--use_synth_data", '
        '"--precomputed_latents"])).device_train_microbatch_size)'
    )
    planned = subprocess.run([sys.executable, '-c', probe], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if f'sweep mb{planned}' in rows:
        rows[f'sweep mb{planned}']['planned'] = True


if __name__ == '__main__':
    main()
