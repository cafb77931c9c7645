"""The GPU campaign in one command: what a GPU's minutes should measure, ordered by value, in loans whose rows fit
their 13 minutes, each loan in calls that end before the call's 10 minutes, resuming where the last stopped. On a
lent machine `bash benchmarks/gpu_slice.sh` runs it (docs/speed.md); here, `--land` commits what it measured.

    python benchmarks/gpu_campaign.py --loan kernels        # the next call of the loan named (campaign_rows.LOANS)
    python benchmarks/gpu_campaign.py --resume              # the next call of every step, keeping what was measured
    python benchmarks/gpu_campaign.py --land results/gpu-campaign    # its rows into benchmarks/measured/DATE-GPU/

The steps (each row a process of its own: a failure is a row of the table, not the end of the campaign). Every
benchmark row past the headline is the README's headline recipe, the fast recipe compiled from precomputed latents
at the planned microbatch, changed in the one thing it measures; each step stands alone (a row that needs the
fastest microbatch takes the memory plan's where the sweep has not measured one, and says so):

1. checks: the fused GroupNorm+SiLU, cuDNN attention and fp8 against their references (campaign_probes.py): a path
   that fails its check is not measured for speed;
2. environment: the GPU, driver and versions; a bf16 matrix multiply's and a copy's measured ceilings;
3. headline: SD2 base at 512px with the fast recipe at the planned microbatch, from precomputed latents and with
   the encoders online, eager, beside the published recipe at microbatch 4; then the two fast rows with --compile;
4. channels_last: the headline recipe, and the same with --channels_last (the A/B);
5. profile: the headline recipe's step under the profiler (benchmarks/profile_summary.py), summarized on the
   machine: the headline recipe's compiled graph again, a cache hit;
6. kernels: the headline recipe with --cudnn_benchmark (its graph: a cache hit), --fused_groupnorm, --attention
   cudnn, each alone;
7. transformers: SD3.5 medium, PixArt-Sigma and Flux's forward and backward, their blocks compiled once each, bf16
   and fp8, and report.py --predict from Flux's (labelled: the transformer's forward and backward only);
8. sweep: the headline recipe at half the planned microbatch (the planned one is the headline recipe's own row);
9. paths: the headline recipe less one of its paths (fused AdamW, low-precision norms), fp16 for bf16,
   reduce-overhead for default compiling, with activation checkpointing;
10. gpu tests, first a handful of the gpu tier's most telling, then the rest, each its own row, counted by its
   outcome; then max-autotune-no-cudagraphs (minutes of tuning: never in the first calls).

A row starts only if its estimate fits the time left in the call and in the loan. The estimates are seeded from the
rows recorded in benchmarks/measured/ (a compiled row, an eager row, and a compiled row whose graph an earlier row
of the loan compiled: that row's compile less what the cache saves), then this machine's own medians; before the
first row a call prints the loan's plan, its rows and minutes call by call. A row cut by the deadline is tried
again in the next call; cut twice, it says so and is passed over. Rows are kept per machine (device and torch),
each with its provenance (command, BENCHMARK_GIT_COMMIT, date, driver, CUDA, cuDNN) and its results file; the
rows landed in benchmarks/measured/ count as measured, so the next loan resumes from the committed folders.
Everything lands in one folder (--out) of at most 8 files: campaign.md (the table, printed last), campaign.json
(every row with its results), logs.tar.gz (each process's output, the end of it), the profile summary and
compile-cache.tar.gz (what Inductor and Triton reload, at most 15 MiB). On a CPU it runs the tiny twins' rows (the
GPU-only ones skipped), which checks the campaign, not the hardware.
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from benchmarks.campaign_record import (
    MEASURED,
    git_commit,
    land,
    provenance,
    table,
    write_folder,
)
from benchmarks.campaign_rows import LOANS, PYTHON, REPO, STEPS, Campaign, slug
from benchmarks.compile_cache import COMPILE_CACHE_FILE, keep_compile_cache, use_compile_cache
from costs.results import Results

os.environ.setdefault('HF_HUB_OFFLINE', '1')
# Seconds a row of each kind takes from start to exit where benchmarks/measured/ records none: a GPU's (True) and a
# CPU's (False). 'cached': a compiled row whose graph an earlier row compiled; 'profile_extra': the profiler's own.
ESTIMATES = {
    True: {
        'probe': 40,
        'checks': 60,
        'eager': 80,
        'compile': 240,
        'cached': 120,
        'profile_extra': 20,
        'transformer': 150,
        'test': 90,
        'predict': 10,
    },
    False: {
        'probe': 10,
        'checks': 10,
        'eager': 15,
        'compile': 15,
        'cached': 15,
        'profile_extra': 10,
        'transformer': 20,
        'test': 12,
        'predict': 5,
    },
}
# A loan: 15 device-minutes, the machine's start (about 47 s) and the files' copies in them: 13 minutes of rows.
LOAN_ROW_SECONDS = 13 * 60
# A call: at most 10 minutes, its copies in them; the second call of a loan starts at once, the machine still warm.
CALL_SECONDS = {True: 9 * 60, False: 3.5 * 60}
clock = time.perf_counter  # the rehearsal's fake clock replaces it
LENT_GPU = 'NVIDIA H200 torch 2.11.0'  # the kind lent here (benchmarks/measured/2026-11-26-h200)


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
        help='minutes: start no row whose estimate would end after them (default: 9 on a GPU, 3.5 on a CPU; '
        "within a loan's minutes left)",
    )
    parser.add_argument('--resume', action='store_true', help='keep the rows --out holds')
    parser.add_argument('--steps', nargs='+', choices=STEPS, default=list(STEPS), help='steps to run (default: all)')
    parser.add_argument(
        '--loan',
        choices=LOANS,
        default=None,
        help="a loan's steps, its calls within its 13 minutes of rows (implies --resume)",
    )
    parser.add_argument('--land', metavar='FOLDER', help="a campaign folder's rows into --measured, then stop")
    parser.add_argument(
        '--plan',
        nargs='?',
        const=LENT_GPU,
        metavar='MACHINE',
        help="print --loan's plan on a GPU the committed folders hold (default: %(const)s) and stop",
    )
    parser.add_argument('--measured', default=str(MEASURED), help='the committed folders (default: %(default)s)')
    parser.add_argument('--batches', type=int, default=None, help='batches per run (default: 10 on a GPU, 3 on CPU)')
    args = parser.parse_args(argv)
    if args.loan:
        args.steps, args.resume = list(LOANS[args.loan]), True
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
    first_step = (results.get('provenance') or {}).get('seconds_to_first_step_end')
    measured |= {'first_step_seconds': first_step} if first_step is not None else {}
    measured['results'] = results  # the whole file, provenance in it: landed as a file of its own
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


# ------------------------------------------------------------------------------------------------ the plan


def recorded_rows(measured: Path = MEASURED) -> dict[str, dict]:
    """Every machine's rows landed in the committed folders (each folder's campaign.json), the folder named in each."""
    machines: dict[str, dict] = {}
    for state_file in sorted(measured.glob('*/campaign.json')):
        landed = json.loads(state_file.read_text())
        rows = machines.setdefault(landed['machine'], {})
        for key, row in landed['rows'].items():
            rows.setdefault(key, {**row, 'landed': state_file.parent.name})
    return machines


def estimates(rows: dict, on_gpu: bool, recorded: dict[str, dict] | None = None) -> dict[str, float]:
    """Seconds a row of each kind is expected to take: the median of this machine's finished rows of that kind, else
    of the rows recorded on any GPU (on a GPU), else the default. A cache hit's: a compiled row less what its
    compile took, that row's seconds to its first step's end less an eager row's (its seconds less its batches)."""
    expected = dict(ESTIMATES[on_gpu])
    recorded_gpu = [row for machine in (recorded or {}).values() for row in machine.values()] if on_gpu else []
    for source in (recorded_gpu, list(rows.values())):
        finished = [row for row in source if 'seconds' in row and not row.get('error') and not row.get('pending')]
        for cost in expected:
            seconds = [row['seconds'] for row in finished if row.get('cost') == cost]
            if seconds:
                expected[cost] = statistics.median(seconds)
        compiled = [
            row['first_step_seconds']
            for row in finished
            if row.get('cost') == 'compile' and 'first_step_seconds' in row
        ]
        starts = [
            row['seconds'] - row['batch_seconds']
            for row in finished
            if row.get('cost') == 'eager' and 'batch_seconds' in row
        ]
        if compiled and starts:
            compiling = statistics.median(compiled) - statistics.median(starts)
            expected['cached'] = max(expected['compile'] - compiling, expected['eager'])
    return expected


def row_seconds(row: dict, expected: dict[str, float], compiled: set[str]) -> float:
    """A row's estimate, a compiled row whose graph is in `compiled` (an earlier row's) counted as a cache hit."""
    if row['kind'] == 'skipped':
        return 0.0
    if row['cost'] not in ('compile', 'profile'):  # a transformer's blocks: a compile of their own each
        return expected[row['cost']]
    if 'graph' not in row:  # an eager profile (a CPU's)
        seconds = expected['eager']
    else:
        seconds = expected['cached'] if row['graph'] in compiled else expected['compile']
    return seconds + (expected['profile_extra'] if row['cost'] == 'profile' else 0)


def to_measure(campaign: Campaign, steps: list[str], done: dict) -> list[tuple[str, dict]]:
    """The rows of these steps not yet measured (or cut once), step by step."""
    return [
        (step, row)
        for step in steps
        for row in campaign.rows(step, done)
        if done.get(row['key']) is None or done[row['key']].get('pending')
    ]


def plan_calls(
    todo: list[tuple[str, dict]], expected: dict, loan_seconds: float, call_seconds: float, compiled: set[str]
) -> tuple[list[list[tuple[dict, float]]], list[dict]]:
    """The calls a loan of `loan_seconds` of rows makes, at the estimates: each call's rows in order, a row only where
    its estimate fits the call's time left and the loan's; a row that fits neither is left for a later loan. The
    next call starts when the one before has no room for the next row. Returns the calls and the rows left."""
    calls, left, compiled = [[]], [], set(compiled)
    loan_left, call_left = loan_seconds, min(call_seconds, loan_seconds)
    for _, row in todo:
        seconds = row_seconds(row, expected, compiled)
        if row['kind'] == 'predict' and any(other['key'] == row['from'] for other in left):
            left.append(row)  # its measurement is left for a later loan too
            continue
        if seconds > loan_left:
            left.append(row)
            continue
        if seconds > call_left and calls[-1]:
            calls.append([])
            call_left = min(call_seconds, loan_left)
        if seconds > call_left:
            left.append(row)
            continue
        calls[-1].append((row, seconds))
        loan_left, call_left = loan_left - seconds, call_left - seconds
        compiled |= {row['graph']} if 'graph' in row else set()
    return [call for call in calls if call], left


def plan_lines(name: str, calls: list, left: list[dict], loan_seconds: float) -> list[str]:
    """The plan as a call prints it before its first row."""
    total = sum(seconds for call in calls for _, seconds in call)
    lines = [
        f'{name}: {sum(map(len, calls))} row(s) in {len(calls)} call(s), {total / 60:.1f} of its '
        f'{loan_seconds / 60:.1f} minutes of rows'
    ]
    for number, call in enumerate(calls, 1):
        minutes = sum(seconds for _, seconds in call) / 60
        lines.append(
            f'  call {number}, {minutes:.1f} minutes: ' + '; '.join(f'{row["key"]} {s:.0f} s' for row, s in call)
        )
    if left:
        lines.append(f'  left for a later loan: {len(left)} row(s): ' + '; '.join(row['key'] for row in left))
    return lines


def load_state(out: Path, resume: bool, measured: Path = MEASURED, machine: str | None = None) -> dict:
    """The campaign's rows: --out's (on --resume), with the rows landed in the committed folders (this machine's,
    where one is named)."""
    saved = json.loads((out / 'campaign.json').read_text()) if resume and (out / 'campaign.json').is_file() else {}
    if 'machine' in saved and 'machines' not in saved:  # an earlier layout: one machine's rows
        saved = {'machines': {saved['machine']: {'rows': saved.get('rows', {})}}}
    state = {'machines': saved.get('machines', {}), 'loans': saved.get('loans', {})}
    if resume:
        for landed, rows in recorded_rows(measured).items():
            if machine is not None and landed != machine:
                continue
            held = state['machines'].setdefault(landed, {'rows': {}})['rows']
            for key, row in rows.items():
                held.setdefault(key, row)
    return state


# ------------------------------------------------------------------------------------------------ a call


def print_plan(args: argparse.Namespace) -> list:
    """A loan's plan on a GPU whose rows the committed folders hold, at their figures, its microbatch theirs."""
    recorded = recorded_rows(Path(args.measured))
    if args.plan not in recorded:
        raise SystemExit(f'--plan: no rows of {args.plan!r} in {args.measured} (there: {", ".join(recorded)})')
    rows = recorded[args.plan]
    planned = rows['headline precomputed, fast, compiled']['microbatch']
    campaign = Campaign(args, True, Path(tempfile.gettempdir()), planned=planned)
    todo = to_measure(campaign, args.steps, rows)
    calls, left = plan_calls(todo, estimates(rows, True, recorded), LOAN_ROW_SECONDS, CALL_SECONDS[True], set())
    print('\n'.join(plan_lines(f'loan {args.loan or "of every step"} on {args.plan}', calls, left, LOAN_ROW_SECONDS)))
    return calls


def machine_name() -> str:
    probe = (
        'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() '
        "else 'cpu', 'torch', torch.__version__)"
    )
    return subprocess.run([*PYTHON, '-c', probe], capture_output=True, text=True).stdout.strip() or 'unknown'


def check_failed(row: dict, rows: dict) -> str | None:
    """Why a row's speed is not measured: its correctness check failed, or was not run on this machine yet."""
    if 'needs' not in row:
        return None
    check = (rows.get('checks') or {}).get(row['needs'])
    if check is None:
        return f'no correctness check of {row["needs"]} on this machine yet'
    if check.get('passed') is False:
        return f'{row["needs"]} failed its correctness check (error {check["error"]:.3g}, bound {check["bound"]:g})'
    return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.land:
        for folder in land(Path(args.land), Path(args.measured)):
            print(f'landed: {folder}')
        return {}
    if args.plan:
        print_plan(args)
        return {}
    started = clock()
    out, on_gpu = Path(args.out), on_a_gpu()
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / f'gpu-campaign-work-{os.getpid()}'
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    state = load_state(out, args.resume, Path(args.measured), machine)
    rows = state['machines'].setdefault(machine, {'rows': {}})['rows']
    recorded = recorded_rows(Path(args.measured))
    expected = estimates(rows, on_gpu, recorded)
    spent = state['loans'].get(args.loan, 0.0) if args.loan else 0.0
    loan_left = LOAN_ROW_SECONDS - spent if args.loan else float('inf')
    limit = min(60 * args.time_limit if args.time_limit else CALL_SECONDS[on_gpu], loan_left)
    announce_call(machine, on_gpu, limit, expected)
    if (line := use_compile_cache(out)) is not None:
        print(line, flush=True)
    campaign = Campaign(args, on_gpu, work)
    todo = to_measure(campaign, args.steps, rows)
    # Graphs an earlier call of this loan compiled are in the compile cache it brought back: cache hits.
    cache = (out / COMPILE_CACHE_FILE).is_file()
    compiled = {
        row['graph'] for row in rows.values() if cache and args.loan and row.get('loan') == args.loan and 'graph' in row
    }
    budget = loan_left if args.loan else limit
    calls, planned_left = plan_calls(todo, expected, budget, limit, compiled)
    name = f'loan {args.loan}' if args.loan else 'this call'
    print('\n'.join(plan_lines(name, calls, planned_left, budget)), flush=True)
    left = 0
    for step, row in todo:
        kept = rows.get(row['key'])
        seconds_left = limit - (clock() - started)
        estimate = row_seconds(row, expected, compiled)
        if row['kind'] != 'skipped' and estimate > seconds_left:
            left += 1
            continue
        if row['kind'] == 'predict' and row['from'] not in rows:
            left += 1  # what it predicts from is not measured yet
            continue
        if (why := check_failed(row, rows)) is not None:
            if why.startswith('no correctness check'):
                left += 1  # measured once a loan has checked it
            else:
                rows[row['key']] = {'step': step, 'cost': row['cost'], 'skipped': why}
            continue
        if row['kind'] != 'skipped':
            print(f'[{step}] {row["key"]} (about {estimate:.0f} s) ...', flush=True)
        if row['kind'] == 'predict':
            measured = predict(rows, row, work)
        else:
            measured = execute(row, seconds_left, work)
        compiled |= {row['graph']} if 'graph' in row and not measured.get('error') else set()
        rows[row['key']] = record = row_record(step, row, measured, kept, args.loan, rows.get('environment'))
        left += bool(record.get('pending'))
        state['left'] = left
        if args.loan:
            state['loans'][args.loan] = spent + clock() - started
        write_folder(out, work, state)
    state['left'] = left
    if args.loan:
        state['loans'][args.loan] = spent + clock() - started
    if on_gpu:
        mark_planned(rows, campaign.planned())
    write_folder(out, work, state)
    print(table(state))
    if (line := keep_compile_cache(out)) is not None:
        print(line, flush=True)
    return state


def announce_call(machine: str, on_gpu: bool, limit: float, expected: dict[str, float]) -> None:
    """The call's machine, minutes and estimates; on a CPU, what its rows check; a commit no row would name."""
    if not on_gpu:
        print(
            'no GPU here: the campaign runs its tiny CPU rows instead (the tiny model at 32 px, a few batches; the '
            "GPU tests recorded as skipped), which check the campaign's steps and files, not the hardware",
            flush=True,
        )
    print(
        f'{machine}: a call of {limit / 60:.1f} minutes; estimates in seconds: '
        + ', '.join(f'{cost} {seconds:.0f}' for cost, seconds in expected.items()),
        flush=True,
    )
    if os.environ.get('BENCHMARK_GIT_COMMIT') is None and git_commit() is None:
        print('no .git here and BENCHMARK_GIT_COMMIT unset: the rows name no commit', flush=True)


def row_record(step: str, row: dict, measured: dict, kept: dict | None, loan: str | None, environment) -> dict:
    """What campaign.json keeps of a row: its outcome (a row cut by the deadline is tried once more, then passed
    over), its loan and compiled graph, its provenance, and the seconds its batches took."""
    cuts = (kept or {}).get('cuts', 0) + bool(measured.get('cut'))
    if measured.get('cut') and cuts < 2:
        measured = {'pending': True, 'cuts': cuts}
    elif measured.get('cut'):
        measured = {'error': 'cut by the deadline twice: passed over', 'cuts': cuts}
    record = {'step': step, 'cost': row['cost'], **row.get('record', {}), **measured}
    record |= {'graph': row['graph']} if 'graph' in row else {}
    record |= {'loan': loan} if loan else {}
    if row['kind'] != 'skipped' and not record.get('pending'):
        record['provenance'] = provenance(row, measured, environment)
    if 'results' in measured:  # the batches' seconds: what an eager row spends past its start
        rate, config = measured['results'].get('img_per_sec') or 0, measured['results'].get('config', {})
        if rate and config.get('num_batches'):
            record['batch_seconds'] = config['num_batches'] * config['batch_size'] / rate
    return record


def mark_planned(rows: dict, planned: int) -> None:
    """Marks the sweep row at the microbatch memory_plan.py plans for this GPU."""
    if f'sweep mb{planned}' in rows:
        rows[f'sweep mb{planned}']['planned'] = True


if __name__ == '__main__':
    main()
