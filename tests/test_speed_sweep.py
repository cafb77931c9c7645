"""benchmarks/speed_sweep.py: every speed path in a process of its own, resumable, set against the MFU goal."""

import time

import pytest

from benchmarks import speed_sweep


@pytest.mark.slow
def test_speed_sweep_runs_each_path_skips_what_cannot_run_and_combines(tmp_path, forked_rows):
    forked_rows(speed_sweep)
    sweep = [
        '--model_name',
        'tiny',
        '--sizes',
        '32',
        '--modes',
        'precomputed',
        '--microbatch',
        '2',
        '--accumulation',
        '2',
        '--batches',
        '4',
        '--out',
        str(tmp_path),
        '--profile',
        '--paths',
        'fused_adamw',
        'low_precision_norm',
        'encoders_bf16',
    ]
    # Cut short: after the baseline (seconds) no row fits in 0.6 s, and nothing is combined from a part.
    rows = speed_sweep.main([*sweep, '--time_limit', '0.01'])
    assert [row['name'] for row in rows if 'results' in row] == ['baseline']
    assert {row['name']: row.get('not_run') for row in rows if 'not_run' in row} == {
        'fused_adamw': 'time limit reached (--resume goes on from here)',
        'combined': 'not every path was measured',
    }
    table = (tmp_path / 'speed_sweep.md').read_text()
    assert '| fused_adamw | `--fused_adamw` | 2 | not run: time limit reached' in table
    baseline_log = (tmp_path / '32px-precomputed-baseline-mb2.log').read_text()
    # --resume takes the baseline up as it was and runs the rest.
    rows = speed_sweep.main([*sweep, '--resume'])
    assert (tmp_path / '32px-precomputed-baseline-mb2.log').read_text() == baseline_log
    by_name = {row['name']: row for row in rows}
    assert by_name['baseline'].get('resumed') and not any(row.get('resumed') for row in rows[1:])
    assert not any('not_run' in row for row in rows)
    # A row measured on another GPU or torch is never taken up (out of time here, so it is not run either).
    args = speed_sweep.parse_args([*sweep, '--resume', '--time_limit', '1'])
    args.started = time.perf_counter() - 120  # two minutes ago: no row fits in the minute
    again = lambda: speed_sweep.run_row(args, 32, 'precomputed', 'baseline', (), 2)  # noqa: E731
    assert again()['resumed']
    saved = tmp_path / '32px-precomputed-baseline-mb2.row.json'
    saved.write_text(saved.read_text().replace(speed_sweep.this_machine(), 'NVIDIA H100 80GB HBM3, torch 2.7.0'))
    assert 'resumed' not in again() and 'time limit' in again()['not_run']
    assert list(by_name)[:4] == ['baseline', 'fused_adamw', 'low_precision_norm', 'encoders_bf16']
    assert by_name['low_precision_norm']['skipped'] == 'needs a GPU'
    assert by_name['encoders_bf16']['skipped'] == 'no encoders in a precomputed run'
    for name in ('baseline', 'fused_adamw'):
        results = by_name[name]['results']  # each row's own benchmark.py run, with the row's flags
        assert results['img_per_sec_per_device'] > 0 and results['config']['precomputed_latents']
        assert results['config']['fused_adamw'] == (name == 'fused_adamw')
        assert (results['image_size'], results['config']['batch_size']) == (32, 4)
    combined = [row for row in rows if row['name'].startswith('combined:')]
    assert combined and combined[-1]['microbatch'] == 4 and 'results' in combined[-1]
    table = (tmp_path / 'speed_sweep.md').read_text()
    assert '| 32 | precomputed | low_precision_norm | `--low_precision_norm` | 2 | skipped: needs a GPU |' in table
    assert len([line for line in table.splitlines() if line.startswith('| 32 |')]) == len(rows)
    # --profile: the fastest row again, profiled, and where its time went.
    fastest = max((row for row in rows if 'results' in row), key=lambda row: row['results']['img_per_sec_per_device'])
    line = next(line for line in table.splitlines() if line.startswith('- 32px precomputed, fastest row'))
    assert f'fastest row {fastest["name"]} (microbatch {fastest["microbatch"]}): no GPU; host operator time: ' in line
    assert 'matmul/conv' in line
    assert 'Host operator self time by class' in (tmp_path / 'profile-32px-precomputed' / 'summary.md').read_text()


def test_speed_sweep_names_why_a_row_failed():
    assert (
        speed_sweep.failure_reason('step 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate')
        == 'out of memory'
    )
    assert (
        speed_sweep.failure_reason('config: {}\nerror: --attention xformers: not installed\n')
        == 'error: --attention xformers: not installed'
    )
    assert speed_sweep.failure_reason('') == 'exited with no output'


def test_speed_sweep_compares_the_fastest_512px_rows_with_the_goal():

    def row(mode, name, rate, mfu, size=512, model='sd2-base'):
        return {
            'size': size,
            'mode': mode,
            'name': name,
            'microbatch': 8,
            'results': {
                'img_per_sec_per_device': rate,
                'mfu': mfu,
                'flops_per_sec': rate * 2.41e12,
                'num_devices': 1,
                'model_name': model,
                'device_name': 'NVIDIA H100 80GB HBM3',
            },
        }

    rows = [
        row('online', 'baseline', 40.0, 0.145),
        row('online', 'compile', 90.0, 0.326),
        row('online', 'huge', 500.0, 0.9, size=256),
        {'size': 512, 'mode': 'online', 'name': 'x', 'error': 'oom'},
        row('precomputed', 'baseline', 170.0, None),
        row('precomputed', 'tiny', 1e4, 0.5, model='tiny'),
    ]
    online, precomputed = speed_sweep.against_goal(rows, peak_tflops=None)
    assert online.startswith(
        '- 512px online: fastest row compile (microbatch 8), 90.00 img/s per GPU on NVIDIA H100 '
        '80GB HBM3, MFU 32.6% against the goal of 35%: missed. Anchors: the published benchmark'
    )
    assert 'fastest row baseline' in precomputed and 'MFU unknown (pass --peak_tflops)' in precomputed
    # With the peak given, MFU comes from the FLOP rate: 170 x 2.41 TFLOP/s of 989 is 41.4%, over the 40% goal.
    assert 'MFU 41.4% against the goal of 40%: met' in speed_sweep.against_goal(rows, peak_tflops=989)[1]
    assert speed_sweep.against_goal([row('online', 'baseline', 40.0, 0.145, size=256)], None) == []


def test_default_sizes_follow_the_model():
    assert speed_sweep.parse_args(['--model_name', 'sd2-base']).sizes == [512, 256]  # the published size first
    assert speed_sweep.parse_args(['--model_name', 'sdxl-base']).sizes == [1024]
    assert speed_sweep.parse_args(['--model_name', 'tiny-sdxl-base']).sizes == [64]
    assert speed_sweep.parse_args(['--model_name', 'tiny-sd2-768-v', '--sizes', '32']).sizes == [32]
    assert speed_sweep.parse_args(['--model_name', 'flux-schnell']).sizes == [256]  # MLPerf's flux1 size
    assert speed_sweep.parse_args(['--model_name', 'pixart-sigma']).sizes == [512]


@pytest.mark.slow
def test_a_diffusion_transformer_is_swept_with_the_paths_it_takes(tmp_path, forked_rows):
    forked_rows(speed_sweep)
    sweep = ['--model_name', 'tiny-flux-schnell', '--sizes', '32', '--modes', 'online', '--microbatch', '2']
    sweep += ['--accumulation', '2', '--batches', '4', '--out', str(tmp_path), '--paths', 'xformers', 'encoders_bf16']
    by_name = {row['name']: row for row in speed_sweep.main(sweep)}
    assert by_name['xformers']['skipped'] == 'needs a GPU'  # on a GPU: SDPA only, as the last line checks
    for name in ('baseline', 'encoders_bf16'):
        results = by_name[name]['results']
        assert results['model_name'] == 'tiny-flux-schnell' and results['img_per_sec_per_device'] > 0
        assert results['config']['encoders_bf16'] == (name == 'encoders_bf16')
    assert speed_sweep.skip_reason(speed_sweep.SPEED_PATHS['xformers'], 'online', True, transformer=True) == (
        'the diffusion transformers run PyTorch SDPA attention only'
    )
