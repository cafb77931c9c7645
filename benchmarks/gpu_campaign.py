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
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from costs.results import Results

os.environ.setdefault('HF_HUB_OFFLINE', '1')
REPO = Path(__file__).resolve().parent.parent
# Each row's process runs this interpreter with the same site setting (a rehearsal runs `python -S`).
PYTHON = [sys.executable, *(['-S'] if sys.flags.no_site else [])]
# In the order of their value per GPU minute (docs/speed.md, "Loans"): the first loan's rows, then the second's.
STEPS = (
    'environment',
    'headline',
    'channels_last',
    'profile',
    'kernels',
    'transformers',
    'sweep',
    'paths',
    'tests_first',
    'tests_rest',
    'late',
)
# The headline recipe: the fast recipe from precomputed latents, compiled on a GPU (on a CPU, the rehearsal's tiny
# rows run eager: Inductor there would measure the CPU's compiler, not the campaign).
HEADLINE = ('--precomputed_latents',)
# Step 5: the kernels past the fast recipe (models/kernels.py), each added to the headline recipe alone.
KERNELS = {
    'fused_groupnorm': ('--fused_groupnorm',),
    'attention cudnn': ('--attention', 'cudnn'),
    'cudnn_benchmark': ('--cudnn_benchmark',),
}
# Step 8: the headline recipe changed in one thing: one of its paths taken out, or another put in.
PATHS = {
    'without fused_adamw': ('--no-fused_adamw',),
    'without low_precision_norm': ('--no-low_precision_norm',),
    'fp16 for bf16': ('--precision', 'amp_fp16'),
    'reduce-overhead for default': ('--compile', 'reduce-overhead'),
    'with activation_checkpointing': ('--activation_checkpointing',),
}
LATE_PATHS = {'max-autotune-no-cudagraphs for default': ('--compile', 'max-autotune-no-cudagraphs')}
GPU_ONLY = {
    'without low_precision_norm',
    'fp16 for bf16',
    *(name for name in {**PATHS, **LATE_PATHS} if 'for default' in name),
}
# The gpu tier's tests run first, at most 8: the defaults, bf16 training, compiled steps, FP8 and SD2 at full size.
FIRST_TESTS = (
    'tests/test_gpu.py::test_gpu_defaults_are_the_fast_recipe_and_the_published_run_on_request',
    'tests/test_gpu.py::test_tiny_model_trains_on_the_gpu_in_bf16',
    'tests/test_gpu.py::test_compiled_steps_compile_the_forward_once',
    'tests/test_gpu.py::test_compile_modes_train_the_bf16_step[reduce-overhead]',
    'tests/test_gpu.py::test_fp8_trains_a_transformer_twin',
    'tests/test_gpu.py::test_the_planned_microbatch_fits_the_gpu',
    'tests/test_gpu.py::test_sd2_base_trains_the_published_microbatch_at_512px_within_an_a100_40gb',
    'tests/test_gpu.py::test_speed_flags_keep_the_fp32_step[--compile]',
)
# Seconds a row of each kind takes from start to exit, before this machine has measured one (an H100's and this
# CPU's: SD2 base eager 50-75 s, compiled 185-210 s of which 140-155 compiling, on an H200 on 2026-11-26).
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


# ------------------------------------------------------------------------------------------------ rows


def benchmark_row(key: str, cost: str, flags: tuple[str, ...], results: Path, batches: int) -> dict:
    argv = [str(REPO / 'benchmark.py'), '--use_synth_data', '--max_duration', f'{batches}ba', *flags]
    return {'key': key, 'kind': 'benchmark', 'cost': cost, 'argv': [*argv, '--results_json', str(results)]}


def probe_row(key: str, cost: str, argv: list[str]) -> dict:
    return {'key': key, 'kind': 'probe', 'cost': cost, 'argv': ['-m', 'benchmarks.campaign_probes', *argv]}


def test_row(nodeid: str) -> dict:
    return {'key': f'test {nodeid.removeprefix("tests/test_gpu.py::")}', 'kind': 'test', 'cost': 'test', 'test': nodeid}


def skipped_row(key: str, why: str, cost: str) -> dict:
    """A row this machine cannot run (a GPU-only path on a CPU): recorded as skipped, taking no time."""
    return {'key': key, 'kind': 'skipped', 'cost': cost, 'skipped': why}


class Campaign:
    """The rows of each step. A step stands alone: where it needs a microbatch the sweep has not measured, it takes
    the memory plan's."""

    def __init__(self, args: argparse.Namespace, on_gpu: bool, work: Path):
        self.args, self.on_gpu, self.work = args, on_gpu, work
        self.model, self.size = ('sd2-base', 512) if on_gpu else ('tiny', 64)
        self.microbatches = (4, 8, 16, 32, 64) if on_gpu else (1, 2, 4, 8)
        self.batch = 256 if on_gpu else 16  # the headline's: 8 microbatches of an H100's planned 32
        self.compiled = ('--compile',) if on_gpu else ()
        self.batches = args.batches or (10 if on_gpu else 3)
        self._planned = None

    def run(self, name: str, flags: tuple[str, ...], microbatch: int | None, batch: int, cost='eager') -> dict:
        """A benchmark.py row of this machine's SD2 (or its tiny twin); microbatch None: the run plans its own."""
        if cost == 'compile' and not self.on_gpu:
            return skipped_row(name, 'GPU only', cost)
        given = () if microbatch is None else ('--device_train_microbatch_size', str(microbatch))
        sized = ('--model_name', self.model, '--image_size', str(self.size), '--batch_size', str(batch), *given)
        return benchmark_row(name, cost, (*sized, *flags), self.work / f'{slug(name)}.json', self.batches)

    def headline_recipe(self, name: str, extra=(), microbatch: int | None = None, batch: int | None = None) -> dict:
        """The headline recipe changed by `extra` (another --compile mode in it replaces the default)."""
        compiled = () if '--compile' in extra else self.compiled
        flags = (*HEADLINE, *compiled, *extra)
        cost = 'compile' if self.on_gpu else 'eager'
        return benchmark_row(
            name,
            cost,
            ('--model_name', self.model, '--image_size', str(self.size), '--batch_size', str(batch or self.batch))
            + (() if microbatch is None else ('--device_train_microbatch_size', str(microbatch)))
            + flags,
            self.work / f'{slug(name)}.json',
            self.batches,
        )

    def planned(self) -> int:
        """The microbatch memory_plan.py plans for the headline recipe on this machine (asked once)."""
        if self._planned is None:
            self._planned = planned_microbatch(self.model, self.size, self.batch)
        return self._planned

    def fastest(self, done: dict) -> tuple[int, str]:
        """The sweep's fastest microbatch, or the memory plan's where the sweep has not measured every row."""
        sweep = [done.get(f'sweep mb{m}') for m in self.microbatches if m <= self.planned()]
        measured = [
            (row['img_per_sec_per_device'], row['microbatch']) for row in sweep if row and row.get('microbatch')
        ]
        if sweep and all(row and not row.get('pending') for row in sweep) and measured:
            return max(measured)[1], 'the sweep'
        return self.planned(), 'the memory plan (no sweep measured yet)'

    def rows(self, step: str, done: dict) -> list[dict]:
        if step == 'environment':
            return [probe_row('environment', 'probe', ['environment'])]
        if step == 'headline':
            return self.headline_rows()
        if step == 'tests_first':
            return [test_row(nodeid) for nodeid in FIRST_TESTS]
        if step == 'tests_rest':
            return [test_row(nodeid) for nodeid in gpu_tests() if nodeid not in FIRST_TESTS]
        if step == 'channels_last':
            return [
                self.headline_recipe('headline recipe (A)'),
                self.headline_recipe('headline recipe with channels_last (B)', ('--channels_last',)),
            ]
        if step == 'profile':
            trace = self.work / 'trace'
            row = self.headline_recipe('profile of the headline recipe', ('--profile', str(trace)))
            return [{**row, 'kind': 'profile', 'cost': 'profile', 'trace': str(trace)}]
        if step == 'kernels':
            return [self.headline_recipe(f'kernel {name}', flags) for name, flags in KERNELS.items()]
        if step == 'sweep':
            return [self.headline_recipe(f'sweep mb{m}', (), m) for m in self.microbatches if m <= self.planned()]
        if step in ('paths', 'late'):
            microbatch, source = self.fastest(done)
            rows = []
            for name, flags in (PATHS if step == 'paths' else LATE_PATHS).items():
                if name in GPU_ONLY and not self.on_gpu:
                    rows.append(skipped_row(f'path {name}', 'GPU only', 'eager'))
                    continue
                # CUDA graphs replay one microbatch a step: reduce-overhead trains the microbatch as the whole batch.
                batch = microbatch if 'reduce-overhead' in flags else self.batch
                row = self.headline_recipe(f'path {name}', flags, microbatch, batch)
                rows.append({**row, 'record': {'microbatch_from': source}})
            return rows
        return self.transformer_rows()

    def headline_rows(self) -> list[dict]:
        published = ('--recipe', 'published', '--precomputed_latents')
        return [
            self.run('headline precomputed, fast', ('--precomputed_latents',), None, self.batch),
            self.run('headline online, fast', (), None, self.batch),
            self.run('headline precomputed, published mb4', published, 4 if self.on_gpu else 1, self.batch // 4),
            self.run(
                'headline precomputed, fast, compiled',
                ('--precomputed_latents', '--compile'),
                None,
                self.batch,
                'compile',
            ),
            self.run('headline online, fast, compiled', ('--compile',), None, self.batch, 'compile'),
        ]

    def transformer_rows(self) -> list[dict]:
        rows = []
        for name in ('sd3.5-medium', 'pixart-sigma') if self.on_gpu else ('tiny-sd3.5-medium', 'tiny-pixart-sigma'):
            # A few planned microbatches a step, not the presets' global batch of 1,024 on one GPU.
            flags = (
                '--model_name',
                name,
                '--precomputed_latents',
                *self.compiled,
                '--batch_size',
                '64' if self.on_gpu else '4',
            )
            for fp8 in (False, True):
                key = f'{name} preset' + (', compiled' if self.on_gpu else '') + (', fp8' if fp8 else '')
                if fp8 and not self.on_gpu:
                    rows.append(skipped_row(key, 'GPU only (float8 needs an H100 or newer)', 'transformer'))
                    continue
                results = self.work / f'{slug(key)}.json'
                rows.append(
                    benchmark_row(key, 'transformer', (*flags, *(('--fp8',) if fp8 else ())), results, self.batches)
                )
        flux = 'flux-schnell' if self.on_gpu else 'tiny-flux-schnell'
        size = '256' if self.on_gpu else '64'
        for fp8 in (False, True):
            key = f'{flux} {size}px step, compiled' + (', fp8' if fp8 else '')
            if not self.on_gpu:
                rows.append(skipped_row(key, 'GPU only (Inductor; float8 needs an H100 or newer)', 'transformer'))
                continue
            argv = ['transformer_step', '--model_name', flux, '--image_size', size, '--microbatch', '4', '--compile']
            rows.append(probe_row(key, 'transformer', argv + ['--fp8'] * fp8))
        bf16 = f'{flux} {size}px step, compiled'
        rows.append({'key': f'{flux} predicted', 'kind': 'predict', 'cost': 'predict', 'from': bf16})
        return rows


def planned_microbatch(model: str, size: int, batch: int) -> int:
    """What benchmark.py plans for the headline recipe here (memory_plan.py on a GPU; the preset's on a CPU)."""
    probe = (
        'from settings import config, flags; print(config.resolve_config(flags.parse_args(["--use_synth_data", '
        f'"--precomputed_latents", "--model_name", "{model}", "--image_size", "{size}", "--batch_size", '
        f'"{batch}"])).device_train_microbatch_size)'
    )
    planned = subprocess.run([*PYTHON, '-c', probe], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return int(planned) if planned.isdigit() else 4


@functools.cache
def gpu_tests() -> list[str]:
    """The gpu tier's test ids, as pytest collects them with -m gpu."""
    listed = subprocess.run(
        [*PYTHON, '-m', 'pytest', '-m', 'gpu', '--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/test_gpu.py'],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return [line for line in listed.stdout.splitlines() if line.startswith('tests/') and '::' in line]


def slug(name: str) -> str:
    return ''.join(c if c.isalnum() else '-' for c in name)


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


# Inductor's and Triton's caches, kept across the rows of a call (every row's process reads them) and across calls:
# packed into --out at the end of a call, which the next call carries back, and unpacked before its first row. A
# compiled SD2 row spent 135-153 s of its 183-216 s compiling on an H100 (2026-11-26); a cache hit skips most of it.
COMPILE_CACHE = Path(tempfile.gettempdir()) / 'gpu-campaign-compile-cache'
COMPILE_CACHE_FILE = 'compile-cache.tar.gz'
COMPILE_CACHE_LIMIT = 24 << 20  # bytes packed: what a call's carry holds beside the wheels (64 MiB in all)


def use_compile_cache(out: Path, cache: Path = COMPILE_CACHE) -> str | None:
    """Points the rows' Inductor and Triton at `cache`, first unpacking the one --out holds; the line saying so."""
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', str(cache / 'inductor'))
    os.environ.setdefault('TRITON_CACHE_DIR', str(cache / 'triton'))
    packed = out / COMPILE_CACHE_FILE
    if not packed.is_file() or (cache.is_dir() and any(cache.iterdir())):
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(packed) as archive:
        archive.extractall(cache, filter='data')
    return f'compile cache: {packed} unpacked into {cache}'


def keep_compile_cache(out: Path, cache: Path = COMPILE_CACHE) -> str | None:
    """Packs `cache` into --out for the next call, where it fits COMPILE_CACHE_LIMIT; the line saying what was done."""
    files = [path for path in cache.rglob('*') if path.is_file()] if cache.is_dir() else []
    if not files:
        return None
    packed = out / COMPILE_CACHE_FILE
    partial = packed.with_name(packed.name + '.partial')
    with tarfile.open(partial, 'w:gz') as archive:
        for path in files:
            archive.add(path, arcname=str(path.relative_to(cache)))
    size = partial.stat().st_size
    if size > COMPILE_CACHE_LIMIT:
        partial.unlink()
        return f'compile cache: {size / 2**20:.0f} MiB packed, over {COMPILE_CACHE_LIMIT >> 20} MiB: not kept'
    partial.replace(packed)
    return f'compile cache: {len(files)} files kept in {packed} ({size / 2**20:.1f} MiB): carry it back'


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
