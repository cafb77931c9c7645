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


def test_only_tests_import_the_command_line_script():
    importers = []
    for path in [*REPO.glob('*.py'), *REPO.glob('benchmarks/*.py')]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            if 'benchmark' in names:
                importers.append(path.name)
    assert importers == []


def repo_imports(path: Path) -> tuple[set[str], set[str]]:
    """The repo's modules a file imports: at its top level, and inside functions."""
    modules = {module.stem for module in REPO.glob('*.py')}
    tree = ast.parse(path.read_text())
    top, inner = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split('.')[0] in modules:
                (top if node in tree.body else inner).add(name.split('.')[0])
    return top, inner


def test_the_modules_import_each_other_without_a_circle():
    # Each module is placed once all it imports are placed; a circle leaves its modules unplaced.
    graph = {path.stem: set.union(*repo_imports(path)) for path in REPO.glob('*.py')}
    placed: list[str] = []
    while len(placed) < len(graph):
        ready = sorted(name for name, needs in graph.items() if name not in placed and needs <= set(placed))
        assert ready, f'import circle among {sorted(set(graph) - set(placed))}'
        placed += ready
    assert placed.index('model_folder') < placed.index('model') < placed.index('evaluation') < placed.index('config')


def test_no_repo_module_is_imported_inside_a_function():
    # Such imports hide a circle. One is allowed: the command line loads the run only once the flags parse.
    inner = {path.name: repo_imports(path)[1] for path in [*REPO.glob('*.py'), *REPO.glob('benchmarks/*.py')]}
    assert {name: modules for name, modules in inner.items() if modules} == {'benchmark.py': {'run'}}


def test_help_needs_none_of_the_heavy_libraries():
    # --help and a mistyped flag answer at once: flags.py and what it imports load no torch, Composer or Diffusers.
    code = 'import sys, flags; print(sorted({"torch", "composer", "diffusers", "streaming"} & set(sys.modules)))'
    loaded = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == '[]'


@pytest.mark.skipif(not (Path(sys.prefix) / '.installed').is_file(), reason="needs the Makefile's own venv")
def test_gpu_check_refuses_a_machine_without_a_gpu():
    # Else the gpu tier would skip every test and the check would pass having checked nothing.
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    run = subprocess.run(
        ['make', '-s', 'gpu-check', f'VENV={sys.prefix}'], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode != 0 and 'gpu-check: no CUDA device' in run.stderr
    assert 'pytest' not in run.stdout + run.stderr


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
    )
    assert run.returncode == 2
    error = 'error: --image_size 7: must be a positive multiple of 8 (the VAE downsamples 8x)'
    lines = [line for line in run.stderr.splitlines() if not re.match(r'make(\[\d+\])?: ', line)]  # make's own
    assert 'launcher' in run.stderr and lines[-1] == error


def test_a_flag_error_is_kept_for_the_makefile(tmp_path):
    verdict = tmp_path / 'verdict'
    env = {**os.environ, 'BENCHMARK_VERDICT_FILE': str(verdict)}
    run = subprocess.run(
        [sys.executable, 'benchmark.py', '--batch_size', 'abc'], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.count('\n') == 1
    assert verdict.read_text() == run.stderr
