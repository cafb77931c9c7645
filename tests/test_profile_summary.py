"""benchmarks/profile_summary.py on a made-up GPU trace with known overlaps, and on files that are not traces."""

import gzip
import json

import pytest

from benchmarks import profile_summary


def kernel(name, start, stop, cat='kernel'):
    return {'ph': 'X', 'cat': cat, 'name': name, 'pid': 1, 'tid': 7, 'ts': start, 'dur': stop - start}


def test_summary_counts_overlapping_gpu_work_once_and_host_self_time(tmp_path):
    events = [
        {'ph': 'X', 'cat': 'user_annotation', 'name': 'ProfilerStep#5', 'pid': 0, 'tid': 0, 'ts': 0, 'dur': 1000},
        kernel('sm90_xmma_gemm_bf16bf16_bf16f32', 100, 400),
        kernel('flash_fwd_kernel', 300, 500),  # overlaps the gemm on another stream
        kernel('vectorized_elementwise_kernel', 800, 900),
        kernel('Memcpy HtoD (Pinned -> Device)', 950, 1000, cat='gpu_memcpy'),
        kernel('sm90_xmma_gemm_bf16bf16_bf16f32', 1200, 1300),  # after the step: not counted
        {'ph': 'X', 'cat': 'cpu_op', 'name': 'aten::linear', 'pid': 0, 'tid': 0, 'ts': 0, 'dur': 300},
        {'ph': 'X', 'cat': 'cpu_op', 'name': 'aten::addmm', 'pid': 0, 'tid': 0, 'ts': 10, 'dur': 200},
        {'ph': 'X', 'cat': 'cpu_op', 'name': 'aten::group_norm', 'pid': 0, 'tid': 0, 'ts': 400, 'dur': 50},
    ]
    trace = tmp_path / 'rank0.5.pt.trace.json.gz'
    with gzip.open(trace, 'wt') as file:
        json.dump({'traceEvents': events}, file)

    summary = profile_summary.summarize(profile_summary.load_trace(trace))
    assert summary['step_ms'] == pytest.approx(1.0)
    assert summary['gpu_busy_ms'] == pytest.approx(0.55)  # 100..500, 800..900, 950..1000
    assert summary['gpu_by_class'] == pytest.approx(
        {'matmul/conv': 0.3, 'attention': 0.2, 'data movement': 0.05, profile_summary.OTHER: 0.1}
    )
    assert summary['gpu_calls']['sm90_xmma_gemm_bf16bf16_bf16f32'] == 1
    assert summary['host_by_name'] == pytest.approx({'aten::linear': 0.1, 'aten::addmm': 0.2, 'aten::group_norm': 0.05})
    assert summary['host_by_class'] == pytest.approx({'matmul/conv': 0.3, 'normalization': 0.05})
    assert 'GPU busy 0.55 ms, 55.0% of the step; idle 45.0%' in profile_summary.report(summary)


def test_summary_names_a_file_that_is_not_a_trace(tmp_path, capsys):
    assert profile_summary.main([str(tmp_path / 'missing.json')]) == 2
    assert 'missing.json: no such file' in capsys.readouterr().err
    (tmp_path / 'results.json').write_text('{"img_per_sec": 1}')
    with pytest.raises(SystemExit, match='no traceEvents'):
        profile_summary.load_trace(tmp_path / 'results.json')
