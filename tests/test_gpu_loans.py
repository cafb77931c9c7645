"""The GPU campaign's loans at the figures recorded in benchmarks/measured/: each documented loan's plan within its
13 minutes of rows, and two loans of 15 minutes rehearsed on a fake clock (each row takes its estimate, from the
recorded seconds): the plan printed before the first row, the files a lent machine returns within its limits,
what was measured landed in a dated folder with its provenance, the second loan resumed from that folder."""

import argparse
import json
import shutil
import statistics
from functools import partial
from pathlib import Path

import pytest
from conftest import REPO

from benchmarks import compile_cache, gpu_campaign
from benchmarks.campaign_rows import LOANS, Campaign

H200, H100 = 'NVIDIA H200 torch 2.11.0', 'NVIDIA H100 80GB HBM3 torch 2.11.0'
PLANNED = {H200: 64, H100: 32}  # the memory plan's microbatch on each (docs/speed.md)
RETURNED_FILES, RETURNED_BYTES = 8, 16 << 20  # what a lent machine gives back: 8 files, 16 MiB each


def gpu_campaign_of(machine: str, work: Path) -> Campaign:
    return Campaign(argparse.Namespace(batches=None), True, work, planned=PLANNED[machine])


def simulated_loans(machine: str, tmp_path) -> list[tuple[str, list, list]]:
    """Every documented loan in order from the committed folders, each row measured at its estimate."""
    recorded = gpu_campaign.recorded_rows()
    done = {key: dict(row) for key, row in recorded[machine].items()}
    campaign = gpu_campaign_of(machine, tmp_path)
    planned = []
    for name, steps in LOANS.items():
        expected = gpu_campaign.estimates(done, True, recorded)
        todo = gpu_campaign.to_measure(campaign, list(steps), done)
        calls, left = gpu_campaign.plan_calls(
            todo, expected, gpu_campaign.LOAN_ROW_SECONDS, gpu_campaign.CALL_SECONDS[True], set()
        )
        planned.append((name, calls, left))
        for call in calls:
            for row, seconds in call:
                done[row['key']] = {'cost': row['cost'], 'seconds': seconds}
    return planned


@pytest.mark.parametrize('machine', [H200, H100], ids=['h200', 'h100'])
def test_every_documented_loans_plan_fits_13_minutes_at_the_recorded_figures(machine, tmp_path):
    loans = simulated_loans(machine, tmp_path)
    assert [name for name, *_ in loans] == list(LOANS)
    for name, calls, _ in loans:
        seconds = [sum(s for _, s in call) for call in calls]
        assert calls and sum(seconds) <= 13 * 60, (name, seconds)
        assert all(call <= gpu_campaign.CALL_SECONDS[True] for call in seconds), (name, seconds)
    if machine == H200:  # the kind lent here: its first three loans measure every row of their steps
        leftover = {row['key'] for name, _, left in loans[:3] for row in left}
        later = {row['key'] for row in loans[2][2]}
        assert not later, later
        assert leftover <= {row['key'] for _, calls, _ in loans[1:3] for call in calls for row, _ in call}


def test_the_estimates_are_the_recorded_rows_medians_and_a_cache_hit_skips_the_compile():
    recorded = gpu_campaign.recorded_rows()
    rows = [row for machine in recorded.values() for row in machine.values() if 'seconds' in row]
    expected = gpu_campaign.estimates({}, True, recorded)
    assert expected['compile'] == statistics.median(row['seconds'] for row in rows if row['cost'] == 'compile')
    assert expected['eager'] == statistics.median(row['seconds'] for row in rows if row['cost'] == 'eager')
    assert expected['eager'] <= expected['cached'] < expected['compile'] - 100  # a compile: 2 minutes of a row
    campaign = gpu_campaign_of(H200, Path('/nonexistent'))
    headline = campaign.rows('channels_last', {})[0]
    profile = campaign.rows('profile', {})[0]
    kernels = {row['key']: row for row in campaign.rows('kernels', {})}
    # The profiler and cuDNN's autotuning leave the headline recipe's graph as it is; the fused kernel does not.
    assert profile['graph'] == kernels['kernel cudnn_benchmark']['graph'] == headline['graph']
    assert kernels['kernel fused_groupnorm']['graph'] != headline['graph']
    compiled = {headline['graph']}
    assert gpu_campaign.row_seconds(kernels['kernel cudnn_benchmark'], expected, compiled) == expected['cached']
    assert gpu_campaign.row_seconds(kernels['kernel fused_groupnorm'], expected, compiled) == expected['compile']
    assert gpu_campaign.row_seconds(profile, expected, set()) == expected['compile'] + expected['profile_extra']


class FakeGpu:
    """An H200 on a fake clock: each row takes its estimate and writes a recorded results file as its own; the
    compile cache grows by a cubin and an intermediate form per compiled row."""

    def __init__(self, monkeypatch, cache: Path):
        self.now, self.ran, self.cache, self.checks = 0.0, [], cache, {}
        results = json.loads((REPO / 'benchmarks/measured/2026-11-26-h200/precomputed-fast-compiled.json').read_text())
        self.results = results | {'provenance': {'gpu': {'driver_version': '580.159.04', 'cuda': '13.0'}}}
        monkeypatch.setattr(gpu_campaign, 'clock', lambda: self.now)
        monkeypatch.setattr(gpu_campaign, 'execute', self.execute)
        monkeypatch.setattr(gpu_campaign, 'on_a_gpu', lambda: True)
        monkeypatch.setattr(gpu_campaign, 'machine_name', lambda: H200)
        monkeypatch.setattr(Campaign, 'planned', lambda self: PLANNED[H200])
        monkeypatch.setattr(gpu_campaign, 'use_compile_cache', partial(compile_cache.use_compile_cache, cache=cache))
        monkeypatch.setattr(gpu_campaign, 'keep_compile_cache', partial(compile_cache.keep_compile_cache, cache=cache))
        monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
        monkeypatch.delenv('TRITON_CACHE_DIR', raising=False)
        self.expected, self.compiled = None, set()

    def execute(self, row, seconds_left, work):
        seconds = gpu_campaign.row_seconds(row, self.expected, self.compiled)
        assert seconds <= seconds_left, f'{row["key"]} started with {seconds_left:.0f} s left, estimated {seconds:.0f}'
        self.now += seconds
        self.ran.append(row['key'])
        if 'graph' in row and row['graph'] not in self.compiled:
            self.compiled.add(row['graph'])
            kernel = self.cache / 'triton' / f'k{len(self.compiled)}'
            kernel.mkdir(parents=True)
            (kernel / 'kernel.cubin').write_bytes(bytes(1 << 20))
            (kernel / 'kernel.ptx').write_bytes(bytes(4 << 20))  # not reloaded: not packed
        if row['key'] == 'checks':
            return {'seconds': seconds, 'status': 0, 'driver': '580.159.04', 'cuda': '13.0', **self.checks}
        if row['kind'] == 'probe':  # the checks' and the environment's stack
            return {'seconds': seconds, 'status': 0, 'device': 'NVIDIA H200', 'driver': '580.159.04', 'cuda': '13.0'}
        return {'seconds': seconds, 'status': 0, 'img_per_sec_per_device': 100.0, 'results': self.results}


def returned(out: Path) -> list[Path]:
    """What a lent machine gives back of $OUT, checked against its limits."""
    files = [path for path in out.rglob('*') if path.is_file()]
    assert 0 < len(files) <= RETURNED_FILES, files
    assert all(len(path.relative_to(out).parts) <= 3 for path in files), files  # at most two folders down
    assert all(path.stat().st_size <= RETURNED_BYTES for path in files)
    return files


def test_two_loans_of_15_minutes_rehearsed_on_a_fake_clock(tmp_path, monkeypatch, capsys):
    measured = tmp_path / 'measured'
    shutil.copytree(REPO / 'benchmarks' / 'measured', measured)
    fake = FakeGpu(monkeypatch, tmp_path / 'cache')
    fake.checks = {
        'fused_groupnorm': {'passed': True, 'error': 3e-3, 'bound': 1e-2},
        'attention_cudnn': {'passed': True, 'error': 4e-3, 'bound': 1e-2},
        'fp8': {'passed': True, 'error': 1e-3, 'bound': 5e-2},
    }
    monkeypatch.setenv('BENCHMARK_GIT_COMMIT', 'c0ffee')
    out = tmp_path / 'out' / 'gpu-campaign'

    def call(loan, folder):
        fake.expected = gpu_campaign.estimates({}, True, gpu_campaign.recorded_rows(measured))
        argv = ['--loan', loan, '--out', str(folder), '--work', str(tmp_path / 'work'), '--measured', str(measured)]
        started = fake.now
        gpu_campaign.main(argv)
        return fake.now - started, capsys.readouterr().out

    # Loan 1, two calls: the second given the first's folder back (its compile cache too).
    first_seconds, first = call('kernels', out)
    plan = first[first.index('loan kernels:') : first.index('\n[')]
    assert 'call 1' in plan and 'call 2' in plan and 'left for a later loan: 1 row(s): kernel attention cudnn' in plan
    assert first_seconds <= gpu_campaign.CALL_SECONDS[True]
    returned(out.parent)
    packed = out / compile_cache.COMPILE_CACHE_FILE
    assert 0 < packed.stat().st_size <= compile_cache.COMPILE_CACHE_LIMIT <= 15 << 20
    shutil.rmtree(tmp_path / 'cache')  # a fresh machine's: the next call unpacks the folder's
    second_seconds, second = call('kernels', out)
    assert f'compile cache: {packed} unpacked' in second
    assert first_seconds + second_seconds <= gpu_campaign.LOAN_ROW_SECONDS
    assert fake.ran == [
        'checks',
        'environment',
        'headline recipe (A)',
        'profile of the headline recipe',
        'kernel cudnn_benchmark',
        'kernel fused_groupnorm',
    ]
    returned(out.parent)
    state = json.loads((out / 'campaign.json').read_text())
    assert state['loans']['kernels'] == first_seconds + second_seconds

    # Landed here, committed: a folder of the date and the GPU, each row with its provenance and results file.
    (folder,) = gpu_campaign.land(out, measured)
    landed = json.loads((folder / 'campaign.json').read_text())
    assert folder.name.endswith('-h200') and landed['machine'] == H200
    assert list(landed['rows']) == fake.ran
    for key, row in landed['rows'].items():
        given = row['provenance']
        assert given['git_commit'] == 'c0ffee' and given['driver'] == '580.159.04' and given['cuda'] == '13.0', key
        assert given['date'].startswith(folder.name[:10]) and given['command'].startswith('python3 ')
    headline = landed['rows']['headline recipe (A)']
    assert 'results' not in headline and json.loads((folder / headline['file']).read_text())['provenance']
    assert gpu_campaign.land(out, measured) == []  # landed once

    # Loan 2 on a fresh machine, nothing carried: it resumes from the committed folders alone.
    fake.ran.clear()
    third_seconds, third = call('sweep', tmp_path / 'out2' / 'gpu-campaign')
    assert third_seconds <= gpu_campaign.CALL_SECONDS[True]
    assert fake.ran[:2] == ['kernel attention cudnn', 'sweep mb32'] and 'environment' not in fake.ran
    fourth_seconds, _ = call('sweep', tmp_path / 'out2' / 'gpu-campaign')
    assert third_seconds + fourth_seconds <= gpu_campaign.LOAN_ROW_SECONDS
    assert fake.ran == [
        'kernel attention cudnn',
        'sweep mb32',
        'sd3.5-medium 512px step, compiled',
        'sd3.5-medium 512px step, compiled, fp8',
    ]
    returned(tmp_path / 'out2')


def test_a_kernel_that_fails_its_check_is_not_measured_for_speed(tmp_path, monkeypatch, capsys):
    fake = FakeGpu(monkeypatch, tmp_path / 'cache')
    fake.checks = {
        'fused_groupnorm': {'passed': False, 'error': 0.3, 'bound': 1e-2},
        'attention_cudnn': {'passed': True, 'error': 4e-3, 'bound': 1e-2},
        'fp8': {'skipped': 'float8 matmuls need compute capability 8.9'},
    }
    fake.expected = gpu_campaign.estimates({}, True, {})
    argv = ['--out', str(tmp_path / 'out'), '--work', str(tmp_path / 'work'), '--measured', str(tmp_path / 'none')]
    state = gpu_campaign.main([*argv, '--steps', 'checks', 'kernels', '--time_limit', '60'])
    rows = state['machines'][H200]['rows']
    assert 'kernel fused_groupnorm' not in fake.ran and 'kernel attention cudnn' in fake.ran
    assert rows['kernel fused_groupnorm']['skipped'] == (
        'fused_groupnorm failed its correctness check (error 0.3, bound 0.01)'
    )
    table = (tmp_path / 'out' / 'campaign.md').read_text()
    assert 'fused_groupnorm FAILED (0.3 over 0.01); attention_cudnn passed (0.004 within 0.01); fp8 skipped: ' in table
    # Without a check on this machine, a checked path waits for one rather than being measured unchecked.
    fake.ran.clear()
    state = gpu_campaign.main([*argv, '--out', str(tmp_path / 'out2'), '--steps', 'transformers'])
    rows = state['machines'][H200]['rows']
    assert not any('fp8' in key for key in fake.ran) and fake.ran
    assert not any('fp8' in key for key in rows) and state['left'] >= 3


def test_only_what_reloads_is_packed_and_a_triton_group_names_only_what_was_packed(tmp_path):
    cache, out = tmp_path / 'cache', tmp_path / 'out'
    kernel = cache / 'triton' / 'abc'
    kernel.mkdir(parents=True)
    for name in ('k.cubin', 'k.json', 'k.ptx', 'k.ttir', 'k.source'):
        (kernel / name).write_bytes(b'x' * 100)
    children = {name: str(kernel / name) for name in ('k.cubin', 'k.json', 'k.ptx', 'k.ttir', 'k.source')}
    (kernel / '__grp__k.json').write_text(json.dumps({'child_paths': children}))
    for folder in ('fxgraph', 'aotautograd', 'ab'):  # 'ab': Inductor's generated module, written again on load
        (cache / 'inductor' / folder).mkdir(parents=True)
        (cache / 'inductor' / folder / 'entry').write_bytes(b'graph')
    out.mkdir()
    assert compile_cache.keep_compile_cache(out, cache).startswith('compile cache: 5 files kept')
    unpacked = tmp_path / 'unpacked'
    compile_cache.use_compile_cache(out, unpacked)
    files = sorted(str(path.relative_to(unpacked)) for path in unpacked.rglob('*') if path.is_file())
    assert files == [
        'inductor/aotautograd/entry',
        'inductor/fxgraph/entry',
        'triton/abc/__grp__k.json',
        'triton/abc/k.cubin',
        'triton/abc/k.json',
    ]
    group = json.loads((unpacked / 'triton/abc/__grp__k.json').read_text())
    assert sorted(group['child_paths']) == ['k.cubin', 'k.json']


def test_the_next_loans_plan_is_printed_here_at_the_recorded_figures(capsys):
    """make gpu-loan: the plan of a loan from the committed folders as they stand, without a GPU."""
    gpu_campaign.main(['--plan', '--loan', 'kernels'])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f'loan kernels on {H200}: 6 row(s) in 2 call(s), ')
    minutes = float(printed[0].split(', ')[-1].split(' of its ')[0])
    assert minutes <= 13 and printed[0].endswith('of its 13.0 minutes of rows')
    assert (
        printed[1].startswith('  call 1, ')
        and printed[-1] == '  left for a later loan: 1 row(s): kernel attention cudnn'
    )
    with pytest.raises(SystemExit, match='no rows of .A100'):
        gpu_campaign.main(['--plan', 'A100', '--loan', 'kernels'])
