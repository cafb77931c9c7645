"""The GPU campaign's steps and their rows (gpu_campaign.py runs them): what each step measures, as benchmark.py,
probe and gpu-test rows. Every row past the headline is the headline recipe changed in one thing, and a step stands
alone: where it needs a microbatch the sweep has not measured, it takes the memory plan's."""

import argparse
import functools
import subprocess
import sys
from pathlib import Path

from settings.presets import PRESETS, default_model

REPO = Path(__file__).resolve().parent.parent
# Each row's process runs this interpreter with the same site setting (a rehearsal runs `python -S`).
PYTHON = [sys.executable, *(['-S'] if sys.flags.no_site else [])]
# In the order of their value per GPU minute (docs/speed.md, "Loans"). A loan's first row is the correctness checks
# (a kernel or fp8 path that fails its check is not measured for speed), then the environment.
STEPS = (
    'checks',
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
# The loans that measure what is left, each within LOAN_ROW_SECONDS of rows at the recorded figures
# (tests/test_gpu_campaign.py holds each plan to it). Measured already on 2026-11-26: the headline rows on an H100
# and an H200, channels-last compiled at microbatch 64 on the H200, the eager microbatch curve (16, 32, 64).
LOANS = {
    'kernels': ('checks', 'environment', 'channels_last', 'profile', 'kernels'),
    'sweep': ('checks', 'environment', 'kernels', 'sweep', 'transformers'),
    'transformers': ('checks', 'environment', 'transformers'),
    'paths': ('environment', 'paths'),
}
# The headline recipe: the fast recipe from precomputed latents, compiled on a GPU (on a CPU, the rehearsal's tiny
# rows run eager: Inductor there would measure the CPU's compiler, not the campaign).
HEADLINE = ('--precomputed_latents',)
# Step 5: the kernels past the fast recipe (models/kernels.py), each added to the headline recipe alone.
KERNELS = {
    'cudnn_benchmark': ('--cudnn_benchmark',),  # first: the headline recipe's compiled graph, a cache hit
    'fused_groupnorm': ('--fused_groupnorm',),
    'attention cudnn': ('--attention', 'cudnn'),
}
# The correctness check (campaign_probes.py checks) a row's speed waits on: a path that fails it is not measured.
CHECKED_BY = {'--fused_groupnorm': 'fused_groupnorm', 'cudnn': 'attention_cudnn', '--fp8': 'fp8'}
# Flags that leave the compiled graph as it is: rows that differ only in them share one compile.
SAME_GRAPH_FLAGS = ('--cudnn_benchmark', '--profile')
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


def benchmark_row(key: str, cost: str, flags: tuple[str, ...], results: Path, batches: int) -> dict:
    argv = [str(REPO / 'benchmark.py'), '--use_synth_data', '--max_duration', f'{batches}ba', *flags]
    row = {'key': key, 'kind': 'benchmark', 'cost': cost, 'argv': [*argv, '--results_json', str(results)]}
    return checked(row, flags) | ({'graph': graph_of(flags)} if cost == 'compile' else {})


def probe_row(key: str, cost: str, argv: list[str]) -> dict:
    row = {'key': key, 'kind': 'probe', 'cost': cost, 'argv': ['-m', 'benchmarks.campaign_probes', *argv]}
    return checked(row, tuple(argv)) | ({'graph': graph_of(tuple(argv))} if '--compile' in argv else {})


def checked(row: dict, flags: tuple[str, ...]) -> dict:
    """The row with the correctness check its speed waits on, where one of its flags has one."""
    needs = [check for flag, check in CHECKED_BY.items() if flag in flags]
    return row | ({'needs': needs[0]} if needs else {})


def graph_of(flags: tuple[str, ...]) -> str:
    """What a compiled row's graph depends on: its flags less those that leave the graph as it is (and their
    values), less the batch count and the output files."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in SAME_GRAPH_FLAGS or flag in ('--max_duration', '--results_json'):
            skip = flag in ('--profile', '--max_duration', '--results_json')
        else:
            kept.append(flag)
    return ' '.join(kept)


def test_row(nodeid: str) -> dict:
    return {'key': f'test {nodeid.removeprefix("tests/test_gpu.py::")}', 'kind': 'test', 'cost': 'test', 'test': nodeid}


def skipped_row(key: str, why: str, cost: str) -> dict:
    """A row this machine cannot run (a GPU-only path on a CPU): recorded as skipped, taking no time."""
    return {'key': key, 'kind': 'skipped', 'cost': cost, 'skipped': why}


class Campaign:
    """The rows of each step. A step stands alone: where it needs a microbatch the sweep has not measured, it takes
    the memory plan's."""

    def __init__(self, args: argparse.Namespace, on_gpu: bool, work: Path, planned: int | None = None):
        self.args, self.on_gpu, self.work = args, on_gpu, work
        self.model = default_model(on_gpu)
        self.size = PRESETS[self.model].image_size
        self.batch = 256 if on_gpu else 16  # the headline's: 8 microbatches of an H100's planned 32
        self.compiled = ('--compile',) if on_gpu else ()
        self.batches = args.batches or (10 if on_gpu else 3)
        self._planned = planned

    @property
    def microbatches(self) -> tuple[int, ...]:
        """The sweep's microbatches. On a GPU the eager curve's shape is measured (16, 32, 64 on an H200): one
        compiled row at half the planned microbatch, beside the headline recipe's own at the planned one."""
        if self.on_gpu:
            return (self.planned() // 2,)
        return tuple(m for m in (1, 2, 4, 8) if m <= self.planned())

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
        sweep = [done.get(f'sweep mb{m}') for m in self.microbatches]
        if self.on_gpu:  # the planned microbatch's row is the headline recipe's own
            sweep.append(done.get('headline recipe (A)'))
        measured = [
            (row['img_per_sec_per_device'], row['microbatch']) for row in sweep if row and row.get('microbatch')
        ]
        if sweep and all(row and not row.get('pending') for row in sweep) and measured:
            return max(measured)[1], 'the sweep'
        return self.planned(), 'the memory plan (no sweep measured yet)'

    def rows(self, step: str, done: dict) -> list[dict]:
        if step == 'environment':
            return [probe_row('environment', 'probe', ['environment'])]
        if step == 'checks':
            return [probe_row('checks', 'checks', ['checks'])]
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
        if step == 'kernels':  # CUDA kernels: nothing to rehearse on a CPU
            if not self.on_gpu:
                return [skipped_row(f'kernel {name}', 'GPU only', 'eager') for name in KERNELS]
            return [self.headline_recipe(f'kernel {name}', flags) for name, flags in KERNELS.items()]
        if step == 'sweep':
            return [self.headline_recipe(f'sweep mb{m}', (), m) for m in self.microbatches]
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
        """Each transformer's forward and backward, compiled block by block (campaign_probes.py: each repeated
        block's code compiled once, not the whole model), in bf16 and fp8; report.py --predict from Flux's."""
        rows = []
        for name, size, microbatch in TRANSFORMERS:
            name, size = (name, size) if self.on_gpu else (f'tiny-{name}', 64)
            for fp8 in (False, True):
                key = f'{name} {size}px step' + (', compiled' if self.on_gpu else '') + (', fp8' if fp8 else '')
                argv = ['transformer_step', '--model_name', name, '--image_size', str(size)]
                argv += ['--microbatch', str(microbatch if self.on_gpu else 2)] + ['--compile'] * self.on_gpu
                rows.append(probe_row(key, 'transformer', argv + ['--fp8'] * fp8))
        flux = f'{"" if self.on_gpu else "tiny-"}flux-schnell'
        bf16 = f'{flux} {256 if self.on_gpu else 64}px step' + (', compiled' if self.on_gpu else '')
        rows.append({'key': f'{flux} predicted', 'kind': 'predict', 'cost': 'predict', 'from': bf16})
        return rows


# The transformers' steps: the model, the image size and the microbatch on a GPU.
TRANSFORMERS = (('sd3.5-medium', 512, 8), ('pixart-sigma', 512, 8), ('flux-schnell', 256, 4))


def planned_microbatch(model: str, size: int, batch: int) -> int:
    """What benchmark.py plans for the headline recipe here (memory_plan.py on a GPU; the preset's on a CPU)."""
    probe = (
        'from settings import config, flags; print(config.resolve_config(flags.parse_args(["--use_synth_data", '
        f'"--precomputed_latents", "--model_name", "{model}", "--image_size", "{size}", "--batch_size", '
        f'"{batch}"])).batch.device_train_microbatch_size)'
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
