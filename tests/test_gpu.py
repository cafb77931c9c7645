"""The gpu tier (make test-gpu): every path that runs only on CUDA, each asserted against a reference. Runs of the
tiny model on random tensors (seconds each), and SD2 base at full size where size matters (memory, kernels,
microbatch search). Skipped with the reason 'no CUDA device' where none is visible; CUDA is hidden from every
other tier (conftest.py).

A speed flag must keep the step: the same first loss and first gradient as the plain run, from the same init on
the same batch with the same noise, and the same update after 4 steps of AdamW. Tolerances, as norms of the
difference over the norm of the reference: in fp32 (TF32 convolutions, as cuDNN defaults) 1% for the gradient and
5% for the update, which AdamW can flip where a gradient is near zero, as on CPU (test_precompute.py); against
the plain bf16 run, 5% for the gradient of a flag that changes bf16 rounding."""

import json
import math
from dataclasses import dataclass

import pytest
import torch
from composer.core import Callback
from conftest import TINY, final_weights, good_samples, settled, write_dataset, write_t5_tokenizer
from torch.nn.attention import SDPBackend, sdpa_kernel

import generate
import precompute
from costs.results import PEAK_FLOPS, gpu_key
from datapath.sample_dataset import ensure_sample_dataset
from ema import EMA
from models.stable_diffusion import build_model
from runs.run import main
from settings import datasets as run_data
from settings.config import resolve_config
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR

pytestmark = pytest.mark.gpu

# The tiny model on random tensors for 4 batches of 8, two loader workers: seconds on any GPU.
# The speed paths the fast recipe turns on by default on a GPU, off: each test below turns on the one it checks.
SPEED_PATHS_OFF = ['--no-channels_last', '--no-fused_adamw', '--no-low_precision_norm', '--no-encoders_bf16']
RUN = [
    *TINY,
    '--image_size',
    '64',
    '--batch_size',
    '8',
    '--max_duration',
    '4ba',
    '--num_workers',
    '2',
    *SPEED_PATHS_OFF,
]
FP32 = [*RUN, '--precision', 'fp32']
BF16 = [*RUN, '--precision', 'amp_bf16']
# The flag sets the tests below add to RUN, FP32 or BF16 (tests/test_memory_plan.py settles each on a faked GPU).
SPEED_FLAGS = [['--channels_last'], ['--fused_adamw'], ['--compile'], ['--no-pin_memory']]
COMPILE_MODES = ['max-autotune-no-cudagraphs', 'reduce-overhead']
# The kernels past the fast recipe (kernels.py) among them: against the plain bf16 run, whose attention is SDPA's
# flash path, the fused GroupNorm + SiLU's and cuDNN attention's rounding within the bf16 gradient tolerance.
BF16_FLAGS = [
    ['--low_precision_norm'],
    ['--encoders_bf16'],
    ['--fused_groupnorm'],
    ['--attention', 'cudnn'],
    ['--cudnn_benchmark'],
]
OTHER_PATHS = [
    ['--device_train_microbatch_size', '2'],
    ['--fsdp', 'full_shard', '--use_ema'],
    ['--precomputed_latents'],
]
FP8_FLUX = [
    '--model_name',
    'tiny-flux-schnell',
    '--use_synth_data',
    '--batch_size',
    '8',
    '--max_duration',
    '4ba',
    '--fp8',
]
# The published run's microbatch per A100-40GB; the card's 40 GiB less the CUDA context, in results' 10^9 bytes.
PUBLISHED_MICROBATCH, A100_40GB_USABLE_GB = 4, 40.0


class KeepSteps(Callback):
    """The UNet's weights at the start, and each batch's loss; the gradient of the first batch."""

    def __init__(self):
        # Not `init`: a callback's attributes named as events (Event.INIT is 'init') are called as handlers.
        self.losses, self.initial, self.first_gradient = [], None, None

    def fit_start(self, state, logger):
        self.initial = unet_tensors(state.model, lambda p: p)

    def after_backward(self, state, logger):
        if self.first_gradient is None:
            self.first_gradient = unet_tensors(state.model, lambda p: p.grad)

    def after_train_batch(self, state, logger):
        self.losses.append(state.loss.item())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, 'module') or hasattr(model, '_orig_mod'):  # DDP, FSDP, torch.compile
        model = model._orig_mod if hasattr(model, '_orig_mod') else model.module
    return model


def unet_tensors(model, pick) -> dict[str, torch.Tensor]:
    """{parameter name: pick(parameter)} of the trained network (the UNet, or a transformer), on the CPU in fp32,
    under names without FSDP's wrappers."""
    return {
        name.replace('_fsdp_wrapped_module.', ''): pick(p).detach().float().cpu().clone()
        for name, p in unwrap(model).denoiser.named_parameters()
        if pick(p) is not None
    }


@dataclass
class Run:
    results: dict
    losses: list[float]
    initial: dict[str, torch.Tensor]
    first_gradient: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    trainer: object


def train(tmp_path, *flags) -> Run:
    """benchmark.main with these flags: its results file, losses, first gradient and UNet weights."""
    keep = KeepSteps()
    results_json = tmp_path / f'results-{len(list(tmp_path.glob("results-*")))}.json'
    trainer = main(settled([*flags, '--results_json', str(results_json)]), callbacks=(keep,))
    final = unet_tensors(trainer.state.model, lambda p: p)
    return Run(json.loads(results_json.read_text()), keep.losses, keep.initial, keep.first_gradient, final, trainer)


def relative_difference(tensors: dict, reference: dict) -> float:
    assert tensors.keys() == reference.keys()
    difference = torch.cat([(tensors[name] - reference[name]).flatten() for name in reference])
    return (difference.norm() / torch.cat([tensor.flatten() for tensor in reference.values()]).norm()).item()


def update(run: Run) -> dict[str, torch.Tensor]:
    return {name: run.final[name] - run.initial[name] for name in run.initial}


def assert_same_step(run: Run, plain: Run, gradient_tolerance: float, update_tolerance: float | None) -> None:
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)
    assert relative_difference(run.initial, plain.initial) == 0  # the same seed, the same init
    assert run.losses[0] == pytest.approx(plain.losses[0], rel=gradient_tolerance)
    assert relative_difference(run.first_gradient, plain.first_gradient) < gradient_tolerance
    assert any(tensor.abs().max() > 0 for tensor in update(plain).values())  # the plain run stepped
    if update_tolerance is not None:
        assert relative_difference(update(run), update(plain)) < update_tolerance


@pytest.fixture(scope='module')
def plain_fp32(tmp_path_factory):
    return train(tmp_path_factory.mktemp('fp32'), *FP32)


@pytest.fixture(scope='module')
def plain_bf16(tmp_path_factory):
    return train(tmp_path_factory.mktemp('bf16'), *BF16)


# ------------------------------------------------------------------------------------------ defaults


def test_gpu_defaults_are_the_fast_recipe_and_the_published_run_on_request():
    fast = resolve_config(parse_args(['--use_synth_data']))
    assert fast.model.model_name == 'sd2-base' and any('a GPU is present' in note for note in fast.notes)
    assert (fast.data.image_size, fast.batch.batch_size) == (512, 2048)
    assert any('(planned)' in note for note in fast.notes)
    assert (fast.batch.precision, fast.speed.pin_memory, fast.data.num_workers) == ('amp_bf16', True, 8)
    published = resolve_config(parse_args(['--use_synth_data', '--recipe', 'published']))
    batch = published.batch
    assert (batch.device_train_microbatch_size, batch.precision, published.ema.use_ema) == (4, 'amp_fp16', True)


def test_tiny_model_trains_on_the_gpu_in_bf16(plain_bf16):
    run = plain_bf16
    model = unwrap(run.trainer.state.model)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)
    results = run.results
    assert results['device_type'] == 'gpu' and results['device_name'] == torch.cuda.get_device_name()
    assert results['img_per_sec'] > 0 and results['peak_gpu_memory_gb'] > 0
    assert results['config']['precision'] == 'amp_bf16' and results['config']['pin_memory'] is True
    if gpu_key(results['device_name']) in PEAK_FLOPS:  # MFU against the table's dense bf16 peak
        peak = PEAK_FLOPS[gpu_key(results['device_name'])]
        assert results['mfu'] == pytest.approx(results['flops_per_sec'] / (results['num_devices'] * peak))


# ------------------------------------------------------------------------------------------ SD2 base


def test_sd2_base_trains_the_published_microbatch_at_512px_within_an_a100_40gb(tmp_path):
    """SD2 base initialized on the GPU, a 512px microbatch of 4 in bf16 with the VAE and text encoder online:
    what the published run fitted in an A100-40GB."""
    flags = ['--model_name', 'sd2-base', '--use_synth_data', '--image_size', '512', '--batch_size', '4']
    run = train(tmp_path, *flags, '--device_train_microbatch_size', '4', '--max_duration', '3ba')
    model = unwrap(run.trainer.state.model)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert sum(p.numel() for p in model.unet.parameters()) == 865_910_724
    assert len(run.losses) == 3 and all(math.isfinite(loss) for loss in run.losses)
    results = run.results
    assert results['config']['precision'] == 'amp_bf16' and results['device_train_microbatch_size'] == 4
    assert 0 < results['peak_gpu_memory_gb'] < A100_40GB_USABLE_GB
    assert results['peak_gpu_memory_gb'] <= results['peak_gpu_memory_reserved_gb'] < A100_40GB_USABLE_GB
    if gpu_key(results['device_name']) in PEAK_FLOPS:
        assert 0 < results['mfu'] < 1
    # 3 x UNet forward + VAE encoder + text encoder at 512px: 3 x 0.80 + 1.12 + 0.045 TFLOP.
    assert results['flops_per_image'] == pytest.approx(3.58e12, rel=0.02)


def test_half_precision_predictions_match_fp32_on_the_same_batch(monkeypatch):
    """The UNet's prediction for one batch under autocast against fp32's (TF32 off): bf16 within 4% of its norm,
    fp16 within 0.5%, and neither equal to it (autocast took effect). Measured on a CPU: 1.3% and 0.16%. The loss
    is no test of this: dominated by the noise target, bf16 moved it by 0.005% there."""
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / 'sd2-base', precomputed=True, init_device='cuda')
    generator = torch.Generator('cuda').manual_seed(1)
    latents, noise = (torch.randn(2, 4, 32, 32, device='cuda', generator=generator) for _ in range(2))
    conditioning = {'encoder_hidden_states': torch.randn(2, 77, 1024, device='cuda', generator=generator)}
    timesteps = torch.tensor([100, 700], device='cuda')

    def prediction(dtype):
        with torch.no_grad(), torch.autocast('cuda', dtype=dtype, enabled=dtype != torch.float32):
            return model.predict(latents, conditioning, noise, timesteps)[0].float()

    fp32 = prediction(torch.float32)
    assert torch.isfinite(fp32).all() and fp32.abs().mean() > 0
    for dtype, tolerance in ((torch.bfloat16, 4e-2), (torch.float16, 5e-3)):
        error = ((prediction(dtype) - fp32).norm() / fp32.norm()).item()
        assert 1e-5 < error < tolerance, f'{dtype}: {error:.2e} of the prediction'


def sd2_unet_and_inputs():
    torch.manual_seed(0)
    unet = build_model(CONFIGS_DIR / 'sd2-base', precomputed=True, init_device='cuda').unet
    generator = torch.Generator('cuda').manual_seed(1)
    sample = torch.randn(2, 4, 32, 32, device='cuda', generator=generator)
    text = torch.randn(2, 77, 1024, device='cuda', generator=generator)
    return unet, (sample, torch.tensor([100, 700], device='cuda'), text)


def test_unet_attention_runs_a_flash_attention_kernel():
    """SDPA's own choice is a fused flash-attention kernel (PyTorch's FlashAttention-2 or cuDNN's, which
    newer PyTorch releases may prefer on Hopper), never the unfused math path, and it agrees with FlashAttention-2
    forced, to bf16 rounding (2 units in the last place of a unit-sized output: on an H100 with torch 2.11 the
    default differed from forced flash by up to 0.018, so it is not the same kernel there)."""
    unet, inputs = sd2_unet_and_inputs()
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises 'No available kernel' where flash cannot run
            forced = unet(*inputs).sample
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            default = unet(*inputs).sample
    names = {event.name for event in profile.events()}
    attention = sorted(name for name in names if any(word in name.lower() for word in ('attention', 'fmha', 'sdpa')))
    assert any('flash' in name.lower() for name in names), f'no flash kernel; attention kernels: {attention[:10]}'
    torch.testing.assert_close(default, forced, rtol=2e-2, atol=2e-2)


def test_xformers_attention_matches_sdpa(tmp_path):
    pytest.importorskip('xformers', reason='xFormers is not installed (no build for this torch)')
    unet, inputs = sd2_unet_and_inputs()
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        sdpa = unet(*inputs).sample
        unet.enable_xformers_memory_efficient_attention()
        xformers = unet(*inputs).sample
    torch.testing.assert_close(xformers, sdpa, rtol=2e-2, atol=2e-2)
    run = train(tmp_path, *RUN, '--attention', 'xformers')
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)


def test_auto_microbatching_finds_a_size_for_sd2_base_at_512px(tmp_path):
    flags = ['--model_name', 'sd2-base', '--use_synth_data', '--image_size', '512', '--batch_size', '16']
    run = train(tmp_path, *flags, '--device_train_microbatch_size', 'auto', '--max_duration', '2ba')
    found = run.results['device_train_microbatch_size']
    assert run.results['config']['device_train_microbatch_size'] == 'auto'
    assert found in (1, 2, 4, 8, 16), found
    assert len(run.losses) == 2 and all(math.isfinite(loss) for loss in run.losses)


@pytest.mark.parametrize('name', ['sd1.5', 'sd2-768-v', 'sdxl-base'])
def test_other_models_train_two_batches_at_256px(tmp_path, name):
    """Each built-in model, at full size, on the GPU in bf16: SDXL's two encoders, pooled embedding and size
    conditioning, v-prediction, OpenAI CLIP's quick_gelu."""
    flags = ['--model_name', name, '--use_synth_data', '--image_size', '256', '--batch_size', '2']
    run = train(tmp_path, *flags, '--device_train_microbatch_size', '1', '--max_duration', '2ba')
    model = unwrap(run.trainer.state.model)
    assert len(run.losses) == 2 and all(math.isfinite(loss) for loss in run.losses)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert run.results['model_name'] == name
    assert run.results['trained_parameters'] == sum(p.numel() for p in model.unet.parameters())
    assert run.results['peak_gpu_memory_gb'] > 0


@pytest.mark.parametrize('flags', [['--precomputed_latents'], ['--encoders_bf16']], ids=['precomputed', 'online'])
@pytest.mark.parametrize('name', ['sd3.5-medium', 'pixart-sigma'])
def test_diffusion_transformers_train_two_batches_at_256px(tmp_path, name, flags):
    """SD3.5 medium and PixArt-Sigma at full size in bf16 on one GPU, unsharded: from precomputed latents, and with
    the encoders online (T5-XXL in bf16)."""
    run = train(
        tmp_path,
        *['--model_name', name, '--use_synth_data', '--image_size', '256', '--batch_size', '2'],
        *['--device_train_microbatch_size', '1', '--max_duration', '2ba', *flags],
    )
    model = unwrap(run.trainer.state.model)
    assert len(run.losses) == 2 and all(math.isfinite(loss) for loss in run.losses)
    assert {p.device.type for p in model.parameters()} == {'cuda'}
    assert run.results['trained_parameters'] == sum(p.numel() for p in model.transformer.parameters())
    assert run.results['mfu'] > 0 and run.results['peak_gpu_memory_gb'] > 0


def test_flux_transformer_steps_at_256px_in_bf16():
    """Flux.1-schnell's 11.9B-parameter transformer, forward and backward of one 256px image in bf16 on one GPU
    (its fp32 training state needs FSDP over 8 GPUs of 80 GB, docs/models.md): the kernels run and the gradient is
    finite."""
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / 'flux-schnell', precomputed=True, init_device='cuda')
    model.transformer.to(torch.bfloat16)
    shapes = model.precomputed_shapes(256 // 8)
    batch = {
        'latent_mean': torch.randn(1, 16, 32, 32, device='cuda'),
        'latent_logvar': torch.full((1, 16, 32, 32), -10.0, device='cuda'),
        'text_embedding': torch.randn(1, shapes['caption_length'], shapes['embedding_dim'], device='cuda'),
        'pooled_text_embedding': torch.randn(1, shapes['pooled_dim'], device='cuda'),
    }
    with torch.autocast('cuda', dtype=torch.bfloat16):
        loss = model.loss(model(batch), batch)
    loss.backward()
    assert math.isfinite(loss.item())
    gradient = torch.cat([p.grad.float().flatten() for p in model.transformer.parameters() if p.grad is not None])
    assert torch.isfinite(gradient).all() and gradient.norm() > 0


# ------------------------------------------------------------------------------------------ speed flags


@pytest.mark.parametrize('flags', SPEED_FLAGS, ids=' '.join)
def test_speed_flags_keep_the_fp32_step(tmp_path, plain_fp32, flags):
    run = train(tmp_path, *FP32, *flags)
    assert_same_step(run, plain_fp32, gradient_tolerance=1e-2, update_tolerance=5e-2)
    if flags == ['--channels_last']:
        conv = unwrap(run.trainer.state.model).unet.conv_in.weight
        assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()


def test_compiled_steps_compile_the_forward_once(tmp_path):
    """Diffusers' add_noise moves the scheduler's alphas_cumprod to the batch's device inside the compiled forward;
    the model moves it when it moves to the GPU (FrozenEncodersModel._apply), so no step after the first
    recompiles (each recompile of SD2 base costs minutes)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    run = train(tmp_path, *BF16, '--compile')
    assert unwrap(run.trainer.state.model).noise_scheduler.alphas_cumprod.device.type == 'cuda'
    assert counters['stats']['unique_graphs'] == 1, f'{counters["stats"]["unique_graphs"]} graphs for 4 steps'


@pytest.mark.parametrize('mode', COMPILE_MODES)
def test_compile_modes_train_the_bf16_step(tmp_path, plain_bf16, mode, capfd):
    run = train(tmp_path, *BF16, '--compile', mode)
    assert run.results['config']['compile'] == mode
    assert_same_step(run, plain_bf16, gradient_tolerance=5e-2, update_tolerance=None)  # the eager step's gradient
    assert 'without CUDA graphs' not in capfd.readouterr().out  # reduce-overhead: every graph captured


def test_activation_checkpointing_keeps_the_bf16_step(tmp_path, plain_bf16):
    run = train(tmp_path, *BF16, '--activation_checkpointing')
    assert_same_step(run, plain_bf16, gradient_tolerance=5e-2, update_tolerance=None)


def test_fp8_trains_a_transformer_twin(tmp_path, capfd):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip('float8 matmuls need compute capability 8.9 (an H100, H200 or newer)')
    run = train(tmp_path, *FP8_FLUX)
    assert "of the transformer's linear layers train in float8" in capfd.readouterr().out
    assert run.results['config']['fp8'] and all(math.isfinite(loss) for loss in run.losses)


def test_the_planned_microbatch_fits_the_gpu(tmp_path):
    """SD2 base from precomputed latents at the microbatch the plan gives this GPU: it trains, and its peak
    memory stays under the plan's total (the margin is calibrated on an H100)."""
    planned = resolve_config(parse_args(['--use_synth_data', '--precomputed_latents']))
    microbatch = planned.batch.device_train_microbatch_size
    flags = ['--use_synth_data', '--precomputed_latents', '--batch_size', str(microbatch), '--max_duration', '3ba']
    run = train(tmp_path, *flags)
    assert run.results['device_train_microbatch_size'] == microbatch == planned.batch.memory_plan.microbatch >= 8
    assert run.results['peak_gpu_memory_gb'] < planned.batch.memory_plan.total / 1e9


@pytest.mark.parametrize('flags', BF16_FLAGS, ids=' '.join)
def test_bf16_flags_keep_the_bf16_step(tmp_path, plain_bf16, flags):
    run = train(tmp_path, *BF16, *flags)
    assert_same_step(run, plain_bf16, gradient_tolerance=5e-2, update_tolerance=None)
    if flags == ['--encoders_bf16']:
        assert {p.dtype for p in unwrap(run.trainer.state.model).vae.parameters()} == {torch.bfloat16}


def test_fsdp_shard_grad_op_on_one_gpu_matches_the_unsharded_run(tmp_path, plain_fp32):
    """On one GPU the unsharded run is what DDP runs on each rank; FSDP's gradients live in its flat buffers, so
    the comparison is of the first loss and the update."""
    run = train(tmp_path, *FP32, '--fsdp', 'shard_grad_op')
    assert run.results['config']['fsdp'] == 'shard_grad_op'
    assert run.losses[0] == pytest.approx(plain_fp32.losses[0], rel=1e-2)
    assert relative_difference(update(run), update(plain_fp32)) < 5e-2


def test_ema_offload_matches_the_average_on_the_gpu(tmp_path):
    flags = [*FP32, '--use_ema', '--ema_half_life', '2ba']
    on_gpu, offloaded = train(tmp_path, *flags), train(tmp_path, *flags, '--ema_offload')
    for run, device in ((on_gpu, 'cuda'), (offloaded, 'cpu')):
        ema = next(algorithm for algorithm in run.trainer.state.algorithms if isinstance(algorithm, EMA))
        assert ema.weights.flat.device.type == device
    averages = [
        {k: v.float().cpu() for k, v in final_weights(run.trainer).items() if k.startswith('ema.')}
        for run in (on_gpu, offloaded)
    ]
    init = {f'ema.{name}': tensor for name, tensor in on_gpu.initial.items()}
    moved = [{name: average[name] - init[name] for name in init} for average in averages]
    assert relative_difference(moved[1], moved[0]) < 5e-2
    trained = {f'ema.{name}': tensor - on_gpu.initial[name] for name, tensor in on_gpu.final.items()}
    assert relative_difference(moved[0], trained) > 0.1  # an average, not the trained weights


@pytest.mark.parametrize('flags', OTHER_PATHS, ids=' '.join)
def test_other_paths_train_on_the_gpu(tmp_path, flags):
    """Each path trains, and took effect: the microbatch split the batch, FSDP sharded the UNet by block and the
    average followed every step from its shards, the precomputed run built no VAE."""
    run = train(tmp_path, *RUN, *flags)
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)
    assert run.results['img_per_sec'] > 0
    assert any(not torch.equal(run.final[name], run.initial[name]) for name in run.initial), 'no weight moved'
    config, model = run.results['config'], run.trainer.state.model
    if '--device_train_microbatch_size' in flags:
        assert config['device_train_microbatch_size'] == run.results['device_train_microbatch_size'] == 2
        assert config['device_batch_size'] > 2  # so more than one microbatch a step
    if '--fsdp' in flags:
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = {
            name.replace('_fsdp_wrapped_module.', '')
            for name, module in model.named_modules()
            if isinstance(module, FullyShardedDataParallel)
        }
        blocks = {f'unet.{part}_blocks.{i}' for part in ('down', 'up') for i in range(4)}
        assert units == {'unet', 'unet.mid_block', *blocks} and config['fsdp'] == 'full_shard'
        (ema,) = [algorithm for algorithm in run.trainer.state.algorithms if isinstance(algorithm, EMA)]
        assert ema.num_updates == 4 and ema.weights.sharded
    if '--precomputed_latents' in flags:
        assert config['precomputed_latents'] and model.vae is None


# ------------------------------------------------------------------------------------------ real data


def test_pinned_memory_and_8_workers_stream_the_sample_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(run_data, 'SAMPLE_DATASET', tmp_path / 'sample-mds')
    run = train(tmp_path, '--model_name', 'tiny', '--image_size', '64', '--batch_size', '8', '--max_duration', '4ba')
    assert (tmp_path / 'sample-mds' / 'index.json').is_file()
    loader = run.trainer.state.train_dataloader
    assert loader.pin_memory and loader.num_workers == 8
    assert run.results['config']['pin_memory'] is True and run.results['config']['num_workers'] == 8
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)


def test_precompute_on_the_gpu_then_training_from_its_output(tmp_path):
    source = ensure_sample_dataset(tmp_path / 'source', num_samples=40)  # samples 13 and 26 are broken
    torch.cuda.reset_peak_memory_stats()
    counts = precompute.main(
        ['--local', str(source), '--out', str(tmp_path / 'latents'), '--model_name', 'tiny', '--image_size', '64']
    )
    assert counts['encoded'] == 38 and counts['bad'] == 2
    assert torch.cuda.max_memory_allocated() > 0  # the encoders ran on the GPU
    flags = ['--model_name', 'tiny', '--precomputed_latents', '--local', str(tmp_path / 'latents')]
    run = train(tmp_path, *flags, '--batch_size', '8', '--max_duration', '4ba')
    assert len(run.losses) == 4 and all(math.isfinite(loss) for loss in run.losses)
    assert unwrap(run.trainer.state.model).vae is None


# ------------------------------------------------------------------------------------------ pipelines


@pytest.mark.parametrize('name', ['tiny', 'tiny-flux-schnell', 'tiny-sd3.5-medium', 'tiny-pixart-sigma'])
def test_sample_grids_and_the_exported_pipeline_on_the_gpu(tmp_path, name):
    """Each model's Diffusers pipeline on CUDA: sample grids under bf16 autocast during training, the export, and
    generate.py, whose images from the folder and from the checkpoint agree."""
    samples, pipe, checkpoints = tmp_path / 'samples', tmp_path / 'pipe', tmp_path / 'ckpt'
    flags = ['--model_name', name, '--local', write_dataset(tmp_path / 'mds', good_samples(8)), '--image_size', '32']
    flags += ['--batch_size', '4', '--max_duration', '2ba', '--sample_interval', '2ba', '--sample_steps', '2']
    flags += ['--sample_dir', str(samples), '--export_pipeline', str(pipe)]
    flags += ['--save_folder', str(checkpoints), '--save_interval', '2ba']
    tokenizer = [] if name == 'tiny' else ['--tokenizer', write_t5_tokenizer(tmp_path / 't5')]
    main(settled([*flags, *tokenizer]))
    assert sorted(path.name for path in samples.iterdir()) == ['samples-ba000000.png', 'samples-ba000002.png']
    common = ['--prompt', 'a red circle', '--steps', '2', '--image_size', '32']
    from_folder = generate.main(generate.parse_args([*common, '--pipeline', str(pipe), '--out', str(tmp_path / 'a')]))
    checkpoint = ['--checkpoint', str(checkpoints / 'latest-rank0.pt'), '--model_name', name, *tokenizer]
    from_checkpoint = generate.main(generate.parse_args([*common, *checkpoint, '--out', str(tmp_path / 'b')]))
    assert from_folder.shape == (1, 3, 32, 32) and torch.isfinite(from_folder).all()
    torch.testing.assert_close(from_folder, from_checkpoint, atol=2e-3, rtol=0)
