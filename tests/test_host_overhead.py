"""benchmarks/host_overhead.py: the operations one microbatch's step launches, counted on the meta device."""

import pytest

from benchmarks import host_overhead
from benchmarks.launch_counts import step_ops


def test_the_count_hardly_grows_with_the_microbatch_and_checkpointing_adds_the_recomputation():
    one, four = step_ops('tiny', 64, 1), step_ops('tiny', 64, 4)
    assert 1000 < one['eager_fp32'] <= four['eager_fp32'] < 1.05 * one['eager_fp32']  # per step, not per image
    assert one['autocast_casts'] == four['autocast_casts'] > 0
    assert four['trained_flops_per_image'] == one['trained_flops_per_image'] > 0
    checkpointed = step_ops('tiny', 64, 4, activation_checkpointing=True)
    # The blocks' forward runs again in the backward: more operations, fewer than a second whole forward and backward.
    assert four['eager_fp32'] < checkpointed['eager_fp32'] < 2 * four['eager_fp32']


def test_the_compute_bound_microbatch_is_host_time_over_gpu_time_per_image(capsys):
    (row,) = host_overhead.main(['--model_name', 'tiny', '--launch_us', '10', '--gpu', 'A100', '--efficiency', '0.5'])
    host_seconds = (row['eager_fp32'] + row['autocast_casts']) * 10e-6
    assert row['bound'] == pytest.approx(host_seconds * 312e12 * 0.5 / row['trained_flops_per_image'])
    assert f'| {host_seconds * 1e3:.0f} | {row["bound"]:.0f} |' in capsys.readouterr().out
