"""The gpu tier is honest: CUDA is hidden only from a session that leaves the gpu tests out, and a session of gpu
tests alone on a machine without CUDA fails in one line instead of passing by skipping them."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, selects_gpu_tests


@pytest.mark.parametrize(
    ('markexpr', 'selects'),
    [
        ('gpu', True),
        ('gpu and not slow', True),
        ('slow and gpu', True),
        ('', True),  # no -m: every tier
        ('not gpu', False),
        ('not slow and not gpu', False),
        ('stack and not slow and not gpu', False),
        ('slow', True),  # a gpu test may be slow too
    ],
)
def test_cuda_is_hidden_only_where_the_selection_leaves_out_the_gpu_tests(markexpr, selects):
    assert selects_gpu_tests(markexpr) is selects


def pytest_in_a_machine_without_cuda(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    command = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-q', *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_gpu_tier_without_cuda_fails_saying_why_and_still_lists_its_tests():
    run = pytest_in_a_machine_without_cuda('-m', 'gpu', 'tests/test_gpu.py')
    assert run.returncode != 0, run.stdout[-2000:]
    errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith('ERROR:')]
    assert len(errors) == 1 and errors[0].startswith('ERROR: no CUDA device: the ') and 'gpu tier' in errors[0]
    listed = pytest_in_a_machine_without_cuda('-m', 'gpu', '--collect-only', 'tests/test_gpu.py')
    assert listed.returncode == 0 and 'tests/test_gpu.py::test_' in listed.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    'selection',
    [
        ['tests/test_gpu.py', 'tests/test_tiers.py'],
        ['-m', 'gpu or not gpu', 'tests/test_gpu.py', 'tests/test_tiers.py'],
        ['-k', 'gpu'],
    ],
    ids=['paths', 'markers', 'keywords'],
)
def test_a_selection_of_gpu_and_cpu_tests_is_refused_in_one_line(selection):
    """Before: `pytest tests/test_gpu.py tests/test_tiers.py` without CUDA gave "8 passed, 41 skipped", exit 0."""
    run = pytest_in_a_machine_without_cuda(*selection)
    assert run.returncode != 0 and ' passed' not in run.stdout, run.stdout[-2000:]
    errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith('ERROR:')]
    assert len(errors) == 1 and re.match(
        r'ERROR: the selection holds \d+ test\(s\) of the gpu tier and \d+ CPU', errors[0]
    )


@pytest.mark.parametrize('device', ['gpu'])
def test_a_cpu_test_with_a_parameter_named_gpu_runs_and_sees_no_cuda(device):
    """A parametrize id `gpu` is a keyword of the test, not the gpu marker: it ran as a CPU test (before, it was
    skipped as "no CUDA device" in any session that also selected gpu tests)."""
    import torch

    assert device == 'gpu' and os.environ['CUDA_VISIBLE_DEVICES'] == '' and not torch.cuda.is_available()


@pytest.mark.slow
def test_a_skip_where_skips_are_checked_fails_unless_its_lane_names_it(tmp_path):
    """The image lane has no wandb: its wandb test skips there, as CI's lane names it; in CI any other lane, or a
    lane naming other skips, fails the skipped test instead of passing it by."""
    (tmp_path / 'wandb.py').write_text("raise ImportError('no wandb in this lane')\n")  # an install without wandb
    test = [
        'tests/test_benchmark.py::test_wandb_offline_run_holds_the_configuration_history_and_headline_without_a_network'
    ]

    def run(**env):
        environ = {key: value for key, value in os.environ.items() if key != 'SD2_EXPECTED_SKIPS'}
        environ.update(CUDA_VISIBLE_DEVICES='', PYTHONPATH=str(tmp_path), **env)
        command = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-q', '-n', '0', *test]
        return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)

    plain = run(CI='')
    assert plain.returncode == 0 and '1 skipped' in plain.stdout, plain.stdout[-2000:]
    in_ci = run(CI='true')
    assert in_ci.returncode == 1 and '1 failed' in in_ci.stdout, in_ci.stdout[-2000:]
    assert "not among this lane's SD2_EXPECTED_SKIPS: wandb is not installed" in in_ci.stdout
    other = run(SD2_EXPECTED_SKIPS='xFormers is not installed')
    assert other.returncode == 1 and '1 failed' in other.stdout
    named = run(CI='true', SD2_EXPECTED_SKIPS='xFormers is not installed; wandb is not installed')
    assert named.returncode == 0 and '1 skipped' in named.stdout, named.stdout[-2000:]
