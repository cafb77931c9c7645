"""The route a lent GPU machine takes, rehearsed on a CPU: benchmarks/gpu_slice.sh in a tree of the files that
travel, with an interpreter that has the packages but not this repo installed, two calls, the second given the
first's folder back; and the campaign's bookkeeping (a test's outcome, a row cut by the deadline)."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

from benchmarks import compile_cache, gpu_campaign
from benchmarks.campaign_rows import KERNELS


def files_that_travel(tree):
    """The files a lent machine receives: tracked, and untracked but not ignored (as the device tool sends)."""
    listed = subprocess.run(
        ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
        cwd=REPO,
        capture_output=True,
        timeout=600,
    )
    for name in filter(None, listed.stdout.decode().split('\0')):
        source = REPO / name
        if source.is_file():
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)


def returned_files(out):
    files = [path.relative_to(out) for path in out.rglob('*') if path.is_file()]
    assert 0 < len(files) <= 8, files
    assert all(len(path.parts) <= 3 for path in files), files  # at most two folders down
    return files


def campaign_rows(out) -> dict:
    machines = json.loads((out / 'gpu-campaign' / 'campaign.json').read_text())['machines']
    assert len(machines) == 1
    return next(iter(machines.values()))['rows']


@pytest.mark.slow
def test_a_lent_machines_two_calls_rehearsed_on_a_cpu(tmp_path):
    """Two calls as a loan makes them, the second given the first's folder back with a row left as the deadline
    leaves one it cut (the cut itself: test_a_row_cut_by_the_deadline_is_tried_again_once_then_passed_over): the
    second keeps every finished row, runs none of them again, tries the cut one again and goes on with its own
    steps. Each call is given room for all its rows (30 minutes, a hang guard), so what runs does not depend on
    this machine's load."""
    tree = tmp_path / 'tree'
    files_that_travel(tree)
    # python3 there: this interpreter without its site folder (so without the editable install of this repo), the
    # packages on PYTHONPATH, as a GPU image's Python with requirements-gpu-image.txt's wheels in a target folder.
    bin_folder = tmp_path / 'bin'
    bin_folder.mkdir()
    (bin_folder / 'python3').write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (bin_folder / 'python3').chmod(0o755)
    env = {'PATH': f'{bin_folder}:/usr/bin:/bin', 'PYTHONPATH': sysconfig.get_paths()['purelib'], 'HOME': str(tmp_path)}
    unreachable = subprocess.run(
        ['python3', '-c', 'import costs.results'], cwd=tmp_path, env=env, capture_output=True, timeout=600
    )
    assert unreachable.returncode != 0, 'the repo is importable without the slice putting it on the path'

    def call(out, steps):
        slice_env = {**env, 'OUT': str(out), 'GPU_SLICE_MINUTES': '30', 'GPU_SLICE_STEPS': steps}
        run = subprocess.run(
            ['bash', 'benchmarks/gpu_slice.sh'], cwd=tree, env=slice_env, capture_output=True, text=True, timeout=1800
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return run.stdout

    first = call(tmp_path / 'out1', 'environment headline')
    assert first.startswith('gpu_slice: no wheels in .whl/: using the packages')
    assert 'gpu_slice: no GPU here' in first
    assert 'a call of 30.0 minutes; estimates in seconds: probe 10, checks 10, eager 15, compile 15' in first
    # The plan before the first row: this call's rows and their minutes.
    assert re.search(r'\nthis call: 6 row\(s\) in 1 call\(s\), [\d.]+ of its 30.0 minutes of rows\n  call 1', first)
    assert first.index('this call: ') < first.index('\n[environment] environment')
    assert sorted(map(str, returned_files(tmp_path / 'out1'))) == [
        'gpu-campaign/campaign.json',
        'gpu-campaign/campaign.md',
        'gpu-campaign/logs.tar.gz',
    ]
    rows = campaign_rows(tmp_path / 'out1')
    eager = ['headline precomputed, fast', 'headline online, fast', 'headline precomputed, published mb4']
    compiled = ['headline precomputed, fast, compiled', 'headline online, fast, compiled']
    assert list(rows) == ['environment', *eager, *compiled]
    assert rows['environment']['matmul_tflops'] > 0 and rows['environment']['copy_gb_s'] > 0
    assert all(rows[key]['img_per_sec_per_device'] > 0 for key in eager), rows
    assert all(rows[key] == {'step': 'headline', 'cost': 'compile', 'skipped': 'GPU only'} for key in compiled)
    assert first.rstrip().endswith('Every step measured.')

    # The folder given back as results/gpu-campaign, one row in it as the deadline leaves a row it cut.
    (tree / 'results').mkdir()
    (tmp_path / 'out1' / 'gpu-campaign').rename(tree / 'results' / 'gpu-campaign')
    state_file = tree / 'results' / 'gpu-campaign' / 'campaign.json'
    state = json.loads(state_file.read_text())
    (held,) = state['machines'].values()
    cut = 'headline online, fast'
    held['rows'][cut] = {'step': 'headline', 'cost': 'eager', 'pending': True, 'cuts': 1}
    state_file.write_text(json.dumps(state))
    second = call(tmp_path / 'out2', 'environment headline kernels')
    assert 'gpu_slice: resuming from results/gpu-campaign' in second
    returned_files(tmp_path / 'out2')
    again = campaign_rows(tmp_path / 'out2')
    finished = {key: row for key, row in rows.items() if key != cut}
    assert {key: again[key] for key in finished} == finished
    ran = [line for line in second.splitlines() if line.startswith('[')]
    again_ran = [line for line in ran if line.startswith(('[environment]', '[headline]'))]
    assert len(again_ran) == 1 and again_ran[0].startswith(f'[headline] {cut} (about '), ran
    assert again[cut]['img_per_sec_per_device'] > 0 and 'pending' not in again[cut] and 'cuts' not in again[cut]
    # Its own step after the resumed ones: CUDA kernels, which a CPU records as not run.
    kernels = {key: row for key, row in again.items() if key.startswith('kernel ')}
    not_run = {'step': 'kernels', 'cost': 'eager', 'skipped': 'GPU only'}
    assert kernels == {f'kernel {name}': not_run for name in KERNELS}


@pytest.mark.slow
@pytest.mark.parametrize('step', ['transformers', 'profile', 'paths'])
def test_a_step_stands_alone_on_an_empty_campaign(tmp_path, step, forked_rows):
    """A loan may begin at any step: rows that need the sweep's fastest microbatch take the memory plan's."""
    forked_rows(gpu_campaign)
    state = gpu_campaign.main(['--out', str(tmp_path / 'out'), '--work', str(tmp_path / 'work'), '--steps', step])
    (rows,) = [machine['rows'] for machine in state['machines'].values()]
    # Every row of the step measured, or passed over with its reason (a GPU-only row, a CPU's prediction): none an
    # error, none left pending.
    measured = {
        key for key, row in rows.items() if (row.get('img_per_sec_per_device') or row.get('img_per_sec') or 0) > 0
    }
    skipped = {key for key, row in rows.items() if row.get('skipped')}
    assert measured and measured | skipped == set(rows) and not measured & skipped, rows
    assert all(rows[key]['status'] == 0 and 'error' not in rows[key] for key in measured), rows
    assert all(row['step'] == step and 'pending' not in row for row in rows.values()), rows
    if step == 'paths':
        assert all(rows[key]['microbatch_from'].startswith('the memory plan') for key in measured)
    if step == 'transformers':
        assert {rows[key]['model_name'] for key in measured} == {
            'tiny-flux-schnell',
            'tiny-sd3.5-medium',
            'tiny-pixart-sigma',
        }
    if step == 'profile':
        assert (tmp_path / 'out' / 'profile-of-the-headline-recipe.md').is_file()


def test_a_probe_reads_its_json_from_stdout_and_a_probe_without_one_is_an_error_row(tmp_path):
    # On an H100 a library warned on stderr after the probe's JSON line: that warning must not end the campaign.
    warned = 'import json, sys; print(json.dumps({"matmul_tflops": 700.0})); print("UserWarning: x", file=sys.stderr)'
    probe = {'key': 'environment', 'kind': 'probe', 'cost': 'probe', 'argv': ['-c', warned]}
    measured = gpu_campaign.execute(probe, 60, tmp_path)
    assert measured['matmul_tflops'] == 700.0 and measured['status'] == 0
    assert 'UserWarning: x' in (tmp_path / 'environment.log').read_text()
    silent = {**probe, 'argv': ['-c', 'print("no json here")']}
    assert gpu_campaign.execute(silent, 60, tmp_path)['error'] == 'the probe printed no JSON line: no json here'


@pytest.mark.slow
def test_a_row_cut_by_the_deadline_is_tried_again_once_then_passed_over(tmp_path, monkeypatch, capsys):
    sleeper = {'key': 'sleeper', 'kind': 'probe', 'cost': 'probe', 'argv': ['-c', 'import time; time.sleep(30)']}
    assert gpu_campaign.execute(sleeper, 0.5, tmp_path)['cut']
    assert (tmp_path / 'sleeper.log').read_text().endswith('cut by the deadline after 0 s')
    # The bookkeeping, without waiting: every run of the row is cut.
    monkeypatch.setattr(gpu_campaign, 'execute', lambda row, seconds_left, work: {'cut': True, 'seconds': 1.0})
    monkeypatch.setattr(gpu_campaign.Campaign, 'rows', lambda self, step, done: [sleeper])
    monkeypatch.setattr(gpu_campaign, 'on_a_gpu', lambda: False)
    argv = ['--out', str(tmp_path / 'out'), '--work', str(tmp_path / 'work'), '--resume', '--steps', 'sweep']
    first = gpu_campaign.main(argv)
    (row,) = [held['rows']['sleeper'] for held in first['machines'].values()]
    assert row == {'step': 'sweep', 'cost': 'probe', 'pending': True, 'cuts': 1} and first['left'] == 1
    assert 'cut by the deadline 1 time(s): tried again next call' in (tmp_path / 'out' / 'campaign.md').read_text()
    # A CPU says so at the start and in the table's heading.
    assert capsys.readouterr().out.startswith('no GPU here: the campaign runs its tiny CPU rows instead')
    assert (tmp_path / 'out' / 'campaign.md').read_text().startswith('# GPU campaign, rehearsed on a CPU: tiny rows')
    with_a_gpu = {'machines': {'NVIDIA H100 80GB HBM3 torch 2.11.0': {'rows': {}}, **first['machines']}}
    assert gpu_campaign.table(with_a_gpu).startswith('# GPU campaign\n')
    second = gpu_campaign.main(argv)
    (row,) = [held['rows']['sleeper'] for held in second['machines'].values()]
    assert row['error'] == 'cut by the deadline twice: passed over' and not row.get('pending')
    third = gpu_campaign.main(argv)  # passed over: not run a third time
    assert third['machines'] == second['machines'] and not third.get('left')
    ending = 'Every step run; 1 row(s) ended in an error (see their notes).\n'  # not "measured": the row was not
    assert (tmp_path / 'out' / 'campaign.md').read_text().endswith(ending)


@pytest.mark.parametrize(
    'case, expected',
    [
        ('<testcase name="t"/>', {'outcome': 'passed'}),
        (
            '<testcase name="t"><skipped message="no CUDA device"/></testcase>',
            {'outcome': 'skipped', 'skipped': 'no CUDA device'},
        ),
        (
            '<testcase name="t"><failure message="assert 1 == 2"/></testcase>',
            {'outcome': 'failed', 'error': 'assert 1 == 2'},
        ),
        ('', {'outcome': 'not run', 'error': 'ERROR: not found: tests/test_gpu.py::gone'}),
    ],
    ids=['passed', 'skipped', 'failed', 'not collected'],
)
def test_a_gpu_tests_row_is_its_pytest_outcome(tmp_path, case, expected):
    report = tmp_path / 'report.xml'
    report.write_text(f'<testsuites><testsuite name="pytest">{case}</testsuite></testsuites>')
    assert gpu_campaign.test_outcome(report, 'ERROR: not found: tests/test_gpu.py::gone\n') == expected


def test_a_campaign_folder_of_the_earlier_layout_is_kept_as_its_machines_rows(tmp_path):
    (tmp_path / 'campaign.json').write_text(
        json.dumps({'machine': 'NVIDIA H100 80GB HBM3 torch 2.11.0', 'rows': {'a': {}}})
    )
    nothing_landed = tmp_path / 'measured'
    assert gpu_campaign.load_state(tmp_path, resume=True, measured=nothing_landed) == {
        'machines': {'NVIDIA H100 80GB HBM3 torch 2.11.0': {'rows': {'a': {}}}},
        'loans': {},
    }
    assert gpu_campaign.load_state(tmp_path, resume=False) == {'machines': {}, 'loans': {}}


def test_resuming_keeps_the_rows_landed_in_the_committed_folders_beside_the_folders_own():
    """A loan resumes from benchmarks/measured/: a row landed there is measured; --out's own row of that key wins."""
    landed = gpu_campaign.load_state(REPO / 'nowhere', resume=True)
    h100 = landed['machines']['NVIDIA H100 80GB HBM3 torch 2.11.0']['rows']
    assert h100['headline online, fast, compiled']['landed'] == '2026-11-26-h100'
    assert h100['headline online, fast, compiled']['seconds'] == 216
    assert 'headline recipe (A)' in h100  # the compiled precomputed row: the A/B's A on the H100
    assert 'headline recipe with channels_last (B)' in landed['machines']['NVIDIA H200 torch 2.11.0']['rows']


@pytest.mark.slow
def test_a_slice_runs_only_the_steps_it_is_given(tmp_path):
    """GPU_SLICE_STEPS: a loan whose headline an earlier one measured begins past it."""
    env = {**os.environ, 'OUT': str(tmp_path), 'GPU_SLICE_WHEELS': str(tmp_path / 'none'), 'GPU_SLICE_MINUTES': '1'}
    env['GPU_SLICE_STEPS'] = 'environment'
    env['GPU_SLICE_RESUME'] = str(tmp_path / 'nothing-to-resume')  # not the repo's results/gpu-campaign, if any
    env['PYTHONPATH'] = ''  # the slice puts the repo on the path itself
    env['PATH'] = f'{Path(sys.executable).parent}:{env["PATH"]}'  # its python3: this one, which has the packages
    sliced = subprocess.run(
        ['bash', 'benchmarks/gpu_slice.sh'], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert sliced.returncode == 0, sliced.stdout[-3000:] + sliced.stderr[-3000:]
    assert list(campaign_rows(tmp_path)) == ['environment']


def test_the_compile_cache_goes_back_with_the_folder_and_is_unpacked_by_the_next_call(tmp_path, monkeypatch):
    """Inductor's and Triton's caches, packed into --out at a call's end and unpacked before the next call's rows,
    which the environment points at them; a cache too large to carry is not kept, and says so."""
    cache, out = tmp_path / 'cache', tmp_path / 'out'
    (cache / 'inductor' / 'fxgraph').mkdir(parents=True)
    (cache / 'inductor' / 'fxgraph' / 'entry').write_bytes(b'compiled graph')
    (cache / 'triton' / 'kernel.cubin').parent.mkdir(parents=True)
    (cache / 'triton' / 'kernel.cubin').write_bytes(b'kernel')
    out.mkdir()
    assert compile_cache.keep_compile_cache(out, cache).startswith('compile cache: 2 files kept in ')
    fresh = tmp_path / 'next-call-cache'
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
    monkeypatch.delenv('TRITON_CACHE_DIR', raising=False)
    assert (
        compile_cache.use_compile_cache(out, fresh)
        == f'compile cache: {out}/compile-cache.tar.gz unpacked into {fresh}'
    )
    assert (fresh / 'inductor' / 'fxgraph' / 'entry').read_bytes() == b'compiled graph'
    assert (fresh / 'triton' / 'kernel.cubin').read_bytes() == b'kernel'
    assert os.environ['TORCHINDUCTOR_CACHE_DIR'] == str(fresh / 'inductor')
    assert os.environ['TRITON_CACHE_DIR'] == str(fresh / 'triton')
    assert compile_cache.use_compile_cache(out, fresh) is None  # already there: not unpacked over it
    monkeypatch.setattr(compile_cache, 'COMPILE_CACHE_LIMIT', 10)
    (out / 'compile-cache.tar.gz').unlink()
    assert 'over 0 MiB: not kept' in compile_cache.keep_compile_cache(out, cache)
    assert not list(out.iterdir())


def test_the_headline_script_refuses_a_machine_without_a_gpu(tmp_path):
    """SD2 base at 512px and batch 256 would run for hours on a CPU, measuring nothing the script is for."""
    env = {**os.environ, 'OUT': str(tmp_path), 'HEADLINE_WHEELS': str(tmp_path / 'none'), 'CUDA_VISIBLE_DEVICES': ''}
    env['PATH'] = f'{Path(sys.executable).parent}:{env["PATH"]}'  # its python3: this one, which has torch
    run = subprocess.run(
        ['bash', 'benchmarks/gpu_headline.sh'], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2 and run.stderr.startswith('gpu_headline: no CUDA GPU here')
    assert not list(tmp_path.iterdir())  # no row started
