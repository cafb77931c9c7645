"""CPU tests of precomputed latents (precompute.py, --precomputed_latents) and of the speed-path flags."""

import copy
import json
import os
import shutil

import pytest
import torch
from composer.utils import reproducibility
from conftest import (
    LAUNCHER,
    REPO,
    builtin_folder,
    fixed_batch,
    good_samples,
    loader_workers,
    run_process,
    settled,
    write_dataset,
)
from streaming import StreamingDataset
from torch.utils.data import default_collate

import precompute
from data import PrecomputedLatentsDataset, StreamingLAIONDataset
from datapath.images import unit_range
from datapath.sample_dataset import ensure_sample_dataset
from guards.arguments import ConfigError
from models.stable_diffusion import StableDiffusion, build_encoders, build_model, count_forward_flops, encode_text
from runs import precomputing
from runs.run import main
from settings import precompute_settings
from settings.config import resolve_config
from settings.dataset_checks import SHARD_HASH
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR, read_model_folder
from settings.tokenizer import CaptionTokenizer

SOURCE_SAMPLES = 40  # the generated dataset breaks samples 13 and 26 (an empty download, an HTML page)


TINY_TWINS = ['tiny', 'tiny-sd1.5', 'tiny-sd2-768-v', 'tiny-sdxl-base']


def online_and_precomputed_models(model_name='tiny'):
    """A tiny model, and a model of the same UNet weights without VAE or text encoders."""
    reproducibility.seed_all(0)
    online = build_model(CONFIGS_DIR / model_name)
    without_encoders = StableDiffusion(
        copy.deepcopy(online.unet), None, None, online.noise_scheduler, online.latent_scale
    )
    return online, without_encoders


def precomputed_from(online, batch, dtype=torch.float16):
    text_encoders = [encoder for encoder in (online.text_encoder, online.text_encoder_2) if encoder is not None]
    if dtype == torch.float16:  # as precompute.py stores them
        columns = precomputing.encode(
            read_model_folder(online.model_dir), online.vae, text_encoders, batch, torch.device('cpu')
        )
        columns = {name: torch.from_numpy(array) for name, array in columns.items()}
    else:  # the same values before fp16 storage rounds them
        with torch.no_grad():
            dist = online.vae.encode(unit_range(batch['image'])).latent_dist
            text = encode_text(online.text_encoder, online.text_encoder_2, batch)
            columns = {'latent_mean': dist.mean, 'latent_logvar': dist.logvar, **text}
        if 'time_ids' in batch:
            columns['time_ids'] = batch['time_ids']
    keep = ('noise', 'latent_noise', 'timesteps')
    return {**columns, **{key: batch[key] for key in keep}}


def step(model, batch):
    model.zero_grad(set_to_none=True)
    outputs = model(batch)
    loss = model.loss(outputs, batch)
    loss.backward()
    return outputs[0].detach(), loss.detach(), [p.grad.clone() for p in model.unet.parameters()]


@pytest.mark.parametrize('model_name', TINY_TWINS)
@pytest.mark.stack
def test_precomputed_step_equals_the_online_step(model_name):
    online, without_encoders = online_and_precomputed_models(model_name)
    batch = fixed_batch(model_name=model_name)
    prediction, loss, gradients = step(online, batch)
    # Unrounded encoder outputs: the same step up to float reassociation.
    exact = step(without_encoders, precomputed_from(online, batch, torch.float32))
    torch.testing.assert_close(exact[0], prediction, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exact[1], loss, rtol=1e-5, atol=1e-6)
    # As stored (fp16): within fp16 rounding of the inputs.
    stored = precomputed_from(online, batch)
    assert stored['latent_mean'].dtype == stored['text_embedding'].dtype == torch.float16
    fp16_prediction, fp16_loss, fp16_gradients = step(without_encoders, stored)
    torch.testing.assert_close(fp16_prediction, prediction, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fp16_loss, loss, rtol=2e-3, atol=0)
    cosine = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in fp16_gradients]), torch.cat([g.flatten() for g in gradients]), dim=0
    )
    assert cosine > 0.999
    # Nothing but the UNet in the precomputed model, and its FLOPs are the UNet's forward and backward.
    assert sum(p.numel() for p in without_encoders.parameters()) == sum(p.numel() for p in online.unet.parameters())
    text_configs = [encoder.config for encoder in online.frozen_encoders()[1:]]
    unet_forward = count_forward_flops(online.unet.config, online.vae.config, text_configs, 64, 64, 77)
    assert without_encoders.flops_per_batch(stored) == 4 * 3 * unet_forward['unet']
    assert online.flops_per_batch(batch) == 4 * (
        3 * unet_forward['unet'] + sum(unet_forward.values()) - unet_forward['unet']
    )
    assert online.flops_per_batch(batch) > without_encoders.flops_per_batch(stored)


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    return ensure_sample_dataset(tmp_path_factory.mktemp('source') / 'mds', num_samples=SOURCE_SAMPLES)


def run_precompute(source, out, *flags):
    return precompute.main(
        [
            '--local',
            str(source),
            '--out',
            str(out),
            '--model_name',
            'tiny',
            '--image_size',
            '32',
            '--part_size',
            '16',
            *flags,
        ]
    )


def read_all(location):
    dataset = PrecomputedLatentsDataset(local=str(location), shuffle=False, batch_size=1)
    return [dataset[i] for i in range(dataset.num_samples)]


@pytest.mark.stack
def test_precompute_writes_aligned_samples_resumes_and_trains(source, tmp_path, capfd, caplog):
    out = tmp_path / 'latents'
    assert run_precompute(source, out) == {'encoded': 38, 'bad': 2, 'parts': 3, 'skipped_parts': 0}
    stored = read_all(out)
    assert len(stored) == 38
    merged = json.loads((out / 'index.json').read_text())['shards']
    assert merged and all(SHARD_HASH in shard['raw_data']['hashes'] for shard in merged)  # checked as a run reads
    # Sample k of the output is the k-th good source sample, encoded by the tiny model's encoders.
    reproducibility.seed_all(17)  # precompute.py's --seed default
    vae, text_encoder, _, loaded = build_encoders(CONFIGS_DIR / 'tiny')
    assert loaded == [] and '(random init: vae, text_encoder)' in capfd.readouterr().out
    images = StreamingLAIONDataset(local=str(source), image_size=32, shuffle=False, keep_caption=True)
    good = [images[i] for i in range(SOURCE_SAMPLES) if not images[i]['bad_samples']]
    assert len(good) == 38
    reader = PrecomputedLatentsDataset(local=str(out), shuffle=False, batch_size=1)
    for k in (0, 13, 37):
        batch = default_collate([good[k]])
        encoded = precomputing.encode(builtin_folder('tiny'), vae, [text_encoder], batch, torch.device('cpu'))
        assert sorted(encoded) == ['latent_logvar', 'latent_mean', 'text_embedding']
        # Encoded in batches of 16 there, of 1 here: equal up to fp16 rounding of reassociated sums.
        for name, expected in encoded.items():
            torch.testing.assert_close(stored[k][name], torch.from_numpy(expected[0]), rtol=2e-3, atol=2e-3)
        assert StreamingDataset.get_item(reader, k)['caption'] == good[k]['caption']  # the raw row
    assert torch.equal(CaptionTokenizer()(good[5]['caption']), good[5]['input_ids'])

    # Run again when finished: nothing to redo, the same dataset, and no notices from Streaming's merge.
    caplog.clear()
    assert run_precompute(source, out) == {'encoded': 0, 'bad': 0, 'parts': 3, 'skipped_parts': 3}
    assert not [record.getMessage() for record in caplog.records if record.name.startswith(('root', 'streaming'))]
    assert all(torch.equal(a['latent_mean'], b['latent_mean']) for a, b in zip(read_all(out), stored, strict=True))
    # A crash in the middle part (of a rerun, so the merged index is still there): only that part is redone.
    shutil.rmtree(out / 'part-00001')
    assert run_precompute(source, out) == {'encoded': 15, 'bad': 1, 'parts': 3, 'skipped_parts': 2}
    assert all(torch.equal(a['latent_mean'], b['latent_mean']) for a, b in zip(read_all(out), stored, strict=True))
    # The same output with other settings is refused, unless asked to start over.
    with pytest.raises(ConfigError, match='made with other settings'):
        run_precompute(source, out, '--precision', 'bf16')

    # Train the UNet alone on it: one epoch of 38 samples in batches of 8, at the stored 32px.
    capfd.readouterr()
    trainer = main(
        settled(
            [
                '--model_name',
                'tiny',
                '--precomputed_latents',
                '--local',
                str(out),
                '--batch_size',
                '8',
                '--max_duration',
                '1ep',
            ]
        )
    )
    assert int(trainer.state.timestamp.batch) == 4
    assert 'the data was precomputed at 32px' in capfd.readouterr().out
    assert trainer.state.model.vae is None and trainer.state.model.text_encoder is None


def test_precomputed_data_must_fit_the_unet(source, tmp_path):
    out = tmp_path / 'latents'
    run_precompute(source, out)
    other = tmp_path / 'wide-model'
    shutil.copytree(REPO / 'configs' / 'tiny', other)
    config = json.loads((other / 'unet' / 'config.json').read_text())
    config['cross_attention_dim'] = 48
    (other / 'unet' / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ConfigError, match='text embeddings of 77 x 32, but .* takes 4 and 77 x 48'):
        main(settled(['--model_name', str(other), '--precomputed_latents', '--local', str(out), '--batch_size', '8']))
    with pytest.raises(ConfigError, match='latent_mean, latent_logvar and text_embedding'):
        main(settled(['--model_name', 'tiny', '--precomputed_latents', '--local', str(source), '--batch_size', '8']))


@pytest.mark.slow
def test_two_ranks_share_the_parts(source, tmp_path):
    single = tmp_path / 'single'
    run_precompute(source, single, '--part_size', '8')
    out = tmp_path / 'two-ranks'
    # A folder of its own: Streaming refuses a local folder that a live dataset (here, in this process) reads.
    own_source = shutil.copytree(source, tmp_path / 'source')
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1'}
    run = run_process(
        [
            LAUNCHER,
            '-n',
            '2',
            str(REPO / 'precompute.py'),
            '--local',
            str(own_source),
            '--out',
            str(out),
            '--model_name',
            'tiny',
            '--image_size',
            '32',
            '--part_size',
            '8',
        ],
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert 'encoded 38 samples (2 bad ones left out)' in run.stdout
    assert sorted(path.name for path in out.glob('part-*')) == [f'part-{i:05d}' for i in range(5)]
    # The same samples in the same order (other thread counts: equal up to rounding, not bitwise).
    for a, b in zip(read_all(out), read_all(single), strict=True):
        for name in ('latent_mean', 'text_embedding'):
            torch.testing.assert_close(a[name], b[name], rtol=2e-3, atol=2e-3)


def test_synthetic_precomputed_run_counts_unet_flops_only(tmp_path):
    results = tmp_path / 'results.json'
    main(
        settled(
            [
                '--model_name',
                'tiny',
                '--use_synth_data',
                '--precomputed_latents',
                '--batch_size',
                '4',
                '--max_duration',
                '3ba',
                '--results_json',
                str(results),
            ]
        )
    )
    summary = json.loads(results.read_text())
    reproducibility.seed_all(0)
    online = build_model(CONFIGS_DIR / 'tiny')
    unet_forward = count_forward_flops(online.unet.config, online.vae.config, [online.text_encoder.config], 64, 64, 77)
    assert summary['flops_per_image'] == 3 * unet_forward['unet']
    assert summary['img_per_sec'] > 0


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--precomputed_latents'], '--precomputed_latents needs a dataset written by precompute.py'),
        (['--precomputed_latents', '--use_synth_data', '--encoders_bf16'], 'no VAE or text encoder to keep in bf16'),
        (['--use_synth_data', '--low_precision_norm'], '--low_precision_norm runs the norms in the autocast precision'),
        (['--use_synth_data', '--compile'], "Inductor fails compiling this model's backward pass for CPU"),
        (['--use_synth_data', '--pin_memory'], '--pin_memory pins batches for copies to a GPU'),
    ],
)
def test_bad_flag_combinations(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(parse_args(['--model_name', 'tiny', *flags]))


def test_precompute_refuses_a_foreign_output(source, tmp_path):
    out = tmp_path / 'busy'
    out.mkdir()
    (out / 'notes.txt').write_text('mine')
    with pytest.raises(ConfigError, match='is not empty and was not made by precompute.py'):
        run_precompute(source, out)
    assert (out / 'notes.txt').read_text() == 'mine'


@pytest.mark.parametrize('where', ['same', 'parent', 'inside'])
def test_precompute_never_writes_over_its_input(source, tmp_path, where):
    copy_of_source = tmp_path / 'data' / 'mds'
    shutil.copytree(source, copy_of_source)
    before = sorted(
        (path.relative_to(tmp_path), path.read_bytes()) for path in copy_of_source.rglob('*') if path.is_file()
    )
    out = {'same': copy_of_source, 'parent': copy_of_source.parent, 'inside': copy_of_source / 'latents'}[where]
    with pytest.raises(ConfigError, match='overlaps the input'):
        run_precompute(copy_of_source, out, '--overwrite')
    after = sorted(
        (path.relative_to(tmp_path), path.read_bytes()) for path in copy_of_source.rglob('*') if path.is_file()
    )
    assert after == before


@pytest.mark.parametrize(
    'out, source, expected',
    [
        ('s3://bucket/laion', 's3://bucket/laion/', True),
        ('s3://bucket/laion/latents', 's3://bucket/laion', True),
        ('s3://bucket/laion-latents', 's3://bucket/laion', False),
        ('s3://other/laion', 's3://bucket/laion', False),
        ('s3://bucket/laion', 'data/laion', False),
    ],
)
def test_remote_overlap_is_by_whole_path_components(out, source, expected):
    assert precompute_settings.overlaps(out, source) == expected


# ------------------------------------------------------------------------------------- speed paths


def train(*flags, batches=3):
    trainer = main(
        settled(
            [
                '--model_name',
                'tiny',
                '--use_synth_data',
                '--batch_size',
                '4',
                '--image_size',
                '32',
                '--max_duration',
                f'{batches}ba',
                *flags,
            ]
        )
    )
    return trainer.state.model


def assert_same_update(plain, other, tolerance=1e-2):
    """Both runs moved the UNet from the same init by the same update, up to float rounding (which Adam can
    turn into a visible difference where a gradient is near zero, hence a norm over all parameters)."""
    reproducibility.seed_all(17)  # benchmark.py's --seed default: the init both runs started from
    init = torch.cat([p.detach().flatten() for p in build_model(CONFIGS_DIR / 'tiny').unet.parameters()])
    plain_update = torch.cat([p.detach().flatten() for p in plain.unet.parameters()]) - init
    other_update = torch.cat([p.detach().flatten() for p in other.unet.parameters()]) - init
    assert plain_update.norm() > 0
    assert (other_update - plain_update).norm() < tolerance * plain_update.norm()


def test_fused_adamw_gives_the_same_weights():
    plain, fused = train(), train('--fused_adamw')
    assert_same_update(plain, fused)


def test_channels_last_keeps_the_result():
    plain, channels_last = train(), train('--channels_last')
    conv = channels_last.unet.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert_same_update(plain, channels_last)


def test_activation_checkpointing_keeps_the_update_and_keeps_fewer_activations():
    from benchmarks.saved_activations import saved_bytes_per_image

    plain, checkpointed = train(), train('--activation_checkpointing')
    assert checkpointed.unet.is_gradient_checkpointing and not plain.unet.is_gradient_checkpointing
    assert_same_update(plain, checkpointed, tolerance=1e-4)  # the same ops, recomputed in the backward
    for model_name in ('tiny', 'tiny-pixart-sigma'):
        assert saved_bytes_per_image(model_name, 64, True) < saved_bytes_per_image(model_name, 64)


def test_the_random_draws_of_a_step_do_not_depend_on_the_memory_layout():
    """The same seed draws the same latent noise and noise, so the same target, from channels-last latents as
    from contiguous ones: on a GPU, --channels_last makes the VAE return channels-last latents, and the step must
    stay comparable with the plain run's."""
    generator = torch.Generator().manual_seed(5)
    batch = {
        'latent_mean': torch.randn(2, 4, 8, 8, generator=generator),
        'latent_logvar': torch.randn(2, 4, 8, 8, generator=generator) - 4,
        'text_embedding': torch.randn(2, 77, 32, generator=generator),
        'timesteps': torch.tensor([100, 700]),
    }
    model = build_model(CONFIGS_DIR / 'tiny', precomputed=True)
    targets = []
    for layout in (torch.contiguous_format, torch.channels_last):
        latents = {name: batch[name].contiguous(memory_format=layout) for name in ('latent_mean', 'latent_logvar')}
        reproducibility.seed_all(3)
        with torch.no_grad():
            _, target = model({**batch, **latents})
        targets.append(target)
    assert latents['latent_mean'].is_contiguous(memory_format=torch.channels_last)
    assert not latents['latent_mean'].is_contiguous()
    torch.testing.assert_close(targets[1], targets[0], rtol=0, atol=0)


def test_encoders_bf16_keeps_encoders_in_bf16_encodes_as_fp32_does_and_trains():
    """The encoders in bf16 give the latents and text embeddings of the fp32 encoders up to bf16's rounding (in fp32,
    as the UNet takes them), and the UNet trains on them: it moves from its init as the fp32 run's does."""
    bf16, plain = train('--encoders_bf16', batches=2), train(batches=2)
    assert (
        {p.dtype for p in bf16.vae.parameters()}
        == {p.dtype for p in bf16.text_encoder.parameters()}
        == {torch.bfloat16}
    )
    assert {p.dtype for p in bf16.unet.parameters()} == {torch.float32}
    batch = fixed_batch(2, 32)
    encoded = []
    for model in (bf16, plain):
        reproducibility.seed_all(5)  # the same latent sample drawn from each distribution
        with torch.no_grad():
            latents, conditioning = model.encode(batch)
        encoded.append((latents, conditioning['encoder_hidden_states']))
    for rounded, exact in zip(*encoded):
        assert rounded.dtype == exact.dtype == torch.float32
        assert 0 < (rounded - exact).norm() < 0.02 * exact.norm()  # rounded to bf16, and close
    assert_same_update(plain, bf16, tolerance=0.1)


@pytest.mark.slow
def test_a_loader_worker_killed_mid_precompute_ends_it_in_one_line(source, tmp_path, monkeypatch, capsys):
    """A worker killed as the kernel's out-of-memory killer does: one line, the parts finished kept."""
    import os
    import signal

    encode, killed, earlier = precomputing.encode, [], loader_workers()

    def encode_then_kill_a_worker(*args, **kwargs):
        if not killed:
            worker = max(loader_workers() - earlier)  # precompute's: its loader's workers are the only new ones
            killed.append(worker)
            os.kill(worker, signal.SIGKILL)
        return encode(*args, **kwargs)

    monkeypatch.setattr(precomputing, 'encode', encode_then_kill_a_worker)
    flags = ['--local', str(source), '--out', str(tmp_path / 'latents'), '--model_name', 'tiny']
    with pytest.raises(SystemExit) as stopped:
        precompute.cli([*flags, '--image_size', '32', '--part_size', '16', '--num_workers', '2', '--batch_size', '2'])
    assert stopped.value.code == 1 and killed
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f'error: a loader worker (pid {killed[0]}) ') and 'the parts finished are kept' in err[-1]
    assert not any('Traceback' in line for line in err)


def test_the_held_out_split_beside_the_input_is_precomputed_beside_the_output(source, tmp_path):
    """convert.py --validation_fraction writes a split in its output's validation/: precompute.py encodes it into its
    own output's validation/, where a run from the latents finds it."""
    data = shutil.copytree(source, tmp_path / 'mds')
    write_dataset(data / 'validation', good_samples(6))
    out = tmp_path / 'latents'
    done = run_precompute(data, out)
    assert (done['encoded'], done['validation']['encoded'], done['validation']['bad']) == (38, 6, 0)
    assert len(read_all(out)) == 38 and len(read_all(out / 'validation')) == 6
    again = run_precompute(data, out)  # finished: nothing to redo, in either
    assert (again['skipped_parts'], again['validation']['skipped_parts']) == (3, 1)
    flags = ['--model_name', 'tiny', '--precomputed_latents', '--local', str(out), '--batch_size', '8']
    config = resolve_config(parse_args([*flags, '--max_duration', '2ba', '--eval_interval', '1ba']))
    assert config.evaluation.eval_local == str(out / 'validation')
