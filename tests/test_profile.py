"""benchmark.py --profile: a trace of the last batch, which benchmarks/profile_summary.py breaks down."""

import pytest
from conftest import TINY, settled

from benchmarks import profile_summary
from guards.arguments import ConfigError
from runs.run import main
from settings.config import resolve_config
from settings.flags import parse_args

PROFILED_RUN = [*TINY, '--image_size', '32', '--batch_size', '4']


@pytest.mark.slow
def test_profile_records_the_last_batch_and_the_summary_breaks_it_down(tmp_path, capfd):
    folder = tmp_path / 'profile'
    main(settled(PROFILED_RUN + ['--max_duration', '3ba', '--profile', str(folder)]))
    assert [path.name for path in folder.iterdir()] == ['rank0.3.pt.trace.json']  # batch 3 of 3
    captured = capfd.readouterr()
    assert f'profiler traces: {folder / "rank0.3.pt.trace.json"}' in captured.out
    assert 'gpuGetDeviceCount' not in captured.err  # Kineto's error about GPUs a CPU run never asked for

    summary = profile_summary.summarize(profile_summary.load_trace(folder / 'rank0.3.pt.trace.json'))
    assert summary['steps'] == 1 and summary['gpu_by_class'] == {}
    # One thread ran the whole CPU step: self times, each op counted without the ops it called, fit in it.
    host = sum(summary['host_by_name'].values())
    assert 0.3 * summary['step_ms'] < host <= summary['step_ms']
    assert {'aten::mkldnn_convolution', 'aten::convolution_backward'} <= summary['host_by_name'].keys()
    assert summary['host_by_class']['matmul/conv'] > 0 and summary['host_by_class']['attention'] > 0
    assert 'No GPU kernels in the trace' in profile_summary.report(summary)


def test_profile_flag_needs_a_new_folder_and_two_batches(tmp_path):
    (tmp_path / 'old.json').write_text('{}')
    with pytest.raises(ConfigError, match='is not empty; give a new folder'):
        resolve_config(parse_args(PROFILED_RUN + ['--profile', str(tmp_path)]))
    with pytest.raises(ConfigError, match='run at least 2 batches'):
        resolve_config(parse_args(PROFILED_RUN + ['--profile', str(tmp_path / 'new'), '--max_duration', '1ba']))
    # An epoch counts the data's batches: the sample dataset's 320 images are one batch of 320.
    epoch = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '320', '--max_duration', '1ep']
    with pytest.raises(ConfigError, match=r'run at least 2 batches \(--max_duration 1ep is 1\)'):
        resolve_config(parse_args([*epoch, '--profile', str(tmp_path / 'new')]))
