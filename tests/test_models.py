"""Tests for the built-in models beyond SD2 base (SD 1.5, SD 2 768-v, SDXL base) and their tiny CPU twins:
parameter counts, structure, tokenization, SDXL's micro-conditioning, FLOPs, model folder checks, and (slow)
training each twin end to end, online and from precomputed data."""

import io
import json
import shutil

import pytest
import torch
from conftest import builtin_folder, jpeg, run_cli, write_dataset
from diffusers import UNet2DConditionModel
from PIL import Image

from data import StreamingLAIONDataset, SyntheticImageCaptionDataset, SyntheticLatentsDataset
from datapath.images import size_conditions
from guards.arguments import ConfigError
from models import parts, stable_diffusion
from models.stable_diffusion import build_model
from settings import model_folder, presets
from settings.config import resolve_config
from settings.flags import parse_args
from settings.model_folder import (
    CLIP_END_ID,
    CLIP_PAD_ID,
    CONFIGS_DIR,
    caption_inputs,
    caption_pad_ids,
    resolve_model_dir,
)

# Parameter counts of the public models (Diffusers layout, counted on the meta device).
SD2_UNET = 865_910_724
CLIP_VIT_L = 123_060_480
EXPECTED_PARAMETERS = {
    'sd1.5': {'unet': 859_520_964, 'text_encoder': CLIP_VIT_L},
    'sd2-768-v': {'unet': SD2_UNET, 'text_encoder': 340_387_840},
    'sdxl-base': {'unet': 2_567_463_684, 'text_encoder': CLIP_VIT_L, 'text_encoder_2': 694_659_840},
}
TWINS = {'sd2-base': 'tiny', 'sd1.5': 'tiny-sd1.5', 'sd2-768-v': 'tiny-sd2-768-v', 'sdxl-base': 'tiny-sdxl-base'}


def meta_model(name):
    with torch.device('meta'):
        return build_model(CONFIGS_DIR / name)


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize('name', EXPECTED_PARAMETERS)
@pytest.mark.stack
def test_parameter_counts_of_the_public_models(name):
    model = meta_model(name)
    for part, expected in EXPECTED_PARAMETERS[name].items():
        assert count(getattr(model, part)) == expected, part
    assert (model.text_encoder_2 is not None) == (name == 'sdxl-base')


def test_what_sets_the_models_apart():
    sd15, v768, xl = meta_model('sd1.5'), meta_model('sd2-768-v'), meta_model('sdxl-base')
    assert sd15.text_encoder.config.hidden_act == 'quick_gelu' and sd15.unet.config.cross_attention_dim == 768
    assert v768.noise_scheduler.config.prediction_type == 'v_prediction'
    assert presets.PRESETS['sd2-768-v'].image_size == 768 and presets.PRESETS['sdxl-base'].image_size == 1024
    assert xl.latent_scale == 0.13025 and xl.micro_conditioning
    assert xl.unet.config.cross_attention_dim == 768 + 1280
    assert model_folder.pooled_text_width(xl.unet.config) == 1280
    assert not sd15.micro_conditioning and model_folder.pooled_text_width(sd15.unet.config) is None


@pytest.mark.parametrize('name, twin', TWINS.items())
@pytest.mark.stack
def test_tiny_twins_have_the_structure_of_their_model(name, twin):
    big, tiny = meta_model(name), build_model(CONFIGS_DIR / twin)
    for key in ('down_block_types', 'up_block_types', 'addition_embed_type', 'use_linear_projection'):
        assert tiny.unet.config.get(key) == big.unet.config.get(key), key
    layers = big.unet.config.get('transformer_layers_per_block')
    assert isinstance(layers, int) or len(tiny.unet.config.transformer_layers_per_block) == len(layers)
    assert [type(e) for e in tiny.frozen_encoders()] == [type(e) for e in big.frozen_encoders()]
    assert [e.config.hidden_act for e in tiny.frozen_encoders()[1:]] == [
        e.config.hidden_act for e in big.frozen_encoders()[1:]
    ]
    assert tiny.noise_scheduler.config.prediction_type == big.noise_scheduler.config.prediction_type
    assert tiny.latent_scale == big.latent_scale
    assert caption_pad_ids(builtin_folder(twin)) == caption_pad_ids(builtin_folder(name))
    assert count(tiny.unet) < count(big.unet) / 100  # CPU-sized


@pytest.mark.stack
def test_each_text_encoder_pads_as_it_was_trained():
    assert caption_pad_ids(builtin_folder('sd2-base')) == (CLIP_PAD_ID,)  # OpenCLIP ViT-H: '!'
    assert caption_pad_ids(builtin_folder('sd1.5')) == (CLIP_END_ID,)  # OpenAI CLIP ViT-L: end of text
    assert caption_pad_ids(builtin_folder('sdxl-base')) == (CLIP_END_ID, CLIP_PAD_ID)  # ViT-L, then bigG


@pytest.mark.slow
def test_sdxl_flops_match_the_reference_figure():
    xl = meta_model('sdxl-base')
    assert xl.forward_flops(512, 512)['unet'] == pytest.approx(1.589e12, rel=0.01)
    parts = xl.forward_flops(1024, 1024)
    assert set(parts) == {'unet', 'vae_encoder', 'text_encoder', 'text_encoder_2'}
    assert (
        xl.flops_per_image(1024, 1024)
        == 3 * parts['unet'] + parts['vae_encoder'] + parts['text_encoder'] + (parts['text_encoder_2'])
    )
    # v-prediction changes the target, not the work: SD2 768-v costs SD2 base's FLOPs at 768px.
    assert meta_model('sd2-768-v').flops_per_image(768, 768) == meta_model('sd2-base').flops_per_image(768, 768)


def test_a_processes_flop_counts_are_kept_by_architecture_and_size(monkeypatch, tmp_path):
    """A second model of the same configs reuses the count; another config, or another size, is counted anew, and
    the count kept is the one a fresh count gives."""
    counted = []

    def count(*args):
        counted.append(args[-3:])
        return real_count(*args)

    real_count = stable_diffusion.count_forward_flops
    monkeypatch.setattr(stable_diffusion, 'count_forward_flops', count)
    monkeypatch.setattr(parts, 'FORWARD_FLOPS', {})
    tiny = CONFIGS_DIR / 'tiny'
    first = build_model(tiny).forward_flops(32, 32)
    assert build_model(tiny).forward_flops(32, 32) == first
    assert counted == [(32, 32, 77)]
    deeper = tmp_path / 'tiny-deeper'
    shutil.copytree(tiny, deeper)
    unet_config = json.loads((deeper / 'unet' / 'config.json').read_text())
    (deeper / 'unet' / 'config.json').write_text(json.dumps({**unet_config, 'layers_per_block': 2}))
    model = build_model(deeper)
    fresh = real_count(model.unet.config, model.vae.config, [model.text_encoder.config], 32, 32, 77)
    assert model.forward_flops(32, 32) == fresh
    assert fresh['unet'] > first['unet'] and fresh['vae_encoder'] == first['vae_encoder']
    assert build_model(tiny).forward_flops(64, 64)['unet'] > first['unet']
    assert counted == [(32, 32, 77), (32, 32, 77), (64, 64, 77)]


# ------------------------------------------------------------------------------------ SDXL's inputs


def test_size_conditions_of_a_real_image():
    # 300 wide, 200 high, shorter side to 64: 96 x 64, center crop from the left at (96 - 64) / 2 = 16.
    assert size_conditions(jpeg(0, (300, 200)), 64).tolist() == [200, 300, 0, 16, 64, 64]
    # EXIF orientation 6 (a quarter turn): stored 300 x 200, seen 200 wide and 300 high.
    exif = Image.Exif()
    exif[0x0112] = 6
    assert size_conditions(jpeg(0, (300, 200), exif=exif), 64).tolist() == [300, 200, 16, 0, 64, 64]
    assert size_conditions(Image.open(io.BytesIO(jpeg(0, (64, 64)))), 64).tolist() == [64, 64, 0, 0, 64, 64]


def test_sdxl_batches_carry_both_caption_columns_and_the_size(tmp_path):
    inputs = caption_inputs(builtin_folder('tiny-sdxl-base'))
    samples = [{'jpg': jpeg(i, (120, 80)), 'caption': 'a red cube'} for i in range(4)]
    dataset = StreamingLAIONDataset(local=write_dataset(tmp_path / 'mds', samples), image_size=32, inputs=inputs)
    sample = dataset[0]
    first, second = sample['input_ids'], sample['input_ids_2']
    assert torch.equal(first[:5], second[:5])  # one BPE: the same ids up to the end of the caption
    assert first[-1] == CLIP_END_ID and second[-1] == CLIP_PAD_ID
    assert sample['time_ids'].tolist() == [80, 120, 0, 8, 32, 32]
    synthetic = SyntheticImageCaptionDataset(32, inputs=inputs)[3]
    height, width, top, left, *target = synthetic['time_ids'].tolist()
    assert 32 <= height <= 64 and 32 <= width <= 64 and target == [32, 32] and min(top, left) == 0
    assert set(SyntheticImageCaptionDataset(32)[3]) == {'image', 'input_ids'}
    latents = SyntheticLatentsDataset(4, 4, 48, pooled_dim=32, size_conditions=True)[0]
    assert latents['pooled_text_embedding'].shape == (32,) and latents['time_ids'][-1] == 32


# --------------------------------------------------------------------------------- model folder checks


def test_a_model_folder_needs_both_halves_of_sdxl(tmp_path):
    half = tmp_path / 'no-second-encoder'
    shutil.copytree(CONFIGS_DIR / 'tiny-sdxl-base', half)
    shutil.rmtree(half / 'text_encoder_2')
    with pytest.raises(ConfigError, match="'text_time' .SDXL. needs a second text encoder"):
        resolve_model_dir(str(half))
    extra = tmp_path / 'extra-encoder'
    shutil.copytree(CONFIGS_DIR / 'tiny', extra)
    shutil.copytree(CONFIGS_DIR / 'tiny-sdxl-base' / 'text_encoder_2', extra / 'text_encoder_2')
    with pytest.raises(ConfigError, match='text_encoder_2/config.json is there, but the UNet has no'):
        resolve_model_dir(str(extra))
    (half / 'text_encoder_2').mkdir()
    (half / 'text_encoder_2' / 'config.json').write_text('{"hidden_size": ')
    with pytest.raises(ConfigError, match='text_encoder_2/config.json is not valid JSON'):
        resolve_model_dir(str(half))


def test_sdxl_is_a_unet_with_a_second_text_encoder_and_sd3_is_not():
    # SD3.5 has a text_encoder_2 too: a transformer is never of the UNets' SDXL family.
    sdxl = {name for name in model_folder.BUILTIN_MODELS if builtin_folder(name).is_sdxl}
    assert sdxl == {'sdxl-base', 'tiny-sdxl-base'}
    assert 'text_encoder_2' in builtin_folder('tiny-sd3.5-medium').text_encoder_folders


def test_presets_and_model_names():
    for name in ('sd1.5', 'sd2-768-v', 'sdxl-base'):
        assert name in model_folder.BUILTIN_MODELS and f'tiny-{name}' in model_folder.BUILTIN_MODELS
    run = resolve_config(parse_args(['--model_name', 'tiny-sd2-768-v', '--use_synth_data']))
    assert run.data.image_size == 96 and run.batch.batch_size == 16  # the twin's preset
    assert json.loads((CONFIGS_DIR / 'sdxl-base' / 'vae' / 'config.json').read_text())['scaling_factor'] == 0.13025


# ------------------------------------------------------------------------------------ end to end


def train_twin(tmp_path, twin, *flags):
    run = run_cli(  # on the sample dataset unless told otherwise
        '--model_name',
        twin,
        '--batch_size',
        '4',
        '--max_duration',
        '3ba',
        '--results_json',
        str(tmp_path / 'results.json'),
        *flags,
        launcher=('python',),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((tmp_path / 'results.json').read_text())


@pytest.mark.slow
@pytest.mark.parametrize('twin', ['tiny-sd1.5', 'tiny-sd2-768-v', 'tiny-sdxl-base'])
@pytest.mark.stack
def test_each_twin_trains_online_and_from_precomputed_data(tmp_path, twin):
    import precompute

    saved = ['--save_folder', str(tmp_path / 'ckpt'), '--save_interval', '3ba', '--run_name', 'twin']
    online = train_twin(tmp_path / 'online', twin, '--use_ema', '--export_ema_unet', str(tmp_path / 'ema-unet'), *saved)
    assert online['model_name'] == twin and online['img_per_sec'] > 0
    assert online['trained_parameters'] == count(build_model(CONFIGS_DIR / twin).unet)
    # The exported EMA UNet loads in Diffusers, the model's own class and config, and holds the average the last
    # checkpoint holds, not the trained weights.
    unet = UNet2DConditionModel.from_pretrained(tmp_path / 'ema-unet')
    assert count(unet) == online['trained_parameters'] and unet.config.get('addition_embed_type') == (
        'text_time' if 'sdxl' in twin else None
    )
    state = torch.load(tmp_path / 'ckpt' / 'latest-rank0.pt', map_location='cpu', weights_only=False)['state']
    average, trained = dict(state['algorithms'])['EMA']['ema'], state['model']
    exported = {f'unet.{name}': value for name, value in unet.state_dict().items()}
    assert all(torch.equal(value, average[name]) for name, value in exported.items())
    assert not all(torch.equal(value, trained[name]) for name, value in exported.items())
    out = tmp_path / 'latents'
    precompute.main(['--model_name', twin, '--out', str(out), '--image_size', '32', '--part_size', '400'])
    from_latents = train_twin(tmp_path / 'precomputed', twin, '--precomputed_latents', '--local', str(out))
    assert from_latents['image_size'] == 32 and from_latents['img_per_sec'] > 0
    assert from_latents['flops_per_image'] == from_latents['trained_flops_per_image']  # the UNet alone
    # Data precomputed for another model is refused before anything is built.
    other = 'tiny' if 'sdxl' in twin else 'tiny-sdxl-base'
    with pytest.raises(ConfigError, match='precompute it with the same --model_name'):
        resolve_config(parse_args(['--model_name', other, '--precomputed_latents', '--local', str(out)]))
