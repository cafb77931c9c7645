"""Tests for costs/step_model.py, the step model of report.py --predict: its pieces against hand-computed cases,
its prediction of the published A100 table from the published 8-GPU row alone, and the prediction from measured
runs (costs/calibration.py, its text costs/prediction_text.py) without report.py."""

import math
from dataclasses import dataclass, replace

import pytest

from costs import calibration, prediction_text, step_model

SD2_UNET = 865_910_724
SMALLER = step_model.SMALLER_MICROBATCHES
# The published run: global batch 2048, microbatch 4, the UNet's training FLOPs 2.41 of 3.58 TFLOP per image.
PUBLISHED = step_model.Workload(2048, 4, SD2_UNET, backward_share=2 / 3 * 2.41 / 3.58, trained_share=2.41 / 3.58)
A100 = step_model.Assumptions(step_model.CLUSTERS['A100'])
# Published Table 1: 8 to 128 A100s measured, 256 extrapolated.
PUBLISHED_IMG_PER_SEC = {16: 254.0, 32: 485.7, 64: 912.2, 128: 1618.4, 256: 2589.4}

# A round cluster for hand computation: 4 GPUs per node, 100 GB/s NVLink, 10 GB/s network, 1000 GB/s memory,
# nothing lost to the node count (its own test below).
ROUND = step_model.Assumptions(step_model.Cluster('round', 4, 100, 10, 1000), link_efficiency=1.0, scale_loss=0.0)
# 1e9 parameters: 4 GB of fp32 gradients; 10 bytes each of fixed work.
WORK = step_model.Workload(64, 2, 10**9, backward_share=0.5, trained_share=0.75, fixed_bytes_per_parameter=10)


def test_one_node_has_no_network_term():
    step = step_model.step(WORK, ROUND, 4, image_seconds=0.1)
    assert step.nodes == 1
    assert step.communication == pytest.approx(2 * 3 / 4 * 4e9 / 100e9)  # 0.06 s over NVLink
    slow_network = replace(ROUND, cluster=replace(ROUND.cluster, network_gb_s=0.001))
    assert step_model.step(WORK, slow_network, 4, 0.1) == step


def test_ring_traffic_over_the_network_across_nodes():
    step = step_model.step(WORK, ROUND, 8, image_seconds=0.1)
    assert step.nodes == 2
    assert step.compute == pytest.approx(8 * 0.1)  # 64 / 8 images
    assert step.communication == pytest.approx(2 * 7 / 8 * 4e9 / 10e9)  # 0.7 s
    # The last microbatch's backward (2 images x 0.1 s x 0.5) hides 0.1 s of it.
    assert step.exposed == pytest.approx(0.7 - 0.1)
    assert step.fixed == pytest.approx(10**9 * 10 / 1000e9)  # 0.01 s, on every GPU
    assert step.seconds == pytest.approx(0.8 + 0.6 + 0.01)
    assert step.img_per_sec == pytest.approx(64 / 1.41)
    rail = step_model.step(WORK, replace(ROUND, rail_aligned=True), 8, 0.1)  # 4 cards carry one GPU's share
    assert rail.communication == pytest.approx(0.7 / 4)


def test_gradients_reduced_in_bf16_move_half_the_bytes():
    bf16 = step_model.step(replace(WORK, gradient_value_bytes=2), ROUND, 8, image_seconds=0.1)
    assert bf16.communication == pytest.approx(2 * 7 / 8 * 2e9 / 10e9)  # 0.35 s, half of fp32's 0.7 s
    assert bf16.exposed == pytest.approx(0.35 - 0.1)
    # A throughput given by hand takes the bytes it is told; a results file's run reduced fp32 gradients.
    settings = replace(SETTINGS, gradient_value_bytes=2)
    models, _ = calibration.prediction_models([Run(8, 128.2)], [512], [64], A100, settings, 'A100')
    assert models[512].workload.gradient_bytes == 2 * SD2_UNET


def test_the_presets_model_what_nccl_does_on_their_nodes():
    h100 = step_model.Assumptions(step_model.CLUSTERS['H100'])
    # Inside a node: NVLink SHARP's measured 480 GB/s bus bandwidth, not the ring's 450 x 0.85.
    assert step_model.bus_bandwidth(h100, 8) == pytest.approx(480e9)
    assert step_model.bus_bandwidth(replace(h100, link_efficiency=0.7), 8) == pytest.approx(480e9 * 0.7 / 0.85)
    # Across rail-optimized nodes the 8 NICs pace the ring together: 8 x 50 GB/s x 0.85 = 340 GB/s.
    assert step_model.bus_bandwidth(h100, 16) == pytest.approx(340e9)
    assert step_model.bus_bandwidth(replace(h100, rail_aligned=False), 16) == pytest.approx(50e9 * 0.85)
    # The A100 preset keeps the published run's reading: no NVLS, every GPU's share over its own NIC.
    assert step_model.bus_bandwidth(A100, 8) == pytest.approx(300e9 * 0.85)
    assert step_model.bus_bandwidth(A100, 16) == pytest.approx(25e9 * 0.85)


def test_doubled_bandwidth_halves_the_communication():
    def exposed(network, overlap):
        assumptions = replace(ROUND, cluster=replace(ROUND.cluster, network_gb_s=network), overlap=overlap)
        return step_model.step(WORK, assumptions, 16, 0.1).exposed

    assert exposed(20, overlap=False) == pytest.approx(exposed(10, overlap=False) / 2)
    # With overlap, the hidden part does not change: what is left shrinks by more than half.
    assert exposed(20, overlap=True) == pytest.approx((2 * 15 / 16 * 4e9 / 20e9) - 0.1)


def test_one_microbatch_per_gpu_leaves_only_its_backward_to_overlap():
    one = step_model.step(WORK, ROUND, 32, image_seconds=0.1)  # 2 images per GPU: a single microbatch
    assert (one.images_per_gpu, one.microbatches) == (2, 1)
    assert one.compute == pytest.approx(0.2)
    assert one.exposed == pytest.approx(one.communication - 0.5 * 0.2)
    # Fewer images per GPU than the microbatch: one smaller microbatch, and a smaller window.
    half = step_model.step(WORK, ROUND, 64, image_seconds=0.1)
    assert (half.images_per_gpu, half.microbatches) == (1, 1)
    assert half.exposed == pytest.approx(half.communication - 0.5 * 0.1)
    assert step_model.step(WORK, ROUND, 1, 0.1).communication == 0  # one GPU: nothing to reduce


def test_fsdp_gathers_every_microbatch_and_shards_the_fixed_work():
    for fsdp, gathers in (('shard_grad_op', 1), ('full_shard', 2)):
        step = step_model.step(replace(WORK, fsdp=fsdp), ROUND, 8, image_seconds=0.1)
        per_microbatch = 7 / 8 * (gathers * 2 * 10**9 + 4e9)  # bf16 parameters gathered, fp32 gradients
        assert step.communication == pytest.approx(step.microbatches * per_microbatch / 10e9)
        assert step.exposed == pytest.approx(step.communication - 0.75 * 0.8)
        assert step.fixed == pytest.approx(0.01 / 8)


def test_calibration_reproduces_the_measured_run():
    model = step_model.calibrate(WORK, ROUND, step_model.Measurement(8, 40.0))
    assert model.img_per_sec(8) == pytest.approx(40.0)
    # Solved by hand: 64/40 = 1.6 s = 8 t + (0.7 - 2 x 0.5 t) + 0.01, so t = 0.89 / 7.
    assert model.image_seconds == pytest.approx(0.89 / 7)
    # A run at batch 128, microbatch 4 with the same per-image time: 16 t + (0.7 - 4 x 0.5 t) + 0.01 per step.
    t = 0.89 / 7
    other = step_model.calibrate(WORK, ROUND, step_model.Measurement(8, 128 / (16 * t + 0.7 - 2 * t + 0.01), 128, 4))
    assert other.image_seconds == pytest.approx(t)
    assert other.workload.global_batch == 64  # predictions stay at the workload's batch


def test_bad_inputs_are_named():
    with pytest.raises(step_model.ScalingError, match='3 GPUs do not divide the global batch of 64'):
        step_model.calibrate(WORK, ROUND, step_model.Measurement(4, 40.0)).step(3)
    with pytest.raises(step_model.ScalingError, match='128 GPUs exceed the global batch of 64'):
        step_model.calibrate(WORK, ROUND, step_model.Measurement(4, 40.0)).step(128)
    with pytest.raises(step_model.ScalingError, match='do not split into microbatches of 3'):
        step_model.calibrate(replace(WORK, microbatch=3), ROUND, step_model.Measurement(4, 40.0))
    with pytest.raises(step_model.ScalingError, match='leaves no time for compute'):
        step_model.calibrate(
            WORK, ROUND, step_model.Measurement(8, 1000.0)
        )  # faster than the communication alone allows
    with pytest.raises(step_model.ScalingError, match='positive number'):
        step_model.calibrate(WORK, ROUND, step_model.Measurement(8, float('nan')))


def test_published_table_from_its_8_gpu_row_alone():
    """The documented A100 cluster and nothing fitted but the 8-GPU row: within 10% of every published figure,
    each inside the range over the plausible inputs."""
    model = step_model.calibrate(PUBLISHED, A100, step_model.Measurement(8, 128.2))
    corners = step_model.band(PUBLISHED, A100, step_model.Measurement(8, 128.2))
    # Link efficiency, fixed work, losses with the node count, network layout, and one image's time at smaller
    # microbatches (no curve; no count here goes below the measured 4, so it moves nothing).
    assert len(corners) == 5
    for gpus, published in PUBLISHED_IMG_PER_SEC.items():
        predicted = model.img_per_sec(gpus)
        assert abs(predicted / published - 1) < 0.10, (gpus, predicted, published)
        low, high = step_model.prediction_range({512: model}, {512: corners}, {512: 1}, gpus)
        assert low <= published <= high, (gpus, low, high, published)
        assert low < predicted < high
    # Inside one node, NVLink hides the all-reduce behind the last backward: the 8-GPU step is compute and
    # the optimizer and EMA work only.
    step = model.step(8)
    assert step.exposed == 0 and step.communication > 0


@dataclass(frozen=True)
class Run:
    """A throughput given by hand, as report.py hands it over (a calibration.MeasuredRun)."""

    gpus: int
    img_per_sec: float
    image_size: int = 512
    source: str = '--throughput'
    model: str | None = None
    precomputed: bool | None = None
    run: dict | None = None
    trained_parameters: int | None = None
    flops_per_image: float | None = None
    trained_flops_per_image: float | None = None


# report.py's defaults: the published run's batch and microbatch, SD2's UNet.
SETTINGS = calibration.PredictionSettings(global_batch=2048, microbatch=4)


def test_prediction_from_a_run_given_by_hand():
    models, bands = calibration.prediction_models([Run(8, 128.2)], [256, 512], [64], A100, SETTINGS, 'A100')
    notes = prediction_text.prediction_notes(models, bands, [64], 'A100')
    assert models[512].img_per_sec(64) == pytest.approx(846.4, abs=0.5)  # the table of docs/report.md
    assert models[256].img_per_sec(64) > models[512].img_per_sec(64) and len(bands[256]) == 5
    assert len(notes) == 1 and 'no run at 256px' in notes[0]


def test_losses_growing_with_the_node_count_stretch_the_step():
    plain = step_model.step(WORK, ROUND, 16, image_seconds=0.1)  # 4 nodes: two doublings
    lossy = step_model.step(WORK, replace(ROUND, scale_loss=0.05), 16, image_seconds=0.1)
    assert lossy.seconds == pytest.approx(plain.seconds * (1 + 0.05 * 2))
    assert lossy.node_losses == pytest.approx(plain.seconds * 0.1)
    one_node = replace(ROUND, scale_loss=0.05)
    assert step_model.step(WORK, one_node, 4, 0.1).seconds == step_model.step(WORK, ROUND, 4, 0.1).seconds
    # Not given: 2.5% per doubling centrally, and in the range; given, it is known and leaves the range.
    unknown = replace(ROUND, scale_loss=None)
    assert unknown.node_loss == 0.025
    # 8 GPUs, 2 nodes: the hand-computed 1.41 s of test_ring_traffic_over_the_network_across_nodes, plus 2.5%.
    assert step_model.step(WORK, unknown, 8, 0.1).seconds == pytest.approx(1.41 * 1.025)
    assert 'losses growing with the node count' in step_model.uncertain_inputs(unknown, WORK)
    assert 'losses growing with the node count' not in step_model.uncertain_inputs(ROUND, WORK)


def test_the_central_node_loss_fits_nemos_weak_scaling():
    """SCALE_LOSS is the least-squares fit (in log throughput) to NeMo's published weak scaling at 32 images per
    GPU, each row predicted from the 8-GPU row with the GPU type's preset: refitting it here must give it back."""
    nemo = {  # GPU type: (8-GPU img/s, {GPUs: published img/s})
        'A100': (268.3, {16: 540.1, 64: 2138.2, 512: 15917.6}),
        'H100': (511.9, {16: 997.9, 64: 3856.9, 128: 7177.2, 512: 25952.8}),
    }
    weak = replace(PUBLISHED, images_per_gpu=32, microbatch=32)

    def squared_log_errors(loss):
        total = 0.0
        for gpu, (measured, published) in nemo.items():
            assumptions = step_model.Assumptions(step_model.CLUSTERS[gpu], scale_loss=loss)
            model = step_model.calibrate(weak, assumptions, step_model.Measurement(8, measured, 256, 32))
            total += sum(math.log(model.img_per_sec(gpus) / value) ** 2 for gpus, value in published.items())
        return total

    fitted = min((squared_log_errors(loss / 1000), loss / 1000) for loss in range(0, 61))[1]
    assert fitted == pytest.approx(step_model.SCALE_LOSS, abs=0.001)
    assert step_model.SCALE_LOSS_BAND[0] <= step_model.SCALE_LOSS <= step_model.SCALE_LOSS_BAND[1]


def test_the_range_spans_only_what_is_not_known_of_the_cluster():
    h100 = step_model.Assumptions(step_model.CLUSTERS['H100'])  # rail-optimized: its layout is known
    corners = step_model.band(PUBLISHED, h100, step_model.Measurement(8, 1099.0))
    assert set(corners) == {'link efficiency', 'fixed work', 'losses growing with the node count', SMALLER}
    assert all(len(ends) == 2 for ends in corners.values())
    # At 512 GPUs and global batch 2048 a step is 4 images (about 30 ms) beside 24 ms of optimizer and EMA work:
    # that estimate weighs most. At 32 images per GPU the fixed work is small, and the losses the model leaves out
    # (6 doublings of the nodes x 4.5%) weigh most.
    assert step_model.dominant_input(corners, 512) == 'fixed work'
    # Only below the measured microbatch (1,024 GPUs: 2 images each, measured 4) does its speed move the range.
    assert len({corner.img_per_sec(512) for corner in corners[SMALLER]}) == 1
    assert len({corner.img_per_sec(1024) for corner in corners[SMALLER]}) == 2
    curved = replace(PUBLISHED, microbatch_curve=((2, 1.3), (4, 1.0)))
    assert SMALLER not in step_model.band(curved, h100, step_model.Measurement(8, 1099.0))
    weak = step_model.band(replace(PUBLISHED, images_per_gpu=32), h100, step_model.Measurement(8, 1099.0, 256, 4))
    assert step_model.dominant_input(weak, 512) == 'losses growing with the node count'
    assert 'network layout' in step_model.band(PUBLISHED, A100, step_model.Measurement(8, 128.2))  # not known for A100


# docs/report.md's published clusters at 16 or more images per GPU: (GPU type, UNet alone, fixed work in s or None,
# measured (GPUs, img/s, global batch), predicted workload's global batch or None for weak scaling at 32 per GPU,
# {GPUs: published img/s}). NVIDIA's MLPerf runs use fused Adam without EMA: 28 bytes per parameter.
PUBLISHED_CLUSTERS = {
    'MLPerf v4.1 NVIDIA H100': ('H100', True, SD2_UNET * 28 / 3350e9, (8, 1099.0, 256), 1024, {64: 7965.0}),
    'MLPerf v4.1 Lambda H100': ('H100', True, None, (16, 1906.5, 512), None, {32: 3734.4}),
    'MLPerf v5.0 Dell H200': ('H200', True, None, (8, 1147.0, 256), None, {16: 2272.9}),
    'NeMo DGX H100': ('H100', False, None, (8, 511.9, 256), None, {16: 997.9, 64: 3856.9, 128: 7177.2, 512: 25952.8}),
    'NeMo DGX A100': ('A100', False, None, (8, 268.3, 256), None, {16: 540.1, 64: 2138.2, 512: 15917.6}),
}


@pytest.mark.parametrize('source', sorted(PUBLISHED_CLUSTERS))
def test_published_clusters_within_ten_percent_at_16_or_more_images_per_gpu(source):
    gpu, unet_only, fixed, (gpus, measured, batch), global_batch, published = PUBLISHED_CLUSTERS[source]
    trained = 1.0 if unet_only else 2.41 / 3.58
    workload = step_model.Workload(
        global_batch or batch,
        32,
        SD2_UNET,
        backward_share=2 / 3 * trained,
        trained_share=trained,
        images_per_gpu=None if global_batch else 32,
    )
    assumptions = step_model.Assumptions(step_model.CLUSTERS[gpu], fixed_seconds=fixed)
    run = step_model.Measurement(gpus, measured, batch, 32)
    model, corners = step_model.calibrate(workload, assumptions, run), step_model.band(workload, assumptions, run)
    for count, value in published.items():
        predicted = model.img_per_sec(count)
        assert abs(predicted / value - 1) < 0.10, (count, predicted, value)
        low, high = step_model.prediction_range({512: model}, {512: corners}, {512: 1}, count)
        # NeMo's 2-node A100 row scaled at 100.7%: above what any loss can give.
        assert low <= value <= high or (source, count) == ('NeMo DGX A100', 16), (count, low, high, value)


@dataclass(frozen=True)
class Fixed:
    """A model that predicts one throughput at any count, standing in for a ScalingModel."""

    value: float

    def img_per_sec(self, gpus: int) -> float:
        return self.value


def test_the_range_adds_independent_moves_in_quadrature_and_correlated_ones_together():
    central = {512: Fixed(100.0)}
    # Each input's two ends, the others central: link efficiency 80 or 110, fixed work 90 or 100.
    bands = {512: {'link efficiency': [Fixed(80.0), Fixed(110.0)], 'fixed work': [Fixed(90.0), Fixed(100.0)]}}
    low, high = step_model.prediction_range(central, bands, {512: 1}, 64)
    assert low == pytest.approx(100 * math.exp(-math.hypot(math.log(100 / 80), math.log(100 / 90))))
    assert high == pytest.approx(110.0)  # only link efficiency moves it up
    # The network layout and the losses growing with the node count move together: their moves add.
    bands = {
        512: {
            'network layout': [Fixed(100.0), Fixed(120.0)],
            'losses growing with the node count': [Fixed(90.0), Fixed(110.0)],
        }
    }
    low, high = step_model.prediction_range(central, bands, {512: 1}, 64)
    assert high == pytest.approx(100 * 1.2 * 1.1)
    assert low == pytest.approx(90.0)


def test_without_a_curve_a_smaller_microbatch_is_as_fast_as_measured_or_as_slow_as_a_whole_one():
    # WORK is measured at microbatch 2; 64 GPUs leave each 1 image. Centrally its time is as measured; at the top
    # of the band one microbatch of 1 takes as long as a measured microbatch of 2.
    assert step_model.step(WORK, ROUND, 64, image_seconds=0.1).compute == pytest.approx(0.1)
    for unfilled, factor in ((1.0, 2.0), (0.5, 1.5)):
        slow = step_model.step(WORK, replace(ROUND, unfilled_share=unfilled), 64, image_seconds=0.1)
        assert slow.compute == pytest.approx(0.1 * factor)
    # At or above the measured microbatch nothing changes.
    assert step_model.step(WORK, replace(ROUND, unfilled_share=1.0), 16, 0.1).compute == pytest.approx(4 * 0.1)
    # report.py's note says how far it lowers the range: 1,024 GPUs at global batch 2048 get 2 images each.
    models, bands = calibration.prediction_models([Run(8, 128.2)], [512], [512, 1024], A100, SETTINGS, 'A100')
    notes = prediction_text.prediction_notes(models, bands, [512, 1024], 'A100')
    low = min(corner.img_per_sec(1024) for corner in bands[512][SMALLER])
    assert low < models[512].img_per_sec(1024)
    assert f'its low end alone is {low:,.1f} img/s' in notes[0]


def test_a_microbatch_curve_slows_the_steps_below_the_measured_microbatch():
    # Measured at microbatch 2 in WORK; one image takes 1.5x as long at microbatch 1, and the same at 4.
    curved = replace(WORK, microbatch_curve=((1, 1.5), (2, 1.0), (4, 1.0)))
    assert curved.image_time_factor(1) == 1.5 and curved.image_time_factor(2) == 1.0
    assert step_model.log2_interpolate(((1, 1.5), (4, 1.0)), 2) == pytest.approx(1.25)  # halfway in log2
    at_64 = step_model.step(curved, ROUND, 64, image_seconds=0.1)  # 1 image per GPU
    assert at_64.compute == pytest.approx(1 * 0.1 * 1.5)
    assert step_model.step(curved, ROUND, 16, 0.1).compute == pytest.approx(4 * 0.1)  # microbatch 2: as measured
    # Per-GPU throughputs -> one image's time relative to the measured microbatch (4): 50, 100, 120 img/s.
    relative = calibration.relative_image_times(((2, 50.0), (4, 100.0), (8, 120.0)), 4, 'run')
    assert [m for m, _ in relative] == [2, 4, 8]
    assert [time for _, time in relative] == pytest.approx([2.0, 1.0, 100 / 120])
    with pytest.raises(calibration.PredictionError, match='covers microbatches 2-8, not the microbatch 16 of run'):
        calibration.relative_image_times(((2, 50.0), (8, 120.0)), 16, 'run')


def test_weak_scaling_grows_the_global_batch_with_the_gpus():
    weak = replace(WORK, images_per_gpu=8)  # 8 images per GPU per step, in microbatches of 2, at any count
    step = step_model.step(weak, ROUND, 16, image_seconds=0.1)
    assert step.global_batch == 128 and step.images_per_gpu == 8 and step.microbatches == 4
    assert step.compute == pytest.approx(8 * 0.1)
    assert step.communication == pytest.approx(2 * 15 / 16 * 4e9 / 10e9)  # the same 4 GB all-reduced
    # A throughput given by hand is taken at the same images per GPU: 8 GPUs x 32 = 256 in the measured step.
    settings = replace(SETTINGS, images_per_gpu=32, microbatch=32)
    models, _ = calibration.prediction_models([Run(8, 511.9)], [512], [8, 64], A100, settings, 'A100')
    assert models[512].img_per_sec(8) == pytest.approx(511.9)
    assert models[512].step(64).global_batch == 64 * 32


def test_a_step_below_the_measured_microbatch_is_flagged_as_an_upper_bound():
    # Global batch 2048: 512 GPUs get the measured microbatch of 4, 1,024 GPUs only 2 images each.
    models, bands = calibration.prediction_models([Run(8, 128.2)], [512], [512], A100, SETTINGS, 'A100')
    assert prediction_text.prediction_notes(models, bands, [512], 'A100') == []
    models, bands = calibration.prediction_models([Run(8, 128.2)], [512], [512, 1024], A100, SETTINGS, 'A100')
    notes = prediction_text.prediction_notes(models, bands, [512, 1024], 'A100')
    assert len(notes) == 1 and notes[0].startswith('A100: at 1,024 GPUs each GPU gets fewer than the measured')


def test_prediction_errors_are_complete_and_the_step_models_are_not():
    with pytest.raises(calibration.PredictionError, match='^--predict starts from one measured run per phase; got 2'):
        calibration.prediction_models([Run(8, 128.2), Run(16, 254.0)], [None], [32], A100, SETTINGS, 'A100')
    with pytest.raises(step_model.ScalingError, match='^3 GPUs do not divide the global batch of 2048') as error:
        calibration.prediction_models([Run(8, 128.2)], [None], [3], A100, SETTINGS, 'A100')
    assert not isinstance(error.value, calibration.PredictionError)  # report.py prefixes these with '--predict: '


def test_the_breakdown_measures_scaling_efficiency_against_the_base_it_is_given():
    """report.py's table and the step model's breakdown compute scaling efficiency with one function from one base:
    the measured run at its own batch (here 256), not the model's step at the predicted batch (2048), whose
    optimizer and EMA work weigh less per image."""
    settings = replace(SETTINGS, measured_batch=256)
    models, bands = calibration.prediction_models([Run(8, 128.2)], [512], [64], A100, settings, 'A100')
    text = prediction_text.describe_prediction('A100', models, bands, {512: 1}, [8, 64], [], (8, {512: 128.2}))
    row = next(line for line in text.splitlines() if line.startswith('| 64 |')).split(' | ')
    measured_base = step_model.scaling_efficiency(models[512].img_per_sec(64), 64, 128.2, 8)
    own_step_base = step_model.scaling_efficiency(models[512].img_per_sec(64), 64, models[512].img_per_sec(8), 8)
    assert row[11] == f'{measured_base:.1%}' != f'{own_step_base:.1%}'
    assert '| scaling eff. (vs 8) |' in text
    assert step_model.scaling_efficiency(200.0, 16, 100.0, 8) == 1.0
    assert step_model.scaling_efficiency(150.0, 16, 100.0, 8) == 0.75
    assert not models[512].at_measured_batch(8) and models[512].measured_batch == 256
