"""The gpu tier (make test-gpu): every path that runs only on CUDA, on the tiny model for a few batches, and one
step of SD2 base. Skipped where no GPU is visible; CUDA is hidden from every other tier (conftest.py)."""

import json
import math

import pytest
import torch
from composer.core import Callback
from conftest import TINY

from benchmark import main
from config import parse_args, resolve_config
from model import build_model
from results import PEAK_FLOPS, gpu_key

pytestmark = pytest.mark.gpu

# The tiny model on random tensors for 4 batches of 8, two loader workers: seconds on any GPU.
RUN = [*TINY, '--image_size', '64', '--batch_size', '8', '--max_duration', '4ba', '--num_workers', '2']


class KeepLosses(Callback):
    def __init__(self):
        self.losses = []

    def after_train_batch(self, state, logger):
        self.losses.append(state.loss.item())


def train(tmp_path, *flags) -> tuple[dict, list[float], torch.nn.Module]:
    """benchmark.main with these flags; its results file, the losses of its batches, and its model."""
    keep = KeepLosses()
    trainer = main(parse_args([*flags, '--results_json', str(tmp_path / 'results.json')]), callbacks=(keep,))
    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    return json.loads((tmp_path / 'results.json').read_text()), keep.losses, model


def test_gpu_defaults_are_the_published_run():
    config = resolve_config(parse_args(['--use_synth_data']))
    assert config.model_name == 'sd2-base' and any('a GPU is present' in note for note in config.notes)
    assert (config.image_size, config.batch_size, config.device_train_microbatch_size) == (512, 2048, 4)
    assert (config.precision, config.pin_memory, config.num_workers) == ('amp_bf16', True, 8)


def test_tiny_model_trains_on_the_gpu_in_bf16(tmp_path):
    results, losses, model = train(tmp_path, *RUN)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert results['device_type'] == 'gpu' and results['device_name'] == torch.cuda.get_device_name()
    assert results['img_per_sec'] > 0 and results['peak_gpu_memory_gb'] > 0
    assert results['config']['precision'] == 'amp_bf16' and results['config']['pin_memory'] is True
    if gpu_key(results['device_name']) in PEAK_FLOPS:  # MFU against the table's dense bf16 peak
        peak = PEAK_FLOPS[gpu_key(results['device_name'])]
        assert results['mfu'] == pytest.approx(results['flops_per_sec'] / (results['num_devices'] * peak))


@pytest.mark.parametrize(
    'flags',
    [
        ['--precision', 'amp_fp16'],
        ['--channels_last'],
        ['--fused_adamw'],
        ['--low_precision_norm'],
        ['--encoders_bf16'],
        ['--no-pin_memory'],
        ['--device_train_microbatch_size', 'auto'],
        ['--device_train_microbatch_size', '2'],
        ['--fsdp', 'shard_grad_op'],
        ['--fsdp', 'full_shard', '--use_ema'],
        ['--use_ema', '--ema_offload'],
        ['--compile'],
        ['--precomputed_latents', '--fused_adamw'],
    ],
    ids=lambda flags: ' '.join(flags),
)
def test_speed_paths_train_on_the_gpu(tmp_path, flags):
    results, losses, _ = train(tmp_path, *RUN, *flags)
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert results['img_per_sec'] > 0


def test_xformers_attention_trains_on_the_gpu(tmp_path):
    pytest.importorskip('xformers')
    _, losses, _ = train(tmp_path, *RUN, '--attention', 'xformers')
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)


def test_sd2_base_initializes_on_the_gpu():
    model = build_model('sd2-base', init_device='cuda')
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert sum(p.numel() for p in model.unet.parameters()) == 865_910_724


def test_sd2_base_trains_two_batches_at_256px(tmp_path):
    results, losses, _ = train(
        tmp_path,
        '--model_name',
        'sd2-base',
        '--use_synth_data',
        '--image_size',
        '256',
        '--batch_size',
        '4',
        '--device_train_microbatch_size',
        '2',
        '--max_duration',
        '2ba',
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # At 256px: 3 x UNet forward 0.18 + VAE encoder 0.27 + text encoder 0.045 TFLOP.
    assert results['flops_per_image'] == pytest.approx(0.855e12, rel=0.02)


@pytest.mark.parametrize('name', ['sd1.5', 'sd2-768-v', 'sdxl-base'])
def test_other_models_train_two_batches_at_256px(tmp_path, name):
    """Each built-in model, at full size, on the GPU in bf16: SDXL's two encoders, pooled embedding and size
    conditioning, v-prediction, OpenAI CLIP's quick_gelu."""
    flags = ['--model_name', name, '--use_synth_data', '--image_size', '256', '--batch_size', '2']
    results, losses, model = train(tmp_path, *flags, '--device_train_microbatch_size', '1', '--max_duration', '2ba')
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert results['model_name'] == name and results['trained_parameters'] == sum(
        p.numel() for p in model.unet.parameters()
    )
    assert results['peak_gpu_memory_gb'] > 0
