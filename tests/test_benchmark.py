"""CPU tests of the SD2 ComposerModel, its FLOP count, the CLI checks and the end-to-end entry point."""

import dataclasses
import json
import re
import struct
import sys
import types

import pytest
import torch
from composer.core import Callback
from composer.utils import reproducibility
from conftest import REPO, TINY, free_port, run_cli, settled
from diffusers import DDPMScheduler
from diffusers.models.attention_processor import Attention
from torch.utils.data import DataLoader, Dataset
from transformers.models.clip.modeling_clip import CLIPAttention

from data import SyntheticImageCaptionDataset
from guards.arguments import ConfigError
from models import stable_diffusion as model_module
from models.stable_diffusion import build_model
from runs import training
from runs.run import main
from runs.training import build_dataloader, build_trainer
from settings import model_folder, output_paths
from settings.config import resolve_config
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR, resolve_model_dir


def tiny_model(seed=0):
    reproducibility.seed_all(seed)
    return build_model(CONFIGS_DIR / 'tiny')


def synthetic_batch(n, image_size=64):
    dataset = SyntheticImageCaptionDataset(image_size)
    return torch.utils.data.default_collate([dataset[i] for i in range(n)])


def fixed_randomness(batch, seed=1):
    """Noise, timesteps and latent draw fixed per sample, so a step is a pure function of the batch."""
    generator = torch.Generator().manual_seed(seed)
    n, _, height, width = batch['image'].shape
    latent_shape = (n, 4, height // 8, width // 8)
    return {
        **batch,
        'noise': torch.randn(latent_shape, generator=generator),
        'latent_noise': torch.randn(latent_shape, generator=generator),
        'timesteps': torch.randint(0, 1000, (n,), generator=generator),
    }


# ------------------------------------------------------------------------------------------ model


def test_forward_and_loss_shapes():
    model = tiny_model()
    batch = synthetic_batch(3)
    prediction, target = model(batch)
    assert prediction.shape == target.shape == (3, 4, 8, 8)
    loss = model.loss((prediction, target), batch)
    assert loss.shape == () and torch.isfinite(loss) and loss > 0


def test_targets_follow_prediction_type():
    batch = fixed_randomness(synthetic_batch(2))
    reproducibility.seed_all(0)
    _, epsilon_target = build_model(CONFIGS_DIR / 'tiny')(batch)
    assert torch.equal(epsilon_target, batch['noise'])
    reproducibility.seed_all(0)
    v_model = build_model(CONFIGS_DIR / 'tiny', prediction_type='v_prediction')
    _, v_target = v_model(batch)
    assert not torch.allclose(v_target, batch['noise'])
    # v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0, so x0 recovers from (noise, v).
    alpha_bar = v_model.noise_scheduler.alphas_cumprod[batch['timesteps']].view(-1, 1, 1, 1)
    latents = (alpha_bar.sqrt() * batch['noise'] - v_target) / (1 - alpha_bar).sqrt()
    with torch.no_grad():
        dist = v_model.vae.encode(batch['image']).latent_dist
    expected = (dist.mean + dist.std * batch['latent_noise']) * 0.18215
    torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tiny_model_overfits_a_fixed_batch():
    model = tiny_model()
    batch = fixed_randomness(synthetic_batch(4))
    optimizer = torch.optim.AdamW(model.unet.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model.loss(model(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_frozen_modules_are_untouched_by_training():
    trainer = main(settled(TINY + ['--batch_size', '4', '--max_duration', '3ba']))
    trained = trainer.state.model
    fresh = tiny_model(seed=17)  # main() seeds the init with --seed 17
    for name in ('vae', 'text_encoder'):
        module = getattr(trained, name)
        assert not module.training, f'{name} left eval mode'
        for (key, value), (_, initial) in zip(module.state_dict().items(), getattr(fresh, name).state_dict().items()):
            assert torch.equal(value, initial), f'{name}.{key} changed during training'
        assert all(not p.requires_grad and p.grad is None for p in module.parameters())
    changed = [not torch.equal(a, b) for a, b in zip(trained.unet.parameters(), fresh.unet.parameters())]
    assert all(changed), 'every UNet parameter should have been updated'
    optimized = {id(p) for group in trainer.state.optimizers[0].param_groups for p in group['params']}
    assert optimized == {id(p) for p in trained.unet.parameters()}


def test_sd2_base_configs_match_the_published_architecture():
    model = build_model(
        CONFIGS_DIR / 'sd2-base', init_device='meta'
    )  # benchmark.py passes the GPU; meta: no memory, no time
    assert {p.device.type for p in model.parameters()} == {'meta'}
    counts = [sum(p.numel() for p in part.parameters()) for part in (model.unet, model.vae, model.text_encoder)]
    assert counts == [865_910_724, 83_653_863, 340_387_840]
    assert model.latent_scale == 0.18215
    schedule = DDPMScheduler.from_pretrained(CONFIGS_DIR / 'sd2-base', subfolder='scheduler')
    assert schedule.config.num_train_timesteps == 1000
    assert schedule.config.prediction_type == 'epsilon'
    assert schedule.config.clip_sample is False
    torch.testing.assert_close(schedule.betas[[0, -1]], torch.tensor([0.00085, 0.012]))
    # scaled_linear: betas are squares of a linear ramp between the square roots.
    torch.testing.assert_close(
        schedule.betas[500].sqrt(), (torch.tensor(0.00085).sqrt() + torch.tensor(0.012).sqrt()) / 2, rtol=2e-3, atol=0
    )


def test_microbatching_gives_the_same_gradients():
    batch = fixed_randomness(synthetic_batch(8))

    class FixedBatch(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {key: value[i] for key, value in batch.items()}

    class KeepGradients(Callback):
        # Composer zeroes gradients at the end of fit(), so copy them right after the step's backward passes.
        def after_train_batch(self, state, logger):
            self.gradients = [p.grad.clone() for p in state.model.unet.parameters()]

    gradients = {}
    for microbatch in (8, 2):
        args = resolve_config(
            parse_args(
                TINY + ['--batch_size', '8', '--max_duration', '1ba', '--device_train_microbatch_size', str(microbatch)]
            )
        )
        model = tiny_model()
        trainer = build_trainer(args, model, DataLoader(FixedBatch(), batch_size=8))
        keep = KeepGradients()
        trainer.state.callbacks.append(keep)
        trainer.fit()
        gradients[microbatch] = keep.gradients
    for whole, accumulated in zip(gradients[8], gradients[2]):
        torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-6)


def test_a_trainer_records_the_cpus_name_without_starting_an_interpreter(monkeypatch):
    """Each Trainer records the machine it runs on; py-cpuinfo's CPU name would start a Python interpreter (a second
    of every rank's start). runs.training has Composer read it from /proc/cpuinfo, as the results file does."""
    import cpuinfo
    from composer.utils import collect_env

    from costs.results import cpu_name

    def asked():
        raise AssertionError('py-cpuinfo was asked for the CPU')

    monkeypatch.setattr(cpuinfo, 'get_cpu_info', asked)
    assert collect_env.get_composer_env_dict()['cpu_model'] == cpu_name() != ''


def test_compile_modes_reach_composers_compile_config():
    assert parse_args(['--compile']).compile == 'default'
    assert training.compile_config(None) is None and training.compile_config('default') == {'dynamic': False}
    assert training.compile_config('reduce-overhead') == {'dynamic': False, 'mode': 'reduce-overhead'}
    assert training.compile_config('max-autotune-no-cudagraphs')['mode'] == 'max-autotune-no-cudagraphs'


@pytest.mark.slow
def test_a_compile_that_fails_stops_in_one_line_naming_the_flag(monkeypatch, capfd):
    """A backend that raises, as a failed CUDA graph capture or Inductor compile does on a GPU."""
    from runs import run

    def failing_backend(graph, inputs):
        raise RuntimeError('capture failed')

    monkeypatch.setattr(training, 'EXTRA_COMPILE_OPTIONS', {'backend': failing_backend})
    config = resolve_config(parse_args(TINY + ['--batch_size', '4', '--max_duration', '1ba', '--num_workers', '0']))
    with pytest.raises(SystemExit) as stopped:
        compiled = dataclasses.replace(config.speed, compile='default')  # refused on CPU by resolve_config
        run.main_reporting_errors(dataclasses.replace(config, speed=compiled))
    error = capfd.readouterr().err.strip().splitlines()[-1].split('\x1b[A')[-1]  # after the progress bar's
    assert stopped.value.code == 1
    assert error.startswith('error: --compile default: ') and 'RuntimeError: capture failed' in error
    assert error.endswith('; run without --compile, or with another mode')


@pytest.mark.slow
@pytest.mark.parametrize('data', ['online', 'precomputed'])
def test_compile_traces_the_whole_step_in_one_graph_and_trains_as_eager(monkeypatch, data):
    """--compile through Composer: Dynamo must trace the forward (encoders, noise draw, UNet) without graph breaks,
    each of which would cost speed on a GPU. The aot_eager backend runs Dynamo and AOT autograd as on a GPU but
    skips Inductor's code generation, which needs a GPU here (its C++ codegen for CPU fails on this model)."""
    from torch._dynamo.utils import counters

    class KeepLosses(Callback):
        def __init__(self):
            self.losses = []

        def after_train_batch(self, state, logger):
            self.losses.append(state.loss.item())

    monkeypatch.setattr(training, 'EXTRA_COMPILE_OPTIONS', {'backend': 'aot_eager'})
    flags = TINY + ['--batch_size', '4', '--max_duration', '3ba', '--num_workers', '0']
    losses, forwards = {}, {}
    for compiled in (False, True):
        args = resolve_config(parse_args(flags + (['--precomputed_latents'] if data == 'precomputed' else [])))
        # resolve_config refuses --compile on CPU (Inductor)
        args = dataclasses.replace(args, speed=dataclasses.replace(args.speed, compile='default' if compiled else None))
        torch._dynamo.reset()
        counters.clear()
        keep = KeepLosses()
        reproducibility.seed_all(0)
        model = build_model(CONFIGS_DIR / 'tiny', precomputed=args.data.precomputed_latents)
        loader = build_dataloader(args.data, args.batch, args.speed, args.model.caption_inputs, model)
        trainer = build_trainer(args, model, loader, callbacks=(keep,))
        forwards[compiled] = trainer.state.model.forward
        trainer.fit()
        losses[compiled] = keep.losses
    assert hasattr(forwards[True], '_torchdynamo_orig_callable') and not hasattr(
        forwards[False], '_torchdynamo_orig_callable'
    )
    # One graph for the three steps: a recompile (e.g. on a scheduler table moved to the device inside the forward)
    # would double the compile time on a GPU.
    assert counters['stats']['unique_graphs'] == 1, f'{counters["stats"]["unique_graphs"]} graphs compiled'
    assert not counters['graph_break'], f'graph breaks: {dict(counters["graph_break"])}'
    assert len(losses[True]) == 3
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------ FLOPs


def analytic_forward_flops(module, run):
    """An independent count from module hooks: 2*MACs of every conv and linear, plus attention matmuls."""
    total = 0

    def conv(m, inputs, output):
        nonlocal total
        total += 2 * output.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]

    def linear(m, inputs, output):
        nonlocal total
        total += 2 * (output.numel() // m.out_features) * m.in_features * m.out_features

    def diffusers_attention(m, args, kwargs):
        nonlocal total
        hidden = args[0] if args else kwargs['hidden_states']
        queries = hidden.shape[2] * hidden.shape[3] if hidden.ndim == 4 else hidden.shape[1]
        context = kwargs.get('encoder_hidden_states')
        keys = queries if context is None else context.shape[1]
        total += 2 * 2 * hidden.shape[0] * queries * keys * m.inner_dim  # QK^T and attention @ V

    def clip_attention(m, args, kwargs):
        nonlocal total
        hidden = args[0] if args else kwargs['hidden_states']
        total += 2 * 2 * hidden.shape[0] * hidden.shape[1] ** 2 * m.embed_dim

    handles = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.Conv2d):
            handles.append(sub.register_forward_hook(conv))
        elif isinstance(sub, torch.nn.Linear):
            handles.append(sub.register_forward_hook(linear))
        elif isinstance(sub, Attention):
            handles.append(sub.register_forward_pre_hook(diffusers_attention, with_kwargs=True))
        elif isinstance(sub, CLIPAttention):
            handles.append(sub.register_forward_pre_hook(clip_attention, with_kwargs=True))
    with torch.no_grad():
        output = run()
    for handle in handles:
        handle.remove()
    return total, output


@pytest.mark.parametrize('image_size', [64, 128])
def test_flops_match_an_independent_count(image_size):
    model = tiny_model()
    batch = synthetic_batch(1, image_size)
    vae, latents = analytic_forward_flops(model.vae, lambda: model.vae.encode(batch['image']).latent_dist.mean)
    text, context = analytic_forward_flops(model.text_encoder, lambda: model.text_encoder(batch['input_ids'])[0])
    unet, _ = analytic_forward_flops(model.unet, lambda: model.unet(latents, torch.tensor([10]), context))
    assert min(vae, text, unet) > 0
    assert model.flops_per_image(image_size, image_size) == 3 * unet + vae + text
    assert model.flops_per_batch(synthetic_batch(5, image_size)) == 5 * (3 * unet + vae + text)


def test_sd2_flops_match_the_reference_figures():
    with torch.device('meta'):
        model = build_model(CONFIGS_DIR / 'sd2-base')
    parts = model_module.count_forward_flops(
        model.unet.config, model.vae.config, [model.text_encoder.config], 512, 512, 77
    )
    # Published SD2 base figures: UNet 0.80, VAE encoder 1.12, text encoder 0.045 TFLOP forward;
    # 3.58 per training image.
    assert parts['unet'] == pytest.approx(0.80e12, rel=0.01)
    assert parts['vae_encoder'] == pytest.approx(1.12e12, rel=0.01)
    assert parts['text_encoder'] == pytest.approx(0.045e12, rel=0.01)
    assert model.flops_per_image(512, 512) == pytest.approx(3.58e12, rel=0.01)


# ------------------------------------------------------------------------------------------ W&B


def wandb_record_keys(run_file) -> dict[str, set[str]]:
    """The keys of the history rows, config and summary updates in a W&B run file (run-*.wandb): by kind of
    record. The file is a LevelDB-style log, a 7-byte header
    (':W&B', 0xBEE1, a version) then 32 KiB blocks of chunks (CRC32, length, type: 1 whole, 2 first, 3 middle,
    4 last) holding wandb's Record protobufs. Read here rather than through wandb: its current releases have no
    Python reader."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b':W&B'
    keys, pending, offset = {'history': set(), 'config': set(), 'summary': set()}, b'', 7
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a chunk header is padding
            offset += 32768 - offset % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[offset : offset + 7])
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b''
            if record.HasField('run'):  # the config given to wandb.init
                keys['config'] |= {item.key for item in record.run.config.update}
            for kind, items in (('history', 'item'), ('config', 'update'), ('summary', 'update')):
                if record.HasField(kind):
                    keys[kind] |= {
                        item.key or '/'.join(item.nested_key) for item in getattr(getattr(record, kind), items)
                    }
    return keys


@pytest.mark.stack
def test_wandb_offline_run_holds_the_configuration_history_and_headline_without_a_network(tmp_path, monkeypatch, capfd):
    """--wandb_project on the installed wandb (0.18 on the pins, the newest on today's stack, where Composer's
    logger needed an alias for Run.get_url), offline, with no W&B server reachable (wandb 0.18 asked one for its
    version at every image logged offline, and retried forever), sample grids logged: the run ends, and its run
    file holds the resolved configuration, SpeedMonitor's throughput (not per token) and the results' headline."""
    pytest.importorskip('wandb', reason='wandb is not installed (requirements-current.txt leaves it out)')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    monkeypatch.setenv('WANDB_BASE_URL', f'http://127.0.0.1:{free_port()}')  # nothing listens: refused
    flags = [*TINY, '--max_duration', '4ba', '--wandb_project', 'p', '--wandb_name', 'n']
    flags += ['--sample_interval', '2ba', '--sample_steps', '2', '--sample_dir', str(tmp_path / 'samples')]
    trainer = main(settled(flags))
    assert 'URL not available in offline run' not in capfd.readouterr().err  # Composer asked; not shown
    trainer.close()  # Composer finishes the W&B run
    # As at exit: wandb's own atexit hook. Finishing a run only asks wandb's service to close the run file, without
    # waiting; teardown waits for the service, so the file is complete (a loaded machine read it half-written).
    import wandb

    wandb.teardown()
    (run_file,) = tmp_path.glob('wandb/offline-run-*/run-*.wandb')
    keys = wandb_record_keys(run_file)
    assert {'throughput/samples_per_sec', 'throughput/flops_per_sec', 'loss/train/total'} <= keys['history']
    assert any(key.startswith('samples/trained') for key in keys['history'])  # the grid, as Composer logs it
    # Its images in the run's folder, which `wandb sync` uploads (in a table, wandb kept them elsewhere).
    grids = sorted(path.name.split('_')[1] for path in run_file.parent.glob('files/media/images/samples/trained_*.png'))
    assert grids == ['0', '2', '4']  # at the start, and after batches 2 and 4
    assert not [key for key in keys['history'] if 'tokens_per_sec' in key]
    assert {'model_name', 'image_size', 'run_recipe', 'batch_size'} <= keys['config'], sorted(keys['config'])
    assert {'img_per_sec', 'img_per_sec_per_device', 'train_seconds', 'sample_seconds'} <= keys['summary']


@pytest.mark.slow
def test_an_online_wandb_run_without_a_reachable_server_goes_on_offline(tmp_path, monkeypatch, capfd):
    """Online, with an API key, and no W&B server reachable: wandb gives up after its init_timeout, and the run goes
    on logging offline with a line saying so, rather than ending."""
    pytest.importorskip('wandb', reason='wandb is not installed (requirements-current.txt leaves it out)')
    monkeypatch.delenv('WANDB_MODE', raising=False)
    monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    monkeypatch.setenv('WANDB_API_KEY', 'x' * 40)
    monkeypatch.setenv('WANDB_BASE_URL', f'http://127.0.0.1:{free_port()}')  # nothing listens: refused
    monkeypatch.setenv('WANDB_INIT_TIMEOUT', '5')
    trainer = main(settled([*TINY, '--max_duration', '2ba', '--wandb_project', 'p', '--wandb_name', 'n']))
    assert int(trainer.state.timestamp.batch) == 2
    trainer.close()
    import wandb

    wandb.teardown()
    out = capfd.readouterr().out
    assert re.search(
        r'^warning: W&B: .*: the run goes on logging to W&B offline \(wandb sync uploads it later\)$', out, re.M
    )
    assert list(tmp_path.glob('wandb/offline-run-*/run-*.wandb'))


def test_wandb_project_without_wandb_is_refused_at_start(monkeypatch):
    real_find_spec = output_paths.importlib.util.find_spec
    monkeypatch.setattr(
        output_paths.importlib.util, 'find_spec', lambda name: None if name == 'wandb' else real_find_spec(name)
    )
    with pytest.raises(ConfigError, match='^--wandb_project needs the wandb package: pip install wandb'):
        resolve_config(parse_args([*TINY, '--wandb_project', 'p']))


# ----------------------------------------------------------------------------------- CLI and checks


def test_published_flags_keep_their_names_and_defaults():
    args = parse_args(
        [
            '--batch_size',
            '2048',
            '--image_size',
            '512',
            '--remote',
            's3://b/p',
            '--local',
            '/tmp/x',
            '--use_synth_data',
            '--model_name',
            'sd2-base',
            '--use_ema',
            '--wandb_name',
            'n',
            '--wandb_project',
            'p',
            '--device_train_microbatch_size',
            '4',
        ]
    )
    assert (args.batch_size, args.image_size, args.device_train_microbatch_size) == (2048, 512, '4')
    # Left unset, they resolve to the published run: 512px, global batch 2048 in microbatches of 4.
    published = resolve_config(parse_args(['--model_name', 'sd2-base', '--use_synth_data']))
    batch = published.batch
    assert (published.data.image_size, batch.batch_size, batch.device_train_microbatch_size) == (512, 2048, 4)
    assert (published.model.attention, published.ema.use_ema, published.batch.fsdp) == ('sdpa', False, 'none')


def test_the_model_line_names_the_parts_randomly_initialized(capfd):
    from models.stable_diffusion import describe_weights

    main(settled([*TINY, '--max_duration', '1ba']))
    assert f"model 'tiny' from {CONFIGS_DIR / 'tiny'}: random init: unet, vae, text_encoder\n" in capfd.readouterr().out
    assert describe_weights(['unet', 'vae', 'text_encoder'], []) == 'random init: unet, vae, text_encoder'
    assert describe_weights(['unet', 'vae'], ['vae']) == 'weights loaded: vae; random init: unet'
    assert describe_weights(['vae'], ['vae']) == 'weights loaded: vae'


def test_cpu_defaults_to_the_tiny_preset_and_says_so():
    args = resolve_config(parse_args(['--use_synth_data']))
    assert (args.model.model_name, args.data.image_size, args.batch.precision) == ('tiny', 64, 'fp32')
    assert any("using 'tiny'" in note for note in args.notes)  # main() prints the notes first


def test_a_model_folders_own_tokenizer_is_named_where_the_builtin_one_is_used(tmp_path):
    """A model folder with its tokenizer/: the run took the built-in CLIP tokenizer without a word (the run
    description said "tokenizer": null). The start lines say which one, and how to use the folder's."""
    folder = tmp_path / 'model'
    write_model_folder(folder, skip=None)
    (folder / 'tokenizer').mkdir()
    run = ['--model_name', str(folder), '--image_size', '32']
    said = f"tokenizer: the built-in CLIP tokenizer (CLIP's ids), not the model folder's {folder / 'tokenizer'}"
    assert any(note.startswith(said) for note in settled(run).notes)
    assert not any(note.startswith('tokenizer:') for note in settled([*run, '--use_synth_data']).notes)


def write_model_folder(root, skip):
    for name in model_folder.CONFIG_FILES:
        if name != skip:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text((CONFIGS_DIR / 'tiny' / name).read_text())


@pytest.mark.parametrize(
    'flags, message',
    [
        (
            ['--batch_size', '10', '--device_train_microbatch_size', '4'],
            '--batch_size 10 over 1 device gives 10 samples per device, which is not divisible by '
            '--device_train_microbatch_size 4: choose a microbatch that divides 10, or a batch size divisible by 1 x 4',
        ),
        (
            ['--batch_size', '10', '--device_train_microbatch_size', '20'],
            '10 samples per device, fewer than --device_train_microbatch_size 20: choose a microbatch that divides 10',
        ),
        (['--device_train_microbatch_size', 'auto'], 'auto needs a GPU'),
        (['--device_train_microbatch_size', 'four'], "'four': pass a positive integer"),
        (['--precision', 'amp_bf16'], '--precision amp_bf16 needs a GPU'),
        (['--precision', 'amp_fp16'], '--precision amp_fp16 needs a GPU'),
        (['--image_size', '100'], 'multiple of 8'),
        (['--max_duration', 'forever'], "--max_duration 'forever'"),
        (['--autoresume'], '--autoresume needs --save_folder and --run_name'),
        (['--max_duration', '0ba'], '--max_duration 0ba: must be positive'),
        (['--max_duration=-5ba'], '--max_duration -5ba: must be positive'),
        (['--max_duration', '1.5ep'], "--max_duration '1.5ep': value 1.5 is not an integer"),
        (['--save_interval', '0ba'], '--save_interval 0ba: must be positive'),
        (['--save_interval', 'garbage'], "--save_interval 'garbage'"),
        (['--device_train_microbatch_size', '0'], '--device_train_microbatch_size 0: must be positive'),
        (['--device_train_microbatch_size', '-4'], '--device_train_microbatch_size -4: must be positive'),
    ],
)
def test_bad_flags_fail_fast_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
        resolve_config(parse_args(TINY + flags))


def test_batch_not_divisible_by_world_size(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '3')  # as Composer's launcher sets it for 3 processes
    with pytest.raises(ConfigError, match='--batch_size 16 is not divisible by the world size 3'):
        resolve_config(parse_args(TINY + ['--batch_size', '16']))


def test_save_folder_with_checkpoints_needs_autoresume(tmp_path):
    (tmp_path / 'ep0-ba2-rank0.pt').write_bytes(b'an earlier run')
    flags = TINY + ['--save_folder', str(tmp_path), '--run_name', 'earlier']
    with pytest.raises(ConfigError, match='is not empty; .* pass --autoresume'):
        resolve_config(parse_args(flags))
    resolve_config(parse_args(flags + ['--autoresume']))
    assert (tmp_path / 'ep0-ba2-rank0.pt').read_bytes() == b'an earlier run'


def test_output_paths_are_checked_before_anything_is_built(tmp_path):
    a_file = tmp_path / 'a-file'
    a_file.write_text('not a folder')
    with pytest.raises(ConfigError, match=f'--results_json {a_file}/results.json: {a_file} is a file'):
        resolve_config(parse_args(TINY + ['--results_json', str(a_file / 'results.json')]))
    with pytest.raises(ConfigError, match=f'--results_json {tmp_path}: is a folder'):
        resolve_config(parse_args(TINY + ['--results_json', str(tmp_path)]))
    flags = ['--save_folder', str(a_file), '--run_name', 'run', '--autoresume']
    with pytest.raises(ConfigError, match=f'--save_folder {a_file}: is a file, not a folder of checkpoints'):
        resolve_config(parse_args(TINY + flags))
    resolve_config(parse_args(TINY + ['--results_json', str(tmp_path / 'new' / 'deeper' / 'results.json')]))


def test_xformers_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, 'xformers', None)  # makes `import xformers` raise ImportError
    with pytest.raises(ConfigError, match='xformers is not installed'):
        resolve_config(parse_args(TINY + ['--attention', 'xformers']))


def test_xformers_installed_needs_a_gpu(monkeypatch):
    # xformers builds exist for a few torch releases only (none for today's): a stand-in module, as if installed
    monkeypatch.setitem(sys.modules, 'xformers', types.ModuleType('xformers'))
    with pytest.raises(ConfigError, match='xFormers attention runs on CUDA GPUs only'):
        resolve_config(parse_args(TINY + ['--attention', 'xformers']))


def test_unknown_model_and_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--model_name 'sd3-huge': not a built-in model .* no such folder$"):
        resolve_model_dir('sd3-huge')
    with pytest.raises(ConfigError, match="no such folder; did you mean 'sd2-base'\\?$"):
        resolve_model_dir('sd2base')
    write_model_folder(tmp_path, skip='vae/config.json')
    with pytest.raises(ConfigError, match='missing config file.*vae/config.json'):
        resolve_model_dir(str(tmp_path))


def test_local_folder_loads_weights_when_present(tmp_path):
    write_model_folder(tmp_path, skip=None)
    random_init = build_model(tmp_path)
    trained = tiny_model(seed=5)
    trained.unet.save_pretrained(tmp_path / 'unet')
    loaded = build_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.unet.parameters(), trained.unet.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(random_init.unet.parameters(), trained.unet.parameters()))
    # The encoders load the same way, alone as precompute.py builds them.
    assert model_module.build_encoders(tmp_path)[-1] == []
    trained.vae.save_pretrained(tmp_path / 'vae')
    trained.text_encoder.save_pretrained(tmp_path / 'text_encoder')
    vae, text_encoder, _, loaded_names = model_module.build_encoders(tmp_path)
    assert loaded_names == ['vae', 'text_encoder']
    for part, trained_part in ((vae, trained.vae), (text_encoder, trained.text_encoder)):
        assert all(torch.equal(a, b) for a, b in zip(part.parameters(), trained_part.parameters()))


# ------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_composer_launcher_end_to_end(tmp_path):
    results = tmp_path / 'results.json'
    run = run_cli(
        *TINY,
        '--batch_size',
        '8',
        '--device_train_microbatch_size',
        '4',
        '--max_duration',
        '6ba',
        '--results_json',
        str(results),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(results.read_text())
    shown = re.search(r'^throughput: ([\d.]+) img/s \(([\d.]+) per device', run.stdout, re.MULTILINE)
    assert shown and float(shown.group(1)) == pytest.approx(summary['img_per_sec'], abs=0.01), run.stdout[-2000:]
    assert summary['img_per_sec'] > 0 and summary['img_per_sec_per_device'] == summary['img_per_sec']  # one device
    # FLOP/s is the images' rate times the FLOPs of one, counted for the tiny model at its 64px
    assert summary['flops_per_image'] == tiny_model().flops_per_image(64, 64)
    assert summary['flops_per_sec'] == pytest.approx(summary['img_per_sec'] * summary['flops_per_image'], rel=1e-6)
    assert summary['mfu'] is None and summary['peak_gpu_memory_gb'] is None  # no known peak FLOP/s on a CPU
    assert summary['device_train_microbatch_size'] == 4
    assert summary['world_size'] == 1 and summary['device_type'] == 'cpu'
    assert summary['config']['batch_size'] == 8 and summary['versions']['mosaicml'] == '0.32.1'


@pytest.mark.slow
def test_bad_input_exits_non_zero_with_a_message():
    run = run_cli(*TINY, '--batch_size', '10', '--device_train_microbatch_size', '4', launcher=('python',))
    assert run.returncode == 2
    assert 'error: --batch_size 10' in run.stderr and 'Traceback' not in run.stderr


def test_a_results_file_says_how_it_was_made(tmp_path, monkeypatch):
    """Its command line, the commit of the code and whether the tree held changes, the seconds to the first step's
    end and in all (provenance.py); a copy without .git takes the commit from BENCHMARK_GIT_COMMIT."""
    import json
    import subprocess

    from runs import provenance
    from runs.run import main

    results = tmp_path / 'r.json'
    flags = [*TINY, '--image_size', '32', '--batch_size', '2', '--max_duration', '3ba', '--results_json', str(results)]
    monkeypatch.setattr(sys, 'argv', ['benchmark.py', *flags])
    main(settled(flags))
    made = json.loads(results.read_text())['provenance']
    assert made['command'].endswith(f'benchmark.py {" ".join(flags)}') and made['command'].startswith(sys.executable)
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True)
    assert made['git_commit'] == (head.stdout.strip() if head.returncode == 0 else None)
    assert 0 < made['seconds_to_first_step_end'] <= made['seconds_in_all'] and made['gpu'] is None
    monkeypatch.setattr(provenance, 'output_of', lambda command: None)  # no git here
    monkeypatch.setenv('BENCHMARK_GIT_COMMIT', 'abc123')
    assert provenance.git_state() == {'git_commit': 'abc123', 'git_dirty': None}
