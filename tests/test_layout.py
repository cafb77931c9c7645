"""The repo's layout holds: every top-level module is installed, only the entry point's users import it, and the
Makefile's GPU check refuses a machine without a GPU."""

import ast
import os
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
