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
from conftest import REPO, skip_unless_ci

from settings import hardware

# The folders of modules (each one's rule in its __init__.py and docs/architecture.md); the command lines and the
# design card's modules stay at the top.
FOLDERS = ['costs', 'datapath', 'guards', 'models', 'runs', 'settings']
TOP = sorted(path.stem for path in REPO.glob('*.py'))
MODULES = sorted(
    [*TOP, *(f'{folder}.{path.stem}' for folder in FOLDERS for path in (REPO / folder).glob('*.py'))]
)  # dotted names; a folder's __init__ among them as the folder's own name ('runs.__init__')


def module_path(name: str) -> Path:
    return REPO / f'{name.replace(".", "/")}.py'


def python_files() -> list[Path]:
    return [*REPO.glob('*.py'), *(path for folder in FOLDERS for path in (REPO / folder).glob('*.py'))]


def test_every_module_is_installed():
    # make install installs the repo in editable mode from these lists: a module missing from them cannot be
    # imported by the scripts under benchmarks/.
    settings = tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['setuptools']
    assert sorted(settings['py-modules']) == TOP
    assert sorted(settings['packages']) == sorted(['benchmarks', *FOLDERS])
    assert sorted(path.parent.name for path in REPO.glob('*/__init__.py')) == sorted(['benchmarks', *FOLDERS])


def test_the_top_holds_the_command_lines_and_the_design_cards_modules():
    assert TOP == ['benchmark', 'convert', 'data', 'ema', 'generate', 'mcloud', 'precompute', 'report']
    assert len(TOP) <= 12


def test_no_file_over_600_lines_and_no_function_over_80_but_flag_declarations():
    # A flag declaration (argparse's add_argument, each with its help) reads whole however long it is.
    long_files, long_functions = [], []
    for path in [*python_files(), *REPO.glob('benchmarks/*.py')]:
        text = path.read_text()
        if len(text.splitlines()) > 600:
            long_files.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                declares = sum(
                    isinstance(call, ast.Call) and getattr(call.func, 'attr', '') == 'add_argument'
                    for call in ast.walk(node)
                )
                if declares < (node.end_lineno - node.lineno) / 10:  # under one flag per 10 lines: not a declaration
                    long_functions.append(f'{path.name}:{node.name}')
    assert long_files == [] and long_functions == []


# The scripts whose work lives in a module of its own, imported once their flags check out (see below).
ENTRY_POINTS = {'benchmark': 'runs.run', 'generate': 'runs.generation', 'precompute': 'runs.precomputing'}
# What no flag check may load: seconds of imports before a mistyped flag is answered.
HEAVY = {'torch', 'composer', 'streaming', 'diffusers', 'transformers', 'torchvision'}


def repo_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The repo's modules an import names: `import a.b`, `from a.b import c`, and `from folder import module`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    if node.level or node.module is None:
        return []
    named = [f'{node.module}.{alias.name}' for alias in node.names if f'{node.module}.{alias.name}' in MODULES]
    return named or ([node.module] if node.module in MODULES else [])


def test_no_module_imports_an_entry_point():
    importers = []
    for path in [*python_files(), *REPO.glob('benchmarks/*.py')]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                importers += [(path.name, name) for name in repo_modules(node) if name in ENTRY_POINTS]
    assert importers == []


def imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    """The repo's modules a file imports at its top level and inside functions, and the libraries (top-level
    package names) it imports at its top level."""
    tree = ast.parse(path.read_text())
    top, inner, libraries = set(), set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, 'level', 0):
            continue
        at_top = node in tree.body
        own = repo_modules(node)
        (top if at_top else inner).update(own)
        if at_top and not own:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
            libraries.update(name.split('.')[0] for name in names if name.split('.')[0] not in [*TOP, *FOLDERS])
    return top, inner, libraries


def floors() -> dict[str, int]:
    """Each module's floor in the import graph: 1 for a module that imports none of the repo's, else one above the
    highest it imports (inside functions too); fails on a circle, whose modules never get one."""
    graph = {name: set.union(*imports(module_path(name))[:2]) for name in MODULES}
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
    assert floor['settings.config'] <= 4
    builders = ('models.stable_diffusion', 'runs.training', 'runs.evaluation', 'runs.export')
    assert floor['settings.config'] < min(floor[builder] for builder in builders)


def test_a_run_is_settled_from_modules_that_load_no_heavy_library():
    # settings/config.py and everything it imports, at their top level: none of torch, Composer, Streaming,
    # Diffusers; and nothing in settings/ imports those at its top level.
    settled, todo = set(), ['settings.config', 'settings.flags', *(m for m in MODULES if m.startswith('settings.'))]
    while todo:
        name = todo.pop()
        settled.add(name)
        top, _, libraries = imports(module_path(name))
        assert not libraries & HEAVY, f'{name} imports {sorted(libraries & HEAVY)} at its top level'
        todo += sorted(top - settled)
    facts = {'presets', 'families', 'durations', 'hardware', 'memory_plan', 'model_folder'}
    assert {f'settings.{name}' for name in facts} | {'settings.tokenizer'} <= settled


def rooms() -> dict[str, set[str]]:
    """The import graph with each folder as one room ('runs') beside the top's modules ('data'): which rooms each
    imports."""
    graph = {}
    for name in MODULES:
        room = name.split('.')[0]
        graph.setdefault(room, set()).update(
            other.split('.')[0] for other in set.union(*imports(module_path(name))[:2])
        )
    return {room: needs - {room} for room, needs in graph.items()}


def test_no_two_rooms_import_each_other():
    # A folder is a layer only if nothing in it imports a room that imports it back: the folders and the top's
    # modules stand on floors of their own, drawn in docs/architecture.md.
    graph, floor = rooms(), {}
    while len(floor) < len(graph):
        ready = [room for room, needs in graph.items() if room not in floor and needs <= set(floor)]
        assert ready, f'rooms in a circle: {sorted(set(graph) - set(floor))}'
        floor |= {room: 1 + max((floor[need] for need in graph[room]), default=0) for room in ready}
    assert floor['guards'] == 1 and floor['settings'] < floor['models'] < floor['runs']


def test_each_folder_imports_only_what_its_rule_allows():
    # Each folder's rule (its __init__.py, docs/architecture.md): the rooms below it it may import. runs/ may import
    # any; the top's data.py and ema.py stand between models/ and runs/.
    below = {
        'guards': set(),
        'settings': {'guards'},
        'costs': {'guards'},
        'datapath': {'settings', 'guards'},
        'models': {'datapath', 'settings', 'guards'},
    }
    graph = rooms()
    for folder, may in below.items():
        assert graph[folder] <= may, f'{folder}/ imports {sorted(graph[folder] - may)}'
    assert graph['data'] | graph['ema'] <= {'datapath', 'settings', 'guards'}


def test_repo_modules_are_imported_inside_functions_only_by_entry_points():
    # Such imports would hide a circle. An entry point's main loads its work only once its flags check out, and so
    # does a benchmark script's.
    inner = {}
    for path in [*python_files(), *REPO.glob('benchmarks/*.py')]:
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, ast.FunctionDef):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and repo_modules(node):
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


def run_listing_heavy_imports(script: str, flags: list[str], cwd) -> subprocess.CompletedProcess:
    """The script with these flags; its stderr's last line lists the heavy libraries it loaded (LOADED)."""
    code = LOADED.format(heavy=sorted(HEAVY))
    return subprocess.run(
        [sys.executable, '-c', code, str(REPO / script), *flags], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize('script', sorted(BAD_FLAGS))
def test_help_and_bad_flags_answer_before_any_heavy_library_loads(script, tmp_path):
    for flags in [['--help'], ['--no_such_flag'], *BAD_FLAGS[script]]:
        run = run_listing_heavy_imports(script, flags, tmp_path)
        expected = 0 if flags == ['--help'] else 2
        assert run.returncode == expected, (flags, run.stderr[-2000:])
        assert run.stderr.splitlines()[-1] == 'loaded: []', (flags, run.stderr[-2000:])
        if expected:
            assert run.stderr.splitlines()[-2].startswith(('error: ', f'{Path(script).name}: error: ')), run.stderr


@pytest.mark.skipif(
    any(os.path.exists(path) for path in hardware.GPU_DEVICE_FILES), reason='a GPU driver is here: torch is asked'
)
def test_a_batch_the_microbatch_does_not_divide_is_answered_without_torch_where_no_gpu_driver_is(tmp_path):
    """Without a GPU driver's device files there is no GPU to ask torch about: the flags that need the machine (the
    batch's split) are settled without loading it, and an error comes at once."""
    flags = ['--use_synth_data', '--batch_size', '6', '--device_train_microbatch_size', '4']
    run = run_listing_heavy_imports('benchmark.py', flags, tmp_path)
    assert run.returncode == 2 and 'is not divisible by --device_train_microbatch_size 4' in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == 'loaded: []', run.stderr


@pytest.fixture
def makefile_venv():
    """The tests of the Makefile's own targets run in its .venv (make test's); elsewhere skipped (failed in CI)."""
    if not (Path(sys.prefix) / '.installed').is_file():
        skip_unless_ci("needs the Makefile's own venv (.venv, as make test makes it)")


def test_gpu_check_refuses_a_machine_without_a_gpu(makefile_venv):
    # Else the gpu tier would skip every test and the check would pass having checked nothing.
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    # -o: the venv taken as installed (a checkout newer than it would reinstall this repo into it, from here).
    run = subprocess.run(
        ['make', '-s', '-o', f'{sys.prefix}/.installed', 'gpu-check', f'VENV={sys.prefix}'],
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


@pytest.mark.slow
def test_under_the_launcher_the_one_line_error_is_printed_last(makefile_venv):
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


def test_the_walk_of_a_runs_values_counts_on_these_floors():
    """benchmarks/config_walk.py (docs/architecture.md's walk): its floors are these tests' floors, and a walk's
    climbs and entries to runs/run.py are the steps up and in."""
    from benchmarks import config_walk

    walked = config_walk.floors(config_walk.repo_modules())
    floor = floors()
    assert {name: walked[name] for name in floor if not name.endswith('__init__')} == {
        name: level for name, level in floor.items() if not name.endswith('__init__')
    }
    stays = {
        ('runs/run.py', 'main'): True,
        ('runs/training.py', 'build_dataloader'): False,
        ('runs/run.py', 'train'): True,
        ('settings/config.py', 'RunConfig.as_dict'): True,
        ('runs/run.py', 'report'): True,
    }
    assert config_walk.figures(stays, walked) == {
        'stays': 5,
        'handed the whole RunConfig': 4,
        'rooms': 3,
        'climbs back up': 2,  # training.py up to run.py, config.py up to run.py
        'runs/run.py entered': 2,
    }
