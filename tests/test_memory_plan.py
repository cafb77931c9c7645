"""The microbatch planned from memory (memory_plan.py): its counts against the models, its plans for three GPUs
against hand-computed figures, its calibration against the measured H100 peaks, and how a run on a GPU takes it
(a GPU faked: only the settling is tested here; the gpu tier trains at the planned microbatch)."""

import importlib.util

import pytest
import torch
from conftest import fake_gpu

from guards.arguments import ConfigError
from models.stable_diffusion import build_model
from settings import hardware, memory_plan
from settings.config import resolve_config
from settings.flags import parse_args
from settings.memory_plan import GB, Run, plan
from settings.model_folder import resolve_model_dir

A100_40GB, H100_80GB, H200_141GB = 40e9, 80e9, 141e9  # nominal sizes, as the hand computations below take them
H100 = hardware.Gpu('NVIDIA H100 80GB HBM3', 85_029_158_912, True, (9, 0))  # as torch reports an H100 SXM


def recount(model_name: str) -> tuple[int, int]:
    with torch.device('meta'):
        model = build_model(resolve_model_dir(model_name))
    trained = sum(p.numel() for p in model.denoiser.parameters())
    frozen = sum(p.numel() for encoder in model.frozen_encoders() for p in encoder.parameters())
    return trained, frozen


def test_the_parameter_counts_are_the_models():
    assert recount('sd2-base') == memory_plan.PARAMETERS['sd2-base']


@pytest.mark.slow
@pytest.mark.parametrize('model_name', sorted(memory_plan.PARAMETERS))
def test_every_count_is_the_models(model_name):
    from benchmarks.saved_activations import saved_bytes_per_image

    assert recount(model_name) == memory_plan.PARAMETERS[model_name]
    for size, count in memory_plan.ACTIVATIONS[model_name]:
        assert saved_bytes_per_image(model_name, size) == count
    for size, count in memory_plan.ACTIVATIONS_CHECKPOINTED[model_name]:
        assert saved_bytes_per_image(model_name, size, activation_checkpointing=True) == count


def test_activations_between_and_beyond_the_counted_sizes():
    # Linear in the pixels through two counts; proportional to them from one.
    assert memory_plan.activation_bytes('sd2-base', 512) == 1_032_795_392
    middle = (264_920_768 + 1_032_795_392) / 2  # 256px and 512px counted; sqrt(mean of their pixel counts)
    assert memory_plan.activation_bytes('sd2-base', (256**2 / 2 + 512**2 / 2) ** 0.5) == pytest.approx(middle)
    assert memory_plan.activation_bytes('sd1.5', 1024) == pytest.approx(4 * 1_031_674_112)
    # SD2 at 768px from its 256 and 512px counts: within 1% of SD2 768-v's own count (the same UNet).
    assert memory_plan.activation_bytes('sd2-base', 768) == pytest.approx(2_312_586_432, rel=0.01)


def test_the_margin_reproduces_the_measured_h100_peaks():
    """SD2 base, 512px, microbatch 4, bf16, EMA: 24.3 GB allocated precomputed, 26.0 online (encoders fp32)."""
    for precomputed, measured in ((True, 24.3), (False, 26.0)):
        run = Run('sd2-base', 512, 4, use_ema=True, precomputed_latents=precomputed)
        at_4 = plan(run, H100.memory_bytes)
        assert at_4.state + 4 * at_4.activations_per_image + at_4.margin == pytest.approx(measured * GB, abs=0.05 * GB)


# Hand-computed. SD2 UNet P = 865,910,724 trained parameters, frozen VAE + CLIP 424,041,703; one 512px image's
# activations A = 1,032,795,392 bytes; margin 2P + 1.12 GB = 2,851,821,448; 90% of the GPU usable.
# - precomputed, no EMA: state 16P = 13,854,571,584; room = 0.9 C - 16,706,393,032:
#   A100 19,293,606,968 (18.7 images), H100 55,293,606,968 (53.5), H200 110,193,606,968 (106.7)
# - online, bf16 encoders, EMA: state 20P + 2 x 424,041,703 = 18,166,297,886; room = 0.9 C - 21,018,119,334:
#   A100 14,981,880,666 (14.5), H100 50,981,880,666 (49.4), H200 105,881,880,666 (102.5)
# Flux transformer P = 11,891,178,560, full_shard over 8 with EMA, precomputed: state P (4 + 16) / 8 = 29,727,946,400,
# margin 1.12 GB (full_shard casts one block at a time), 256px A = 4,525,732,866, device batch 1024 / 8 = 128:
#   A100 5,152,053,600 (1.1), H100 41,152,053,600 (9.1), H200 96,052,053,600 (21.2)
SD2_PRECOMPUTED = Run('sd2-base', 512, 2048, precomputed_latents=True)
SD2_ONLINE = Run('sd2-base', 512, 2048, use_ema=True, encoders_bf16=True)
FLUX_SHARDED = Run('flux-schnell', 256, 128, 8, use_ema=True, precomputed_latents=True, fsdp='full_shard')


@pytest.mark.parametrize(
    'run, state, microbatches',
    [
        (SD2_PRECOMPUTED, 13_854_571_584, (16, 32, 64)),
        (SD2_ONLINE, 18_166_297_886, (8, 32, 64)),
        (FLUX_SHARDED, 29_727_946_400, (1, 8, 16)),
    ],
    ids=['sd2 precomputed', 'sd2 online with EMA', 'flux full_shard 8'],
)
def test_plans_for_a100_h100_h200(run, state, microbatches):
    for capacity, microbatch in zip((A100_40GB, H100_80GB, H200_141GB), microbatches):
        planned = plan(run, capacity)
        assert planned.state == pytest.approx(state)
        assert planned.microbatch == microbatch
        assert planned.total <= 0.9 * capacity
    assert plan(SD2_PRECOMPUTED, H100_80GB).describe() == (
        'microbatch 32 (planned): 13.9 GB state + 32 x 1.03 GB activations + 2.9 GB margin = 49.8 GB of 80.0 GB '
        '(90% usable)'
    )


def test_shard_grad_op_shares_all_but_the_weights():
    run = Run('sd2-base', 512, 256, 8, use_ema=True, precomputed_latents=True, fsdp='shard_grad_op')
    assert memory_plan.state_bytes(run) == pytest.approx(865_910_724 * (4 + 16 / 8))


def test_nothing_fits_an_unsharded_flux():
    planned = plan(Run('flux-schnell', 256, 1024, precomputed_latents=True), H100_80GB)
    assert planned.microbatch is None and planned.describe().startswith('no microbatch fits (planned): 190.3 GB state')


# ------------------------------------------------------------------------------------ a run on a GPU, faked


def settle(monkeypatch, *flags):
    fake_gpu(monkeypatch, H100)
    return resolve_config(parse_args(['--use_synth_data', *flags]))


def test_latents_precomputed_at_256px_are_planned_for_256px_without_image_size(monkeypatch, tmp_path):
    """The data is read before the batch is planned: SD2 base latents of 256px (32x32), trained without
    --image_size, get the plan of 256px, not of the preset's 512px (a quarter of the microbatch)."""
    import numpy as np
    from streaming import MDSWriter

    from settings.dataset_checks import PRECOMPUTED_COLUMNS

    folder = tmp_path / 'latents'
    with MDSWriter(out=str(folder), columns=PRECOMPUTED_COLUMNS, compression='zstd') as writer:  # zeros: small
        for i in range(256):
            latent = np.zeros((4, 32, 32), np.float16)
            text = np.zeros((77, 1024), np.float16)
            writer.write({'latent_mean': latent, 'latent_logvar': latent, 'text_embedding': text, 'caption': f'{i}'})
    fake_gpu(monkeypatch, H100)
    flags = ['--model_name', 'sd2-base', '--precomputed_latents', '--local', str(folder), '--batch_size', '256']
    read = resolve_config(parse_args(flags))
    given = resolve_config(parse_args([*flags, '--image_size', '256']))
    assert read.data.image_size == given.data.image_size == 256
    assert read.batch.device_train_microbatch_size == given.batch.device_train_microbatch_size == 128


def test_the_fast_recipe_on_a_gpu_plans_the_microbatch_and_turns_the_speed_paths_on(monkeypatch):
    config = settle(monkeypatch, '--precomputed_latents')
    assert config.model.model_name == 'sd2-base' and config.model.run_recipe == 'fast'
    assert config.batch.device_train_microbatch_size == 32 and config.batch.precision == 'amp_bf16'
    assert config.speed.fused_adamw and config.speed.low_precision_norm and config.speed.pin_memory
    assert not config.speed.channels_last  # measured slower on an H200 (defaults.FAST_PATHS)
    assert not config.speed.encoders_bf16 and not config.ema.use_ema  # precomputed: no encoders; EMA as the flags say
    planned = next(note for note in config.notes if 'planned' in note)
    assert planned.startswith('microbatch 32 (planned): 13.9 GB state + 32 x 1.03 GB activations')
    defaults = next(note for note in config.notes if note.startswith('defaults:'))
    assert defaults.startswith('defaults: image_size 512, batch_size 2048, max_duration 10ba from the sd2-base preset')
    assert (
        "on: fused_adamw, low_precision_norm, pin_memory, off: use_ema, channels_last, encoders_bf16 from the 'fast'"
        in defaults
    )
    online = settle(monkeypatch)
    assert online.speed.encoders_bf16 and online.batch.device_train_microbatch_size == 32


def test_the_published_recipe_is_the_2023_run(monkeypatch):
    config = settle(monkeypatch, '--recipe', 'published')
    assert config.batch.device_train_microbatch_size == 4 and config.batch.precision == 'amp_fp16'
    assert config.ema.use_ema
    assert not any(getattr(config.speed, flag) for flag in ('channels_last', 'fused_adamw', 'low_precision_norm'))
    assert not config.speed.encoders_bf16 and not config.speed.pin_memory and not config.speed.compile
    assert config.model.attention == ('xformers' if importlib.util.find_spec('xformers') else 'sdpa')  # SDPA without it
    with pytest.raises(ConfigError, match="--recipe published: the 2023 run's settings are SD2's"):
        settle(monkeypatch, '--recipe', 'published', '--model_name', 'pixart-sigma')


def test_a_flag_given_wins_over_the_recipe_and_the_plan(monkeypatch):
    config = settle(monkeypatch, '--device_train_microbatch_size', '8', '--no-channels_last', '--precision', 'fp32')
    assert config.batch.device_train_microbatch_size == 8 and not config.speed.channels_last
    assert not config.speed.low_precision_norm  # needs autocast: not a default under fp32
    assert not any('planned' in note for note in config.notes)
    published = settle(monkeypatch, '--recipe', 'published', '--no-use_ema', '--fused_adamw')
    assert not published.ema.use_ema and published.speed.fused_adamw


def test_a_model_without_counts_takes_its_preset_microbatch(monkeypatch):
    config = settle(monkeypatch, '--model_name', 'tiny')
    batch = config.batch
    assert batch.device_train_microbatch_size == batch.device_batch_size  # the tiny preset's: the whole batch


def test_activation_checkpointing_is_planned_with_its_own_counts(monkeypatch):
    # SD2 512px, online in bf16, EMA, checkpointed: 239,201,536 bytes an image; room on an H100 (0.9 x 85.03 GB less
    # 21.02 GB) 55.51 GB: 232 images, so the whole device batch of 128 (--batch_size 128).
    config = settle(monkeypatch, '--use_ema', '--activation_checkpointing', '--batch_size', '128')
    assert config.batch.device_train_microbatch_size == 128
    assert next(note for note in config.notes if 'planned' in note).startswith(
        'microbatch 128 (planned): 18.2 GB state + 128 x 0.24 GB activations'
    )


def test_a_plan_that_cannot_fit_stops_in_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r'^flux-schnell at 256px: no microbatch fits .*\(--fsdp full_shard\)'):
        settle(monkeypatch, '--model_name', 'flux-schnell', '--precomputed_latents')


def test_cuda_graphs_are_refused_with_several_microbatches_a_step(monkeypatch):
    """reduce-overhead's graphs replay each microbatch into the same memory
    (device_checks.check_one_microbatch_a_step)."""
    replays = '--compile reduce-overhead: CUDA graphs replay every microbatch into the same memory'
    given = ('--batch_size', '256', '--device_train_microbatch_size', '64')
    with pytest.raises(ConfigError) as refused:
        settle(monkeypatch, '--compile', 'reduce-overhead', *given)
    assert str(refused.value) == (
        f'{replays}, and this step accumulates 4 microbatches of 64 (device batch 256): pass '
        '--device_train_microbatch_size 256 (one microbatch a step) or --batch_size 64 (64 per device), or another '
        '--compile mode'
    )
    with pytest.raises(ConfigError, match=r'accumulates 64 microbatches of 32 \(device batch 2048\)'):
        settle(monkeypatch, '--compile', 'reduce-overhead')  # the preset's batch, the planned microbatch
    with pytest.raises(ConfigError) as refused:
        settle(
            monkeypatch, '--compile', 'reduce-overhead', '--batch_size', '256', '--device_train_microbatch_size', 'auto'
        )
    assert str(refused.value) == (
        f'{replays}, and --device_train_microbatch_size auto lets Composer split the device batch of 256 into '
        'several: pass --device_train_microbatch_size 256 (one microbatch a step), or another --compile mode'
    )
    one_a_step = settle(
        monkeypatch, '--compile', 'reduce-overhead', '--batch_size', '64', '--device_train_microbatch_size', '64'
    )
    assert one_a_step.speed.compile == 'reduce-overhead' and one_a_step.batch.device_train_microbatch_size == 64
    tiny = settle(monkeypatch, '--compile', 'reduce-overhead', '--model_name', 'tiny')  # as tests/test_gpu.py's runs
    assert tiny.batch.device_train_microbatch_size == tiny.batch.device_batch_size
    default = settle(monkeypatch, '--compile', 'default', *given)
    assert default.batch.device_train_microbatch_size == 64  # no CUDA graphs


def test_the_gpu_tiers_runs_settle_on_a_faked_gpu(monkeypatch):
    """Each flag set the gpu tier (tests/test_gpu.py) trains with settles on an H100 without a ConfigError, checked
    where no GPU is: a flag set that a change made invalid is found here, not on a lent machine's minutes."""
    import test_gpu as tier

    runs = [tier.FP32, tier.BF16, tier.FP8_FLUX]
    runs += [[*tier.FP32, *flags] for flags in tier.SPEED_FLAGS]
    runs += [[*tier.BF16, '--compile', mode] for mode in tier.COMPILE_MODES]
    runs += [[*tier.BF16, *flags] for flags in [*tier.BF16_FLAGS, ['--activation_checkpointing']]]
    runs += [[*tier.RUN, *flags] for flags in tier.OTHER_PATHS]
    for flags in runs:
        settled = settle(monkeypatch, *flags)
        assert settled.batch.num_batches == 4 and settled.batch.precision in ('fp32', 'amp_bf16'), flags
    reduce_overhead = settle(monkeypatch, *tier.BF16, '--compile', 'reduce-overhead')
    batch = reduce_overhead.batch
    assert batch.device_train_microbatch_size == batch.device_batch_size  # one microbatch a step


# What a campaign row may change of the headline recipe, and what each row past the headline changes.
SETTLED = (
    'model_name',
    'image_size',
    'precomputed_latents',
    'compile',
    'device_train_microbatch_size',
    'precision',
    'channels_last',
    'fused_adamw',
    'low_precision_norm',
    'fused_groupnorm',
    'attention',
    'cudnn_benchmark',
    'activation_checkpointing',
    'profile',
)
CHANGED = {
    'headline recipe (A)': set(),
    'headline recipe with channels_last (B)': {'channels_last'},
    'profile of the headline recipe': {'profile'},
    'kernel fused_groupnorm': {'fused_groupnorm'},
    'kernel attention cudnn': {'attention'},
    'kernel cudnn_benchmark': {'cudnn_benchmark'},
    'path without fused_adamw': {'fused_adamw'},
    'path without low_precision_norm': {'low_precision_norm'},
    'path fp16 for bf16': {'precision'},
    'path reduce-overhead for default': {'compile'},
    'path with activation_checkpointing': {'activation_checkpointing'},
    'sweep mb16': {'device_train_microbatch_size'},  # half the planned 32; the headline row is the planned one
}


def test_the_campaigns_rows_are_the_headline_recipe_changed_in_one_thing_on_a_faked_gpu(monkeypatch, tmp_path):
    """Each row past the headline (benchmarks/campaign_rows.py) settles on an H100 as the README's headline row,
    the fast recipe compiled from precomputed latents at the planned microbatch, but for the one thing it measures;
    a step stands alone, the paths taking the plan's microbatch before the sweep is measured and its fastest after."""
    import argparse

    from benchmarks import campaign_rows

    campaign = campaign_rows.Campaign(argparse.Namespace(batches=None), True, tmp_path)
    campaign._planned = 32  # what memory_plan.py plans for it on an H100 (asked in a process of its own)
    headline = settle(monkeypatch, '--precomputed_latents', '--compile', '--batch_size', '256')
    assert headline.batch.device_train_microbatch_size == 32
    assert headline.speed.compile == 'default' and headline.speed.fused_adamw
    seen = set()
    for step in ('channels_last', 'profile', 'kernels', 'sweep', 'paths'):
        for row in campaign.rows(step, {}):
            settled = settle(monkeypatch, *row['argv'][1:])
            changed = {name for name in SETTLED if settled.as_dict()[name] != headline.as_dict()[name]}
            assert changed == CHANGED[row['key']], row['key']
            assert row.get('record', {}).get('microbatch_from', 'the memory plan').startswith('the memory plan')
            seen.add(row['key'])
    assert seen == set(CHANGED)
    # The sweep's row at half the planned microbatch, and the headline recipe's own at the planned 32.
    sweep = {
        'sweep mb16': {'microbatch': 16, 'img_per_sec_per_device': 116},
        'headline recipe (A)': {'microbatch': 32, 'img_per_sec_per_device': 100},
    }
    paths = campaign.rows('paths', sweep)  # fastest: microbatch 16
    assert all(row['record'] == {'microbatch_from': 'the sweep'} for row in paths)
    assert all(settle(monkeypatch, *row['argv'][1:]).batch.device_train_microbatch_size == 16 for row in paths)
    cpu = campaign_rows.Campaign(argparse.Namespace(batches=None), False, tmp_path)
    assert all(row['kind'] == 'skipped' for row in cpu.rows('kernels', {}))  # CUDA kernels
