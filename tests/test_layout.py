"""The repo's layout holds: every top-level module is installed, only the entry point's users import it, and the
Makefile's GPU check refuses a machine without a GPU."""

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO


def test_every_top_level_module_is_installed():
    # make install installs the repo in editable mode from this list: a module missing from it cannot be
    # imported by the scripts under benchmarks/.
    settings = tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['setuptools']
    assert sorted(settings['py-modules']) == sorted(path.stem for path in REPO.glob('*.py'))
    assert settings['packages'] == ['benchmarks']


# The scripts whose work lives in a module of its own, imported once their flags check out (see below).
ENTRY_POINTS = {'benchmark': 'run', 'generate': 'drawing', 'precompute': 'encoding'}
# What no flag check may load: seconds of imports before a mistyped flag is answered.
HEAVY = {'torch', 'composer', 'streaming', 'diffusers', 'transformers', 'torchvision'}
MODULES = sorted(path.stem for path in REPO.glob('*.py'))


def test_no_module_imports_an_entry_point():
    importers = []
    for path in [*REPO.glob('*.py'), *REPO.glob('benchmarks/*.py')]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            importers += [(path.name, name) for name in names if name in ENTRY_POINTS]
    assert importers == []


def imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    """The repo's modules a file imports at its top level and inside functions, and the libraries (top-level
    package names) it imports at its top level."""
    tree = ast.parse(path.read_text())
    top, inner, libraries = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        at_top = node in tree.body
        for name in (name.split('.')[0] for name in names):
            if name in MODULES:
                (top if at_top else inner).add(name)
            elif at_top:
                libraries.add(name)
    return top, inner, libraries


def floors() -> dict[str, int]:
    """Each module's floor in the import graph: 1 for a module that imports none of the repo's, else one above the
    highest it imports (inside functions too); fails on a circle, whose modules never get one."""
    graph = {name: set.union(*imports(REPO / f'{name}.py')[:2]) for name in MODULES}
    floor: dict[str, int] = {}
    while len(floor) < len(graph):
        ready = [name for name, needs in graph.items() if name not in floor and needs <= set(floor)]
        assert ready, f'import circle among {sorted(set(graph) - set(floor))}'
        floor |= {name: 1 + max((floor[need] for need in graph[name]), default=0) for name in ready}
    return floor


def test_the_modules_stand_on_eight_floors_without_a_circle():
    # docs/architecture.md draws these floors: what settles a run's values low, the builders above them.
    floor = floors()
    assert max(floor.values()) <= 8
    assert floor['config'] <= 4
    assert floor['config'] < min(floor[builder] for builder in ('model', 'training', 'evaluation', 'export'))


def test_a_run_is_settled_from_modules_that_load_no_heavy_library():
    # config.py and everything it imports, at their top level: none of torch, Composer, Streaming, Diffusers.
    settled, todo = set(), ['config', 'flags']
    while todo:
        name = todo.pop()
        settled.add(name)
        top, _, libraries = imports(REPO / f'{name}.py')
        assert not libraries & HEAVY, f'{name}.py imports {sorted(libraries & HEAVY)} at its top level'
        todo += sorted(top - settled)
    assert {'presets', 'recipes', 'durations', 'hardware', 'memory_plan', 'model_folder', 'tokenizer'} <= settled


def test_repo_modules_are_imported_inside_functions_only_by_entry_points():
    # Such imports would hide a circle. An entry point's main loads its work only once its flags check out, and so
    # does a benchmark script's.
    inner = {}
    for path in [*REPO.glob('*.py'), *REPO.glob('benchmarks/*.py')]:
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, ast.FunctionDef):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, 'level', 0) == 0:
                        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                        for name in names:
                            if name.split('.')[0] in MODULES:
                                inner.setdefault(f'{path.parent.name}/{path.name}', set()).add(function.name)
    scripts = {f'{REPO.name}/{name}.py' for name in ENTRY_POINTS}
    assert {name for name in inner if not name.startswith('benchmarks/')} <= scripts
    assert all(functions <= {'main', 'cli'} for functions in inner.values()), inner
    for name, work in ENTRY_POINTS.items():
        assert imports(REPO / f'{name}.py')[1] == {work}


# Each script's --help, a mistyped flag and bad values: answered (exit 0 for --help, 2 otherwise) before torch,
# Composer, Streaming, Diffusers or Transformers is imported. A value needing the machine or data is not here.
BAD_FLAGS = {
    'benchmark.py': [
        ['--batch_size', '0'],
        ['--model_name', 'nosuch'],
        ['--image_size', '30'],
        ['--max_duration', 'forever'],
        ['--device_train_microbatch_size', 'four'],
        ['--use_ema', '--ema_half_life', '10tok'],
        ['--sample_steps', '0'],
        ['--eval_interval', '-1ba'],
        ['--caption_dropout', '1.5'],
        ['--flux_guidance', '-1'],
        ['--precondition_outputs', '1'],  # Diffusers' spelling; here a switch
        ['--cpu_threads', '0'],
    ],
    'generate.py': [['--pipeline', 'nowhere', '--prompt', 'a', '--out', 'x'], ['--steps', 'x']],
    'convert.py': [['nowhere', 'out'], ['.', 'out', '--size_limit', 'big']],
    'precompute.py': [['--out', 'x', '--batch_size', '0'], ['--out', 'x', '--model_name', 'nosuch']],
    'report.py': [['--predict', '--gpus', 'x']],
    'mcloud.py': [['nosuch-command']],
    'benchmarks/speed_sweep.py': [['--sizes', 'x']],
    'benchmarks/activation_memory.py': [['--model_name', 'nosuch']],
    'benchmarks/ema_update.py': [['--repeats', 'x']],
    'benchmarks/framework_overhead.py': [['--steps', 'x']],
    'benchmarks/host_overhead.py': [['--launch_us', '0'], ['--model_name', 'nosuch']],
    'benchmarks/gpu_campaign.py': [['--time_limit', '0'], ['--steps', 'nosuch']],
    'benchmarks/learning_curve.py': [[]],
    'benchmarks/loader_throughput.py': [['--images', 'x']],
    'benchmarks/profile_summary.py': [[]],
}
LOADED = (
    'import atexit, runpy, sys; '
    "atexit.register(lambda: print('loaded:', sorted(set({heavy}) & set(sys.modules)), file=sys.stderr)); "
    'sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")'
)


@pytest.mark.parametrize('script', sorted(BAD_FLAGS))
def test_help_and_bad_flags_answer_before_any_heavy_library_loads(script, tmp_path):
    code = LOADED.format(heavy=sorted(HEAVY))
    for flags in [['--help'], ['--no_such_flag'], *BAD_FLAGS[script]]:
        run = subprocess.run(
            [sys.executable, '-c', code, str(REPO / script), *flags],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        expected = 0 if flags == ['--help'] else 2
        assert run.returncode == expected, (flags, run.stderr[-2000:])
        assert run.stderr.splitlines()[-1] == 'loaded: []', (flags, run.stderr[-2000:])
        if expected:
            assert run.stderr.splitlines()[-2].startswith(('error: ', f'{Path(script).name}: error: ')), run.stderr


@pytest.mark.skipif(not (Path(sys.prefix) / '.installed').is_file(), reason="needs the Makefile's own venv")
def test_gpu_check_refuses_a_machine_without_a_gpu():
    # Else the gpu tier would skip every test and the check would pass having checked nothing.
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    run = subprocess.run(
        ['make', '-s', 'gpu-check', f'VENV={sys.prefix}'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and 'gpu-check: no CUDA device' in run.stderr
    assert 'pytest' not in run.stdout + run.stderr


def test_gpu_wheels_are_the_gpu_images_list_for_python_3_12_on_linux():
    # What a lent machine's Python 3.12 installs with --no-deps from the carried folder: binary wheels only, none of
    # their dependencies, manylinux x86_64.
    run = subprocess.run(['make', '-n', 'gpu-wheels'], cwd=REPO, capture_output=True, text=True, timeout=300)
    commands = run.stdout.replace('\\\n', ' ')  # continuation lines joined
    download = next(line for line in commands.splitlines() if ' pip download ' in line)
    for part in ('--no-deps', '--only-binary=:all:', '--python-version 3.12', '--implementation cp', '-d .whl'):
        assert part in download, part
    assert '--platform manylinux2014_x86_64' in download and download.endswith('-r requirements-gpu-image.txt')
    assert 'over 64 MiB' in run.stdout  # the size checked against what a call carries


def test_the_benchmark_runs_without_a_launcher_on_one_device():
    """make bench (and the lanes' runs) start `python benchmark.py` where there are fewer than two GPUs: Composer's
    launcher would add its own lines around a one-line error, and wait 30 s after a good run."""
    probe = 'probe:; @$(call RUN_BENCHMARK,$(VENV),--help)'
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    run = subprocess.run(
        ['make', '-s', '--eval', probe, 'probe', f'VENV={sys.prefix}'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith('usage: benchmark.py ')


@pytest.mark.skipif(not (Path(sys.prefix) / '.installed').is_file(), reason="needs the Makefile's own venv")
def test_under_the_launcher_the_one_line_error_is_printed_last():
    """Where make bench uses Composer's launcher (several GPUs; USE_LAUNCHER=1 here), the launcher prints its own
    lines after the run's error: the error is printed again once it is done."""
    probe = 'probe:; @$(call RUN_BENCHMARK,$(VENV),--image_size 7)'
    run = subprocess.run(
        ['make', '-s', '--eval', probe, 'probe', f'VENV={sys.prefix}', 'USE_LAUNCHER=1'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    error = 'error: --image_size 7: must be a positive multiple of 8 (the VAE downsamples 8x)'
    lines = [line for line in run.stderr.splitlines() if not re.match(r'make(\[\d+\])?: ', line)]  # make's own
    assert 'launcher' in run.stderr and lines[-1] == error


def test_a_flag_error_is_kept_for_the_makefile(tmp_path):
    verdict = tmp_path / 'verdict'
    env = {**os.environ, 'BENCHMARK_VERDICT_FILE': str(verdict)}
    run = subprocess.run(
        [sys.executable, 'benchmark.py', '--batch_size', 'abc'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and run.stderr.count('\n') == 1
    assert verdict.read_text() == run.stderr


@pytest.mark.parametrize(
    'script, flags, named',
    [
        ('generate.py', ['--foo'], '--foo'),  # not the missing --out
        ('benchmark.py', ['--model_nam', 'tiny'], '--model_nam'),  # no abbreviation of --model_name
        ('precompute.py', ['--out', 'x', '--model', 'tiny'], '--model'),
        ('benchmarks/speed_sweep.py', ['--size', '512'], '--size'),
    ],
)
def test_an_unknown_or_abbreviated_flag_is_named(script, flags, named, tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / script), *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2
    assert f'unrecognized arguments: {named}' in run.stderr.splitlines()[-1]
