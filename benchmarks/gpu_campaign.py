"""The GPU campaign in one command: what a GPU's first minutes should measure, ordered by value, in slices that
each end before --time_limit and resume where the last stopped. On a lent machine `bash benchmarks/gpu_slice.sh`
runs it (docs/speed.md).

    python benchmarks/gpu_campaign.py                        # one slice of at most 7.5 minutes (3.5 on a CPU)
    python benchmarks/gpu_campaign.py --resume               # the next slice, keeping what was measured

The steps (each row a process of its own: a failure is a row of the table, not the end of the campaign). Every
benchmark row past the headline is the README's headline recipe, the fast recipe compiled from precomputed latents
at the planned microbatch, changed in the one thing it measures; each step stands alone (a row that needs the
fastest microbatch takes the memory plan's where the sweep has not measured one, and says so):

1. environment: the GPU, driver and versions; a bf16 matrix multiply's and a copy's measured ceilings;
2. headline: SD2 base at 512px with the fast recipe at the planned microbatch, from precomputed latents and with
   the encoders online, eager, beside the published recipe at microbatch 4; then the two fast rows with --compile;
3. channels_last: the headline recipe, and the same with --channels_last (the A/B, in one call);
4. profile: the headline recipe's step under the profiler (benchmarks/profile_summary.py: busy share, classes of
   work), summarized on the machine;
5. kernels: the headline recipe with --fused_groupnorm, --attention cudnn, --cudnn_benchmark, each alone;
6. transformers: SD3.5 medium and PixArt-Sigma at their presets' sizes, compiled at the planned microbatch, bf16
   and --fp8; Flux's transformer forward and backward per image at 256px, compiled, in bf16 and with --fp8, and
   report.py --predict from it (labelled: the transformer's forward and backward only);
7. sweep: the headline recipe at microbatch 4 up to the planned one (out-of-memory rows recorded as such);
8. paths: the headline recipe less one of its paths (fused AdamW, low-precision norms), fp16 for bf16,
   reduce-overhead for default compiling, with activation checkpointing;
9. gpu tests, first a handful of the gpu tier's most telling, then the rest, each its own row, counted by its
   outcome; then max-autotune-no-cudagraphs (minutes of tuning: never in the first calls).

A row starts only if its estimate (by kind: eager run, compiled run, profile, transformer, test, probe; the median
of the rows of that kind this machine measured, else a default) fits the time left; the estimates are printed at
the start of each call. A row cut by the deadline is tried again in the next call; cut twice, it says so and is
passed over. Rows are kept per machine (device and torch): a call on another GPU adds its own rows beside them.
Everything lands in one folder (--out) of at most 8 files: campaign.md (the table, printed last), campaign.json
(every row, for --resume), logs.tar.gz (each process's output), the profile summary and compile-cache.tar.gz
(Inductor's and Triton's caches, unpacked by the next call: its compiled rows compile only what is new). On a CPU
it runs the tiny twins' rows (the GPU-only ones skipped), which checks the campaign, not the hardware.
"""

import argparse
import io
import json
import os
import statistics
import subprocess
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from benchmarks.campaign_rows import PYTHON, REPO, STEPS, Campaign, slug
from benchmarks.compile_cache import keep_compile_cache, use_compile_cache
from costs.results import Results

os.environ.setdefault('HF_HUB_OFFLINE', '1')
# Seconds a row of each kind takes from start to exit, before this machine has measured one: a GPU's (True), from
# the rows of benchmarks/results.md, and a CPU's (False).
ESTIMATES = {
    True: {'probe': 40, 'eager': 80, 'compile': 240, 'profile': 100, 'transformer': 150, 'test': 90, 'predict': 10},
    False: {'probe': 10, 'eager': 15, 'compile': 15, 'profile': 25, 'transformer': 20, 'test': 12, 'predict': 5},
}
SLICE_MINUTES = {True: 7.5, False: 3.5}  # a lent GPU call's 10 minutes less the start and the copy; a CPU's check


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='results/gpu-campaign', help='the folder (default: %(default)s)')
    parser.add_argument(
        '--work',
        default=None,
        help="the rows' own files, kept out of --out (default: a folder in the system's temporary directory)",
    )
    parser.add_argument(
        '--time_limit',
        type=float,
        default=None,
        help='minutes: start no row whose estimate would end after them (default: 7.5 on a GPU, 3.5 on a CPU)',
    )
    parser.add_argument('--resume', action='store_true', help='keep the rows --out holds')
    parser.add_argument('--steps', nargs='+', choices=STEPS, default=list(STEPS), help='steps to run (default: all)')
    parser.add_argument('--batches', type=int, default=None, help='batches per run (default: 10 on a GPU, 3 on CPU)')
    args = parser.parse_args(argv)
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f'--time_limit {args.time_limit}: must be positive (minutes)')
    if args.batches is not None and args.batches < 3:
        parser.error(f'--batches {args.batches}: at least 3 (a throughput window needs 2 after the first)')
    return args


# ------------------------------------------------------------------------------------------------ running


def execute(row: dict, seconds_left: float, work: Path) -> dict:
    """Runs one row's process (at most `seconds_left`), keeps its output in work/, returns what it measured;
    {'cut': True} where the deadline stopped it."""
    if row['kind'] == 'skipped':
        return {'skipped': row['skipped']}
    log = work / f'{slug(row["key"])}.log'
    start = time.perf_counter()
    argv = row.get('argv')
    if row['kind'] == 'test':
        report = work / f'{slug(row["key"])}.xml'
        argv = ['-m', 'pytest', '-m', 'gpu', '-q', '-p', 'no:cacheprovider', f'--junitxml={report}', row['test']]
    try:
        finished = subprocess.run([*PYTHON, *argv], cwd=REPO, capture_output=True, text=True, timeout=seconds_left)
    except subprocess.TimeoutExpired as stopped:
        log.write_text(
            f'{decoded(stopped.stdout)}{decoded(stopped.stderr)}\ncut by the deadline after {seconds_left:.0f} s'
        )
        return {'cut': True, 'seconds': time.perf_counter() - start}
    output, status = finished.stdout + finished.stderr, finished.returncode
    log.write_text(output)
    measured = {'seconds': time.perf_counter() - start, 'status': status}
    if row['kind'] == 'test':
        return measured | test_outcome(report, output)
    if status != 0:
        return measured | {'error': last_line(output)}
    if row['kind'] == 'probe':
        # The probe's JSON is stdout's last line; stderr (a library's warning, say) is kept in the log only.
        try:
            return measured | json.loads(finished.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return measured | {'error': f'the probe printed no JSON line: {last_line(output)}'}
    results = json.loads(Path(row['argv'][-1]).read_text())
    fields = ('img_per_sec_per_device', 'mfu', 'peak_gpu_memory_gb', 'peak_gpu_memory_reserved_gb', 'device_name')
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


def decoded(output: bytes | str | None) -> str:
    """A killed process's output: TimeoutExpired holds bytes even where the run asked for text."""
    return output.decode(errors='replace') if isinstance(output, bytes) else output or ''


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return (lines or ['no output'])[-1][:200]


# A JUnit report's element for a test that did not pass: the outcome it names, and the field its reason goes in.
JUNIT_OUTCOMES = {'failure': ('failed', 'error'), 'error': ('error', 'error'), 'skipped': ('skipped', 'skipped')}


def test_outcome(report: Path, output: str) -> dict:
    """A gpu test's outcome from pytest's JUnit report: passed, failed, error or skipped (never a pass), with the
    reason; 'not run' where pytest wrote no report or collected no test."""
    try:
        case = ElementTree.parse(report).getroot().find('.//testcase')
    except (OSError, ElementTree.ParseError):
        case = None
    if case is None:
        return {'outcome': 'not run', 'error': last_line(output)}
    for element, (outcome, field) in JUNIT_OUTCOMES.items():
        found = case.find(element)
        if found is not None:
            reason = (found.get('message') or found.text or '').strip().splitlines()
            return {'outcome': outcome, field: (reason or [outcome])[-1][:200]}
    return {'outcome': 'passed'}


def on_a_gpu() -> bool:
    probe = 'import torch; print(torch.cuda.is_available())'
    return subprocess.run([*PYTHON, '-c', probe], capture_output=True, text=True).stdout.strip() == 'True'


def predict(done: dict, row: dict, work: Path) -> dict:
    """report.py --predict 16 72 from the transformer step's throughput, as a one-GPU results file."""
    step = done.get(row['from'])
    if step and 'skipped' in step:
        return {'skipped': f'{row["from"]} was skipped'}
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
    finished = subprocess.run([*PYTHON, *argv], cwd=REPO, capture_output=True, text=True)
    (work / 'predict.log').write_text(finished.stdout + finished.stderr)
    if finished.returncode:
        return {'error': (finished.stderr.strip().splitlines() or ['report.py failed'])[-1][:200]}
    label = (
        f"From {row['from']}: the transformer's forward and backward only (no optimizer step, no encoders, no "
        'gradient exchange inside the step), so a bound on a training step, not a training step.'
    )
    return {'report': f'{label}\n\n{finished.stdout.strip()}'}


# ------------------------------------------------------------------------------------------------ the folder


def write_folder(out: Path, work: Path, state: dict) -> None:
    """campaign.json, campaign.md, logs.tar.gz (the logs so far, the earlier archive's kept), profile summaries."""
    (out / 'campaign.json').write_text(json.dumps(state, indent=1) + '\n')
    (out / 'campaign.md').write_text(table(state) + '\n')
    for machine in state['machines'].values():
        for key, row in machine['rows'].items():
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
    """One table of every machine's rows, the machine named in each; the reports after it."""
    on_cpus_only = all(machine.startswith('cpu ') for machine in state['machines'])
    lines = [
        '# GPU campaign, rehearsed on a CPU: tiny rows that check the campaign, not the hardware'
        if on_cpus_only
        else '# GPU campaign',
        '',
        '| machine | step | row | microbatch | img/s per device | MFU | peak GB alloc. / reserved | seconds | note |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for machine, held in state['machines'].items():
        for key, row in held['rows'].items():
            lines.append('| ' + ' | '.join(str(cell) for cell in (machine, *cells(key, row))) + ' |')
    for machine, held in state['machines'].items():
        for key, row in held['rows'].items():
            if 'report' in row:
                lines += ['', f'## {key} ({machine})', '', row['report']]
    left = state.get('left')
    lines += ['', f'{left} row(s) left: run again with --resume.' if left else 'Every step measured.']
    return '\n'.join(lines)


def cells(key: str, row: dict) -> tuple:
    rate = row.get('img_per_sec_per_device') or row.get('img_per_sec')
    note = row.get('error') or row.get('skipped') or ''
    if row.get('pending'):
        note = f'cut by the deadline {row["cuts"]} time(s): tried again next call'
    if row.get('planned'):
        note = 'planned microbatch ' + note
    if row.get('microbatch_from'):
        note = f'microbatch from {row["microbatch_from"]}' + (f'; {note}' if note else '')
    if 'outcome' in row:
        note = row['outcome'] + (f': {note}' if note else '')
    if 'matmul_tflops' in row:
        matmul = f'{row["matmul_tflops"]:.1f} TFLOP/s {row["matmul_dtype"]}'
        note = f'{row["device"]}; matmul {matmul}, copy {row["copy_gb_s"]:.0f} GB/s'
    if 'tflops' in row:
        note = f'{row["tflops"]:.1f} TFLOP/s, {row["seconds_per_image"] * 1e3:.1f} ms per image'
    allocated, reserved = row.get('peak_gpu_memory_gb'), row.get('peak_gpu_memory_reserved_gb')
    memory = f'{allocated:.1f}' if allocated else ''
    memory += f' / {reserved:.1f}' if reserved else ''
    return (
        row.get('step', ''),
        key,
        row.get('microbatch') or '',
        f'{rate:.2f}' if rate else '',
        f'{row["mfu"]:.1%}' if row.get('mfu') else '',
        memory,
        f'{row["seconds"]:.0f}' if 'seconds' in row else '',
        note,
    )


def estimates(rows: dict, on_gpu: bool) -> dict[str, float]:
    """Seconds a row of each kind is expected to take: the median of this machine's finished rows of that kind,
    else the default; a compiled row's compile is inside its own seconds."""
    expected = dict(ESTIMATES[on_gpu])
    for cost in expected:
        seconds = [row['seconds'] for row in rows.values() if row.get('cost') == cost and 'seconds' in row]
        if seconds:
            expected[cost] = statistics.median(seconds)
    return expected


LOAN_SECONDS = 2 * 9 * 60  # a loan: two calls of at most 9 minutes


def loans_left(campaign: Campaign, steps: list[str], done: dict, expected: dict[str, float]) -> str:
    """The minutes the rows not yet measured in these steps are estimated at, and the loans they need."""
    todo = [
        row
        for step in steps
        for row in campaign.rows(step, done)
        if row['kind'] != 'skipped' and (done.get(row['key']) is None or done[row['key']].get('pending'))
    ]
    seconds = sum(expected[row['cost']] for row in todo)
    loans = -(-seconds // LOAN_SECONDS)
    minutes = f'about {seconds / 60:.0f} minutes'
    return f'{len(todo)} row(s) left in these steps, {minutes}: {loans:.0f} loan(s) of two 9-minute calls'


def load_state(out: Path, resume: bool) -> dict:
    saved = json.loads((out / 'campaign.json').read_text()) if resume and (out / 'campaign.json').is_file() else {}
    if 'machine' in saved and 'machines' not in saved:  # an earlier layout: one machine's rows
        saved = {'machines': {saved['machine']: {'rows': saved.get('rows', {})}}}
    return {'machines': saved.get('machines', {})}


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    out, on_gpu = Path(args.out), on_a_gpu()
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / f'gpu-campaign-work-{os.getpid()}'
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    probe = (
        'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() '
        "else 'cpu', 'torch', torch.__version__)"
    )
    machine = subprocess.run([*PYTHON, '-c', probe], capture_output=True, text=True).stdout.strip() or 'unknown'
    state = load_state(out, args.resume)
    rows = state['machines'].setdefault(machine, {'rows': {}})['rows']
    limit = 60 * (args.time_limit or SLICE_MINUTES[on_gpu])
    expected = estimates(rows, on_gpu)
    if not on_gpu:
        print(
            'no GPU here: the campaign runs its tiny CPU rows instead (the tiny model at 32 px, a few batches; the '
            "GPU tests recorded as skipped), which check the campaign's steps and files, not the hardware",
            flush=True,
        )
    print(
        f'{machine}: a slice of {limit / 60:g} minutes; estimates in seconds: '
        + ', '.join(f'{cost} {seconds:.0f}' for cost, seconds in expected.items()),
        flush=True,
    )
    if (line := use_compile_cache(out)) is not None:
        print(line, flush=True)
    campaign = Campaign(args, on_gpu, work)
    print(loans_left(campaign, args.steps, rows, expected), flush=True)
    left = 0
    for step in args.steps:
        if limit - (time.perf_counter() - started) < min(expected.values()):
            left += 1  # no row of any kind fits: the step's rows are not even listed
            continue
        for row in campaign.rows(step, rows):
            kept = rows.get(row['key'])
            if kept is not None and not kept.get('pending'):
                continue
            seconds_left = limit - (time.perf_counter() - started)
            if row['kind'] != 'skipped' and expected[row['cost']] > seconds_left:
                left += 1
                continue
            if row['kind'] != 'skipped':
                print(f'[{step}] {row["key"]} (about {expected[row["cost"]]:.0f} s) ...', flush=True)
            if row['kind'] == 'predict':
                measured = predict(rows, row, work)
            else:
                measured = execute(row, seconds_left, work)
            cuts = (kept or {}).get('cuts', 0) + bool(measured.get('cut'))
            if measured.get('cut') and cuts < 2:
                measured = {'pending': True, 'cuts': cuts}
                left += 1
            elif measured.get('cut'):
                measured = {'error': 'cut by the deadline twice: passed over', 'cuts': cuts}
            rows[row['key']] = {'step': step, 'cost': row['cost'], **row.get('record', {}), **measured}
            state['left'] = left
            write_folder(out, work, state)
    state['left'] = left
    if on_gpu:
        mark_planned(rows, campaign.planned())
    write_folder(out, work, state)
    print(table(state))
    if (line := keep_compile_cache(out)) is not None:
        print(line, flush=True)
    return state


def mark_planned(rows: dict, planned: int) -> None:
    """Marks the sweep row at the microbatch memory_plan.py plans for this GPU."""
    if f'sweep mb{planned}' in rows:
        rows[f'sweep mb{planned}']['planned'] = True


if __name__ == '__main__':
    main()
