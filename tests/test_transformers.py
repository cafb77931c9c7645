"""Tests for the diffusion transformers (Flux.1-schnell, SD3.5 medium, PixArt-Sigma) and their tiny CPU twins:
parameter counts, structure, caption columns, FLOPs against MLPerf's figure, the training loss against the Diffusers
recipe computed here independently, noise levels, validation levels, the flags' checks, and training each twin
online and from precomputed latents, and on real captions with a local T5 tokenizer, online and precomputed."""

import json
import math

import numpy as np
import pytest
import torch
from composer.core import Callback
from composer.utils import reproducibility
from conftest import builtin_folder, fake_gpu, good_samples, jpeg, settled, write_dataset, write_t5_tokenizer
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from torch.utils.data import default_collate

import generate
import precompute
from data import PrecomputedLatentsDataset, StreamingLAIONDataset, SyntheticImageCaptionDataset
from datapath.images import unit_range
from guards.arguments import ConfigError
from models.diffusion_transformer import count_forward_flops
from models.parts import build_frozen_encoders
from models.stable_diffusion import build_model
from runs import precomputing
from runs.export import generate as generate_images
from runs.run import main
from settings.config import resolve_config
from settings.families import FAMILIES, FLUX, PIXART, SD3, Recipe
from settings.flags import parse_args
from settings.model_folder import (
    CLIP_END_ID,
    CLIP_PAD_ID,
    CLIP_START_ID,
    CLIP_VOCAB_SIZE,
    CONFIGS_DIR,
    T5_END_ID,
    T5_PAD_ID,
    T5_VOCAB_SIZE,
    caption_inputs,
    read_model_folder,
)
from settings.precompute_settings import settle_precompute
from settings.tokenizer import clip_tokenizer_folder, column_tokenizers

T5_XXL_ENCODER = 4_762_310_656
EXPECTED_PARAMETERS = {  # the public models' counts (Diffusers layout)
    'flux-schnell': {'transformer': 11_891_178_560, 'vae': 83_819_683, 'text_encoder_2': T5_XXL_ENCODER},
    'sd3.5-medium': {'transformer': 2_243_171_520, 'text_encoder_2': 694_659_840, 'text_encoder_3': T5_XXL_ENCODER},
    'pixart-sigma': {'transformer': 610_856_096, 'vae': 83_653_863, 'text_encoder': T5_XXL_ENCODER},
}
TWINS = {'flux-schnell': 'tiny-flux-schnell', 'sd3.5-medium': 'tiny-sd3.5-medium', 'pixart-sigma': 'tiny-pixart-sigma'}
# MLPerf Training's flux1 benchmark: 20.3 TFLOP per 256px image for the transformer's forward and backward.
MLPERF_FLUX_TFLOP_PER_IMAGE = 20.3


def meta_model(name, **kwargs):
    with torch.device('meta'):
        return build_model(CONFIGS_DIR / name, **kwargs)


def count(module):
    return sum(p.numel() for p in module.parameters())


def twin_batch(name, n=2, size=64, seed=0):
    """A synthetic batch of a twin, with fixed draws."""
    inputs = caption_inputs(builtin_folder(name))
    batch = default_collate([SyntheticImageCaptionDataset(size, inputs=inputs)[i] for i in range(n)])
    generator = torch.Generator().manual_seed(seed)
    latent = (n, 16 if name != 'tiny-pixart-sigma' else 4, size // 8, size // 8)
    batch['latent_noise'] = torch.randn(latent, generator=generator)
    batch['noise'] = torch.randn(latent, generator=generator)
    return batch


@pytest.mark.parametrize('name', EXPECTED_PARAMETERS)
@pytest.mark.stack
def test_parameter_counts_of_the_public_models(name):
    model = meta_model(name)
    for part, expected in EXPECTED_PARAMETERS[name].items():
        assert count(getattr(model, part)) == expected, part
    assert model.text_encoder_names == FAMILIES[type(model.transformer).__name__].text_encoders


@pytest.mark.parametrize('name', TWINS)
def test_each_twin_has_the_structure_of_its_model(name):
    full, twin = meta_model(name), meta_model(TWINS[name])
    assert type(full.transformer) is type(twin.transformer)
    assert [type(e) for e in full.text_encoders] == [type(e) for e in twin.text_encoders]
    assert (full.latent_channels, full.latent_shift, full.latent_scale) == (
        twin.latent_channels,
        twin.latent_shift,
        twin.latent_scale,
    )
    assert type(full.noise_scheduler) is type(twin.noise_scheduler)
    assert full.noise_scheduler.config.get('shift') == twin.noise_scheduler.config.get('shift')
    assert caption_inputs(builtin_folder(name)) == caption_inputs(builtin_folder(TWINS[name]))
    assert count(twin.transformer) < 100_000


def test_caption_columns_follow_the_text_encoders():
    flux = caption_inputs(builtin_folder('flux-schnell'))
    assert flux.lengths == (77, 256) and flux.vocab_sizes == (CLIP_VOCAB_SIZE, T5_VOCAB_SIZE)
    assert flux.pad_ids == (CLIP_END_ID, T5_PAD_ID)  # OpenAI's CLIP-L pads with end of text
    sd3 = caption_inputs(builtin_folder('sd3.5-medium'))
    assert sd3.lengths == (77, 77, 256) and sd3.pad_ids == (CLIP_END_ID, CLIP_PAD_ID, T5_PAD_ID)
    pixart = caption_inputs(builtin_folder('pixart-sigma'))
    assert pixart.lengths == (300,) and pixart.id_columns == ['input_ids'] and pixart.uses_t5
    sample = SyntheticImageCaptionDataset(32, inputs=sd3)[0]
    assert [sample[c].shape[0] for c in sd3.id_columns] == [77, 77, 256]
    assert int(sample['input_ids_3'].max()) < T5_VOCAB_SIZE


def test_flux_flops_per_256px_image_match_mlperf():
    model = meta_model('flux-schnell')
    parts = count_forward_flops(model.transformer, model.vae, model.text_encoders, 256, 256, 256, 16)
    trained = 3 * parts['transformer'] / 1e12
    assert trained == pytest.approx(MLPERF_FLUX_TFLOP_PER_IMAGE, rel=0.01)
    assert parts['text_encoder_2'] > 10 * parts['text_encoder']  # T5-XXL dwarfs CLIP-L


def flux_loss_by_hand(model, batch, sigmas):
    """Diffusers' Flux training example, written out: normalize, pack 2x2, noise, predict, unpack, MSE to noise - x."""
    vae, (clip, t5) = model.vae, model.text_encoders
    with torch.no_grad():
        dist = vae.encode(unit_range(batch['image'])).latent_dist
        x = (dist.mean + dist.std * batch['latent_noise'] - vae.config.shift_factor) * vae.config.scaling_factor
        pooled = clip(batch['input_ids']).pooler_output
        states = t5(batch['input_ids_2'])[0]
    return flux_flow_loss(model.transformer, x, batch['noise'], sigmas, pooled, states)


def flux_flow_loss(transformer, x, noise, sigmas, pooled, states, guidance=None):
    """Pack 2x2, noise, predict (with a guidance tensor where given), unpack, MSE to noise - x."""
    n, c, h, w = x.shape
    s = sigmas.view(-1, 1, 1, 1)
    prediction = transformer(
        hidden_states=FluxPipeline._pack_latents((1 - s) * x + s * noise, n, c, h, w),
        timestep=sigmas,
        guidance=None if guidance is None else torch.full([n], guidance),
        pooled_projections=pooled,
        encoder_hidden_states=states,
        txt_ids=torch.zeros(states.shape[1], 3),
        img_ids=FluxPipeline._prepare_latent_image_ids(n, h // 2, w // 2, x.device, x.dtype),
    ).sample
    prediction = FluxPipeline._unpack_latents(prediction, h * 8, w * 8, 8)
    return ((prediction - (noise - x)) ** 2).mean()


def sd3_loss_by_hand(model, batch, sigmas):
    """Diffusers' SD3 training example: both CLIPs' penultimate states padded to T5's width, then T5's tokens."""
    vae, (clip_l, clip_g, t5) = model.vae, model.text_encoders
    with torch.no_grad():
        dist = vae.encode(unit_range(batch['image'])).latent_dist
        x = (dist.mean + dist.std * batch['latent_noise'] - vae.config.shift_factor) * vae.config.scaling_factor
        first = clip_l(batch['input_ids'], output_hidden_states=True)
        second = clip_g(batch['input_ids_2'], output_hidden_states=True)
        t5_states = t5(batch['input_ids_3'])[0]
        clip_states = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
        clip_states = torch.nn.functional.pad(clip_states, (0, t5_states.shape[-1] - clip_states.shape[-1]))
        pooled = torch.cat([first.text_embeds, second.text_embeds], dim=-1)
    s = sigmas.view(-1, 1, 1, 1)
    prediction = model.transformer(
        hidden_states=(1 - s) * x + s * batch['noise'],
        timestep=sigmas * 1000,
        encoder_hidden_states=torch.cat([clip_states, t5_states], dim=-2),
        pooled_projections=pooled,
    ).sample
    return ((prediction - (batch['noise'] - x)) ** 2).mean()


def pixart_loss_by_hand(model, batch, timesteps):
    """Diffusers' PixArt example: DDPM noise on scaled latents, T5 with its padding masked, the first half of the
    output channels against the noise."""
    vae, (t5,) = model.vae, model.text_encoders
    with torch.no_grad():
        dist = vae.encode(unit_range(batch['image'])).latent_dist
        x = (dist.mean + dist.std * batch['latent_noise']) * vae.config.scaling_factor
        mask = (batch['input_ids'] != 0).long()
        states = t5(batch['input_ids'], attention_mask=mask)[0]
    noisy = model.noise_scheduler.add_noise(x, batch['noise'], timesteps)
    prediction = model.transformer(
        noisy,
        encoder_hidden_states=states,
        encoder_attention_mask=mask,
        timestep=timesteps,
        added_cond_kwargs={'resolution': None, 'aspect_ratio': None},
    ).sample
    return ((prediction.chunk(2, dim=1)[0] - batch['noise']) ** 2).mean()


@pytest.mark.parametrize(
    'name, by_hand, levels',
    [
        ('tiny-flux-schnell', flux_loss_by_hand, ('sigmas', torch.tensor([0.25, 0.9]))),
        ('tiny-sd3.5-medium', sd3_loss_by_hand, ('sigmas', torch.tensor([0.5, 0.05]))),
        ('tiny-pixart-sigma', pixart_loss_by_hand, ('timesteps', torch.tensor([10, 900]))),
    ],
)
@pytest.mark.stack
def test_training_loss_equals_the_diffusers_recipe(name, by_hand, levels):
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / name)
    batch = {**twin_batch(name), levels[0]: levels[1]}
    loss = model.loss(model(batch), batch)
    expected = by_hand(model, batch, levels[1])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert loss.item() > 0.1  # a real difference, not zero against zero


def test_noise_levels_come_from_the_density_on_the_shifted_grid():
    model = build_model(CONFIGS_DIR / 'tiny-sd3.5-medium')  # shift 3, logit-normal
    torch.manual_seed(1)
    sigmas = model.draw_sigmas(4000)
    grid = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas
    assert torch.isin(sigmas, grid.float()).all()  # on the scheduler's grid
    # Logit-normal u around 0.5, shifted by 3: sigma = 3u / (1 + 2u) has its median at 0.75.
    assert sigmas.median().item() == pytest.approx(0.75, abs=0.03)
    flux = build_model(CONFIGS_DIR / 'tiny-flux-schnell')  # uniform, no shift: MLPerf's
    torch.manual_seed(1)
    uniform = flux.draw_sigmas(4000)
    assert uniform.mean().item() == pytest.approx(0.5, abs=0.02) and uniform.min() > 0 and uniform.max() <= 1


def test_loss_weighting_multiplies_each_samples_loss():
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / 'tiny-sd3.5-medium', recipe=Recipe(loss_weighting='cosmap'))
    sigmas = torch.tensor([0.2, 0.7])
    batch = {**twin_batch('tiny-sd3.5-medium'), 'sigmas': sigmas}
    prediction, target, weights = model(batch)
    cosmap = 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    assert torch.allclose(weights, cosmap)
    per_sample = ((prediction - target) ** 2).flatten(1).mean(1)
    assert model.loss((prediction, target, weights), batch).item() == pytest.approx((cosmap * per_sample).mean().item())


def test_validation_loss_is_the_mean_over_mlperfs_eight_levels():
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / 'tiny-flux-schnell').eval()
    assert model.validation_levels('cpu').tolist() == [k / 8 for k in range(8)]
    batch = twin_batch('tiny-flux-schnell')
    batch['noise'] = torch.randn(2, 8, 16, 8, 8)
    losses = model.validation_losses(batch)
    by_level = []
    for k in range(8):
        single = {**batch, 'noise': batch['noise'][:, k], 'sigmas': torch.full((2,), k / 8)}
        by_level.append(((lambda p, t, w: ((p - t) ** 2).flatten(1).mean(1))(*model(single))))
    assert torch.allclose(losses, torch.stack(by_level, 1).mean(1), rtol=1e-5)
    pixart = build_model(CONFIGS_DIR / 'tiny-pixart-sigma')
    assert pixart.validation_levels('cpu').tolist() == [62, 187, 312, 437, 562, 687, 812, 937]


def test_fsdp_units_are_the_transformer_blocks():
    flux = meta_model('flux-schnell')
    assert len(flux.fsdp_blocks()) == 19 + 38
    assert len(meta_model('sd3.5-medium').fsdp_blocks()) == 24


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--model_name', 'tiny-flux-schnell'], r'^--tokenizer: tiny-flux-schnell reads captions with T5'),
        (['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--prediction_type', 'epsilon'], r'UNet option'),
        (['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--image_size', '72'], r'multiples of 16'),
        (['--model_name', 'tiny-sd3.5-medium', '--use_synth_data', '--image_size', '512'], r'at most 256px'),
        (['--model_name', 'tiny-pixart-sigma', '--use_synth_data', '--loss_weighting', 'cosmap'], r'predicts DDPM'),
        (['--model_name', 'tiny', '--use_synth_data', '--timestep_density', 'mode'], r'is a UNet \(DDPM\)'),
        (['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--logit_std', '0'], r'must be positive'),
        (['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--sample_interval', '2ba'], r'prompts with T5'),
    ],
)
def test_flags_a_transformer_cannot_take_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve_config(parse_args(flags))
    assert '\n' not in str(error.value)


def test_a_sample_interval_of_0_draws_nothing_so_needs_no_t5_tokenizer():
    config = resolve_config(
        parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--sample_interval', '0'])
    )
    assert config.evaluation.sample_interval is None


def test_a_transformers_largest_size_is_checked_at_the_size_its_latents_were_precomputed_at(tmp_path):
    """Precomputed latents fix the size a run trains at: SD3's twin takes at most 256px (16 patches of 16px), and
    latents of 288px are refused at start though the preset's 64px fits; 256px ones train at 256px."""
    from streaming import MDSWriter

    from settings.dataset_checks import PRECOMPUTED_COLUMNS, TRANSFORMER_PRECOMPUTED_COLUMNS

    def latents(name: str, side: int) -> str:
        columns = PRECOMPUTED_COLUMNS | {
            'pooled_text_embedding': TRANSFORMER_PRECOMPUTED_COLUMNS['pooled_text_embedding']
        }
        with MDSWriter(out=str(tmp_path / name), columns=columns) as writer:
            for i in range(8):
                latent = np.zeros((16, side, side), np.float16)
                text, pooled = np.zeros((333, 32), np.float16), np.zeros(32, np.float16)
                sample = {'latent_mean': latent, 'latent_logvar': latent, 'text_embedding': text, 'caption': f'{i}'}
                writer.write(sample | {'pooled_text_embedding': pooled})
        return str(tmp_path / name)

    flags = ['--model_name', 'tiny-sd3.5-medium', '--precomputed_latents', '--batch_size', '4']
    with pytest.raises(ConfigError, match=r'^\S+: latents of 288px: tiny-sd3\.5-medium takes at most 256px$'):
        resolve_config(parse_args([*flags, '--local', latents('large', 36)]))
    assert resolve_config(parse_args([*flags, '--local', latents('largest', 32)])).data.image_size == 256


def test_the_recipe_sets_the_defaults_and_flags_override_it():
    config = resolve_config(parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data']))
    objective = config.objective
    assert (objective.grad_clip_norm, objective.caption_dropout, objective.recipe.timestep_density) == (
        1.0,
        0.1,
        'uniform',
    )
    assert config.as_dict()['timestep_density'] == 'uniform'  # the recipe's, listed under its flag's name
    pixart = resolve_config(parse_args(['--model_name', 'tiny-pixart-sigma', '--use_synth_data'])).as_dict()
    assert pixart['recipe'] is not None and pixart['timestep_density'] is None  # a DDPM step: no flow field applies
    assert objective.recipe.betas == (0.9, 0.95) and objective.recipe.weight_decay == 0.1
    flags = ['--model_name', 'tiny-sd3.5-medium', '--use_synth_data', '--timestep_density', 'mode', '--mode_scale', '2']
    config = resolve_config(parse_args([*flags, '--caption_dropout', '0.2']))
    recipe = config.objective.recipe
    assert (recipe.timestep_density, recipe.mode_scale, config.objective.caption_dropout) == ('mode', 2.0, 0.2)
    precomputed = resolve_config(
        parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--precomputed_latents'])
    )
    assert precomputed.objective.caption_dropout == 0.0 and any('drops none' in note for note in precomputed.notes)
    unet = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data']))
    objective = unet.objective
    assert objective.recipe is None and objective.caption_dropout == 0.0 and objective.grad_clip_norm is None


@pytest.mark.parametrize('name', TWINS.values())
@pytest.mark.parametrize('precomputed', [False, True])
@pytest.mark.stack
def test_each_twin_trains(name, precomputed):
    """Three steps move every weight of the transformer that a gradient reaches (nearly all), and no other weight:
    none of a frozen encoder's."""
    flags = ['--model_name', name, '--use_synth_data', '--max_duration', '3ba', '--batch_size', '4']
    start = WeightsAtStart()
    trainer = main(settled([*flags, *(['--precomputed_latents'] if precomputed else [])]), (start,))
    model = trainer.state.model
    moved = {key: not torch.equal(value, start.weights[key]) for key, value in weights(model).items()}
    assert not any(moved[key] for key in moved if not key.startswith('transformer.'))
    reached = {f'transformer.{key}' for key in start.reached}  # SD3's last block leaves its caption query unused
    assert len(reached) > 0.9 * sum(key.startswith('transformer.') for key in moved)
    assert {key for key, went in moved.items() if went} == reached
    assert trainer.state.timestamp.batch.value == 3
    assert (model.vae is None) == precomputed and len(model.text_encoders) == (
        0 if precomputed else len(FAMILIES[type(model.transformer).__name__].text_encoders)
    )
    assert all(not p.requires_grad for encoder in model.frozen_encoders() for p in encoder.parameters())
    optimized = {id(p) for group in trainer.state.optimizers[0].param_groups for p in group['params']}
    assert optimized == {id(p) for p in model.transformer.parameters()}
    assert math.isfinite(float(trainer.state.loss))
    assert model.flops_per_image(64, 64) > model.trained_flops_per_image(64, 64) or precomputed


def weights(model) -> dict[str, torch.Tensor]:
    """The transformer's parameters and every frozen encoder's, by name."""
    named = {f'transformer.{key}': p for key, p in model.transformer.named_parameters()}
    for number, encoder in enumerate(model.frozen_encoders()):
        named.update({f'encoder{number}.{key}': p for key, p in encoder.named_parameters()})
    return named


def moved_weights(trainer, start) -> set[str]:
    """The weights (weights()'s names) that training changed since the run's start."""
    trained = weights(trainer.state.model)
    return {key for key, value in trained.items() if not torch.equal(value, start.weights[key])}


class WeightsAtStart(Callback):
    """The weights before training, and the transformer's parameters that a gradient reached."""

    def fit_start(self, state, logger):
        self.weights = {key: p.detach().clone() for key, p in weights(state.model).items()}
        self.reached = set()

    def after_backward(self, state, logger):
        self.reached |= {
            key for key, p in state.model.transformer.named_parameters() if p.grad is not None and p.grad.any()
        }


def test_families_are_told_apart_by_their_transformer_class():
    assert {type(meta_model(name).transformer).__name__ for name in TWINS.values()} == {FLUX, SD3, PIXART}


# ------------------------------------------------------------------------------------- real captions


@pytest.fixture(scope='module')
def t5_tokenizer(tmp_path_factory):
    return write_t5_tokenizer(tmp_path_factory.mktemp('t5-tokenizer'))


@pytest.fixture(scope='module')
def captions(tmp_path_factory):
    """12 JPEGs with captions, as convert.py writes them ('photo number 0', ...)."""
    return write_dataset(tmp_path_factory.mktemp('captions') / 'mds', good_samples(12))


@pytest.mark.stack
def test_t5_columns_read_the_local_tokenizer_and_clip_columns_the_builtin_one(t5_tokenizer):
    inputs = caption_inputs(builtin_folder('tiny-sd3.5-medium'))
    tokenizers = column_tokenizers(t5_tokenizer, inputs)
    clip_l, clip_g, t5 = (tokenizers[column]('a photo of the cat') for column in inputs.id_columns)
    assert clip_l[0] == clip_g[0] == CLIP_START_ID and len(clip_l) == len(clip_g) == 77
    assert t5.tolist() == [3, 4, 5, 6, 7, T5_END_ID] + [T5_PAD_ID] * 250  # SD3's 256 T5 tokens
    # CLIP's captions are lowercased, as CLIP was trained; T5 is cased, and its captions keep their case.
    clip_column, _, t5_column = (tokenizers[column] for column in inputs.id_columns)
    assert torch.equal(clip_column('A CAT'), clip_column('a cat'))
    assert not torch.equal(t5_column('A CAT'), t5_column('a cat'))
    pixart = column_tokenizers(t5_tokenizer, caption_inputs(builtin_folder('tiny-pixart-sigma')))['input_ids']
    long_caption = pixart(' '.join(['cat'] * 400))
    assert len(long_caption) == 300 and long_caption[-1] == T5_END_ID  # truncated, </s> kept last


@pytest.mark.parametrize(
    'tokenizer, message',
    [
        (None, r'^--tokenizer: tiny-pixart-sigma reads captions with T5'),
        (str(clip_tokenizer_folder()), r"not T5's \(below 32128, ending in </s> = 1\)"),
    ],
)
def test_a_t5_model_reading_captions_needs_a_t5_tokenizer(captions, tokenizer, message):
    flags = ['--model_name', 'tiny-pixart-sigma', '--local', captions]
    flags += ['--tokenizer', tokenizer] if tokenizer else []
    with pytest.raises(ConfigError, match=message) as error:
        resolve_config(parse_args(flags))
    assert '\n' not in str(error.value)


def test_flux_trains_on_captions_and_validates(captions, t5_tokenizer, tmp_path):
    results = tmp_path / 'results.json'
    flags = ['--model_name', 'tiny-flux-schnell', '--local', captions, '--tokenizer', t5_tokenizer]
    flags += ['--image_size', '32', '--batch_size', '4', '--max_duration', '2ba']
    split = write_dataset(tmp_path / 'split', [{'jpg': jpeg(100 + i), 'caption': f'held out {i}'} for i in range(4)])
    start = WeightsAtStart()
    trainer = main(
        settled([*flags, '--eval_local', split, '--eval_interval', '2ba', '--results_json', str(results)]), (start,)
    )
    assert trainer.state.timestamp.batch.value == 2 and math.isfinite(float(trainer.state.loss))
    assert moved_weights(trainer, start) == {f'transformer.{key}' for key in start.reached}
    curve = json.loads(results.read_text())['val_loss_curve']
    assert [samples for samples, _ in curve] == [0, 8] and all(math.isfinite(loss) for _, loss in curve)
    assert curve[0][1] != curve[1][1]  # the same split and draws at both ends: the trained weights told apart


@pytest.mark.parametrize('name', ['tiny-flux-schnell', 'tiny-pixart-sigma'])
def test_precomputed_captions_give_the_online_loss_and_train(name, captions, t5_tokenizer, tmp_path):
    out = tmp_path / 'latents'
    flags = ['--local', captions, '--out', str(out), '--model_name', name, '--image_size', '32']
    summary = precompute.main([*flags, '--tokenizer', t5_tokenizer])
    assert summary['encoded'] == 12 and summary['bad'] == 0
    stored = PrecomputedLatentsDataset(local=str(out), shuffle=False, batch_size=1)
    first = stored[0]
    t5_length = 256 if name == 'tiny-flux-schnell' else 300
    assert first['text_embedding'].shape[0] == t5_length and first['text_embedding'].dtype == torch.float16
    if name == 'tiny-pixart-sigma':  # 'photo number 0': three words and </s>, the rest T5's padding
        assert 'pooled_text_embedding' not in first and int(first['text_mask'].sum()) == len(
            column_tokenizers(t5_tokenizer, caption_inputs(builtin_folder(name)))['input_ids'](
                'photo number 0'
            ).nonzero()
        )
    else:
        assert first['pooled_text_embedding'].shape == (32,) and 'text_mask' not in first

    # precompute.py's rows give the online loss: its encoders (those of its --seed) on the same images and captions
    torch.manual_seed(0)
    online = build_model(CONFIGS_DIR / name)
    reproducibility.seed_all(17)  # precompute.py's default --seed
    vae, text_encoders, _ = build_frozen_encoders(CONFIGS_DIR / name)
    online.vae.load_state_dict(vae.state_dict())
    for mine, its in zip(online.text_encoders, text_encoders):
        mine.load_state_dict(its.state_dict())
    rows = default_collate(
        [
            {
                column: torch.as_tensor(value)
                for column, value in stored[i].items()
                if column in first and not isinstance(value, str)
            }
            for i in range(2)
        ]
    )
    got, expected = online_and_stored_losses(name, online, captions, t5_tokenizer, rows)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)  # fp16's rounding of the stored columns alone

    flags = ['--model_name', name, '--precomputed_latents', '--local', str(out), '--batch_size', '4']
    start = WeightsAtStart()
    trainer = main(settled([*flags, '--max_duration', '2ba']), (start,))
    assert trainer.state.timestamp.batch.value == 2 and math.isfinite(float(trainer.state.loss))
    moved = moved_weights(trainer, start)
    assert moved == {f'transformer.{key}' for key in start.reached} and len(moved) > 0.9 * len(start.weights)


@pytest.mark.parametrize(
    'tokenizer, size, message',
    [
        (None, 32, r'^--tokenizer: tiny-flux-schnell reads captions with T5'),
        ('clip', 32, r"not T5's \(below 32128"),
        ('t5', 40, r'^--image_size 40: tiny-flux-schnell takes multiples of 16'),
    ],
)
def test_precompute_refuses_what_a_transformer_cannot_train_on(
    captions, t5_tokenizer, tmp_path, tokenizer, size, message
):
    folders = {None: [], 'clip': ['--tokenizer', str(clip_tokenizer_folder())], 't5': ['--tokenizer', t5_tokenizer]}
    flags = ['--local', captions, '--out', str(tmp_path / 'out'), '--model_name', 'tiny-flux-schnell']
    with pytest.raises(ConfigError, match=message) as error:
        settle_precompute(precompute.parse_args([*flags, '--image_size', str(size), *folders[tokenizer]]))
    assert '\n' not in str(error.value)


def online_and_stored_losses(name, online, captions, t5_tokenizer, stored: dict) -> tuple:
    """The loss of the online model on the first two images and captions of `captions`, and of a model without
    encoders (the online one's transformer) on their `stored` columns, under the same draws."""
    without_encoders = build_model(CONFIGS_DIR / name, precomputed=True)
    without_encoders.transformer.load_state_dict(online.transformer.state_dict())
    inputs = caption_inputs(builtin_folder(name))
    images = StreamingLAIONDataset(
        local=captions, image_size=32, tokenizer=t5_tokenizer, inputs=inputs, shuffle=False, batch_size=1
    )
    batch = default_collate([images[i] for i in range(2)])
    channels = 4 if name == 'tiny-pixart-sigma' else 16
    generator = torch.Generator().manual_seed(1)
    draws = {'latent_noise': torch.randn(2, channels, 4, 4, generator=generator)}
    draws['noise'] = torch.randn(2, channels, 4, 4, generator=generator)
    draws['sigmas' if name != 'tiny-pixart-sigma' else 'timesteps'] = (
        torch.tensor([0.25, 0.75]) if name != 'tiny-pixart-sigma' else torch.tensor([250, 750])
    )
    stored = {column: values[:2] for column, values in stored(batch).items()} if callable(stored) else stored
    with torch.no_grad():
        expected = online.loss(online({**batch, **draws}), batch)
        got = without_encoders.loss(without_encoders({**stored, **draws}), stored)
    return got, expected


@pytest.mark.parametrize('name', TWINS.values())
def test_the_precomputed_step_equals_the_online_step_on_captions(name, captions, t5_tokenizer):
    """precompute.py's columns (fp16) give the loss of the images and captions they came from."""
    torch.manual_seed(0)
    online = build_model(CONFIGS_DIR / name)

    def encoded(batch):
        columns = precomputing.encode(
            read_model_folder(online.model_dir), online.vae, online.text_encoders, batch, torch.device('cpu')
        )
        return {column: torch.from_numpy(array) for column, array in columns.items()}

    got, expected = online_and_stored_losses(name, online, captions, t5_tokenizer, encoded)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------- pipelines

# The arguments that make a plain call of each exported pipeline draw what generate.py draws (--guidance_scale 7.5).
PLAIN_CALL = {
    'tiny-flux-schnell': dict(negative_prompt='', true_cfg_scale=7.5, max_sequence_length=256),
    'tiny-sd3.5-medium': dict(guidance_scale=7.5),
    'tiny-pixart-sigma': dict(guidance_scale=7.5, use_resolution_binning=False, clean_caption=False),
}


@pytest.mark.parametrize('name', TWINS.values())
@pytest.mark.stack
def test_the_exported_pipeline_draws_the_images_of_the_checkpoint(name, captions, t5_tokenizer, tmp_path):
    pipe, samples, checkpoints = tmp_path / 'pipe', tmp_path / 'samples', tmp_path / 'ckpt'
    flags = ['--model_name', name, '--local', captions, '--tokenizer', t5_tokenizer, '--image_size', '32']
    flags += ['--batch_size', '4', '--max_duration', '2ba', '--use_ema', '--ema_half_life', '1ba']
    flags += ['--sample_interval', '2ba', '--sample_steps', '2', '--sample_dir', str(samples)]
    flags += ['--export_pipeline', str(pipe), '--save_folder', str(checkpoints), '--save_interval', '2ba']
    main(settled(flags))
    assert sorted(path.name for path in samples.iterdir()) == [
        'samples-ba000000.png',
        'samples-ba000002.png',
        'samples-ema-ba000000.png',
        'samples-ema-ba000002.png',
    ]

    # generate.py from the folder and from the checkpoint's EMA weights: the same images; not the training weights'.
    prompts = ['a red circle', 'A yellow  square']
    common = ['--prompt', prompts[0], '--prompt', prompts[1], '--steps', '2', '--batch_size', '1', '--image_size', '32']
    from_folder = generate.main(generate.parse_args([*common, '--pipeline', str(pipe), '--out', str(tmp_path / 'g1')]))
    checkpoint = [
        '--checkpoint',
        str(checkpoints / 'latest-rank0.pt'),
        '--model_name',
        name,
        '--tokenizer',
        t5_tokenizer,
    ]
    from_ema = generate.main(generate.parse_args([*common, *checkpoint, '--ema', '--out', str(tmp_path / 'g2')]))
    from_trained = generate.main(generate.parse_args([*common, *checkpoint, '--out', str(tmp_path / 'g3')]))
    assert from_folder.shape == (2, 3, 32, 32)
    torch.testing.assert_close(from_folder, from_ema, atol=1e-5, rtol=0)
    assert (from_folder - from_trained).abs().max() > 1e-3
    if builtin_folder(name).family != PIXART:  # a flow-matching model samples with its own Euler sampler only
        with pytest.raises(ConfigError, match=f'--scheduler ddim: {name} is a flow-matching model'):
            generate.main(generate.parse_args([*common, *checkpoint, '--scheduler', 'ddim', '--out', 'unused']))

    # The pipeline's own class loads the folder offline, and a plain call draws generate.py's image for its seed.
    pipeline = DiffusionPipeline.from_pretrained(pipe, local_files_only=True)
    assert type(pipeline).__name__ == {FLUX: 'FluxPipeline', SD3: 'StableDiffusion3Pipeline'}.get(
        type(pipeline.transformer).__name__, 'PixArtSigmaPipeline'
    )
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(1)  # image 1 of generate.py is drawn from seed 0 + 1
    image = pipeline(
        prompts[1],
        height=32,
        width=32,
        num_inference_steps=2,
        generator=generator,
        output_type='pt',
        **PLAIN_CALL[name],
    ).images[0]
    torch.testing.assert_close(image, from_folder[1], atol=1e-5, rtol=0)


def test_pipeline_flags_and_generate_refuse_what_they_cannot_draw(tmp_path):
    flags = ['--model_name', 'tiny-sd3.5-medium', '--use_synth_data', '--export_pipeline', str(tmp_path / 'pipe')]
    with pytest.raises(ConfigError, match=r"^--export_pipeline: tiny-sd3.5-medium's pipeline reads prompts with T5"):
        resolve_config(parse_args(flags))
    checkpoint = tmp_path / 'ckpt.pt'
    torch.save({'state': {'model': {}}}, checkpoint)  # a checkpoint's form, recording no run: --model_name given
    args = ['--checkpoint', str(checkpoint), '--model_name', 'tiny-flux-schnell', '--prompt', 'a', '--out', 'o']
    with pytest.raises(generate.GenerateError, match=r'^--tokenizer: tiny-flux-schnell reads prompts with T5'):
        generate.main(generate.parse_args(args))  # no record beside it: the flags are settled once torch reads it
    # generate.py draws with the pipelines the export builds, at their sizes (Flux's: multiples of 16 pixels).
    for kind, flags, message in [
        ('StableDiffusionXLPipeline', [], r'a StableDiffusionXLPipeline; generate.py draws with'),
        ('FluxPipeline', ['--image_size', '40'], r'^--image_size 40: must be a multiple of 16'),
    ]:
        folder = tmp_path / kind
        folder.mkdir()
        (folder / 'model_index.json').write_text(json.dumps({'_class_name': kind}))
        args = generate.parse_args(['--pipeline', str(folder), '--prompt', 'a', '--out', str(tmp_path / 'o'), *flags])
        with pytest.raises(generate.GenerateError, match=message):
            generate.check_args(args)


def test_precomputed_latents_a_transformer_cannot_patch_are_refused(tmp_path):
    """Latents of 40px (5x5) cannot be cut into Flux's 2x2 patches: refused at the start, naming the dataset."""
    from streaming import MDSWriter

    with MDSWriter(
        out=str(tmp_path / 'odd'), columns=precomputing.output_columns(builtin_folder('tiny-flux-schnell'))
    ) as out:
        for _ in range(4):
            out.write(
                {
                    'latent_mean': np.zeros((16, 5, 5), np.float16),
                    'latent_logvar': np.zeros((16, 5, 5), np.float16),
                    'text_embedding': np.zeros((256, 32), np.float16),
                    'pooled_text_embedding': np.zeros(32, np.float16),
                    'caption': 'a cat',
                }
            )
    flags = ['--model_name', 'tiny-flux-schnell', '--precomputed_latents', '--local', str(tmp_path / 'odd')]
    flags += ['--batch_size', '4']
    with pytest.raises(ConfigError, match=r'latents of 5x5 \(40px\), but tiny-flux-schnell reads 2x2 patches'):
        resolve_config(parse_args(flags))


# ------------------------------------------------------------------------------------------ float8 training


@pytest.mark.parametrize(
    'name, levels',
    [
        ('tiny-flux-schnell', ('sigmas', torch.tensor([0.25, 0.9]))),
        ('tiny-sd3.5-medium', ('sigmas', torch.tensor([0.5, 0.05]))),
        ('tiny-pixart-sigma', ('timesteps', torch.tensor([10, 900]))),
    ],
)
@pytest.mark.stack
def test_fp8_converts_the_linear_layers_and_keeps_the_loss_within_float8_rounding(name, levels):
    """torchao's float8 training, emulated on the CPU (its casts to e4m3 and e5m2 around ordinary matmuls)."""
    from models.diffusion_transformer import convert_to_float8

    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / name)
    batch = {**twin_batch(name), levels[0]: levels[1]}
    reference = model.loss(model(batch), batch)
    linear = [m for m in model.transformer.modules() if isinstance(m, torch.nn.Linear)]
    convertible = [m for m in linear if m.in_features % 16 == 0 and m.out_features % 16 == 0]
    assert convert_to_float8(model.transformer, emulate=True) == len(convertible) > 0
    assert not any(type(m).__name__ == 'Float8Linear' for m in model.vae.modules())  # only the transformer's
    loss = model.loss(model(batch), batch)
    loss.backward()
    # e4m3 keeps 3 mantissa bits (a relative step of 1/16): the loss moves by far less than that, but it moves.
    assert loss.item() == pytest.approx(reference.item(), rel=0.05) and loss.item() != reference.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.transformer.parameters())


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    from settings import hardware

    with pytest.raises(ConfigError, match=r'--fp8 needs float8 matrix units .*; no GPU here'):
        resolve_config(parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--fp8']))
    h100 = hardware.Gpu('NVIDIA H100 80GB HBM3', 85_029_158_912, True, (9, 0))
    a100 = hardware.Gpu('NVIDIA A100-SXM4-40GB', 42_505_273_344, True, (8, 0))
    for gpu, flags, message in (
        (a100, [], 'NVIDIA A100-SXM4-40GB has compute capability 8.0'),
        (h100, ['--model_name', 'tiny'], 'tiny is a UNet'),
        (h100, ['--precision', 'amp_fp16'], 'leave --precision amp_fp16 out'),
    ):
        fake_gpu(monkeypatch, gpu)
        with pytest.raises(ConfigError, match=message):
            resolve_config(parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--fp8', *flags]))
    fake_gpu(monkeypatch, h100)
    assert resolve_config(parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--fp8'])).speed.fp8


@pytest.mark.slow
def test_the_campaigns_transformer_step_compiles_the_blocks_whose_forward_and_backward_it_times(monkeypatch):
    """benchmarks/campaign_probes.py transformer_step --compile, as the GPU campaign compares float8 with bf16: the
    transformer's repeated blocks compiled (each once, no recompile in the timed steps), the backward through AOT
    autograd, and the step giving the loss and gradients eager gives from the same weights and batch. aot_eager runs
    Dynamo and AOT autograd as on a GPU, without Inductor."""
    from torch._dynamo.utils import counters

    from benchmarks import campaign_probes

    models, batches = [], []

    def kept_model(*args, **kwargs):  # the probe's model, keeping the batch of each loss it takes
        model = build_model(*args, **kwargs)
        loss = model.loss

        def kept_loss(outputs, batch):
            batches.append(batch)
            return loss(outputs, batch)

        model.loss = kept_loss
        models.append(model)
        return model

    monkeypatch.setattr(campaign_probes, 'build_model', kept_model)
    monkeypatch.setattr(campaign_probes, 'COMPILE_BACKEND', 'aot_eager')
    torch._dynamo.reset()
    counters.clear()
    argv = ['transformer_step', '--model_name', 'tiny-flux-schnell', '--image_size', '64', '--microbatch', '2']
    measured = campaign_probes.main([*argv, '--compile'])
    assert measured['compiled'] and measured['img_per_sec'] > 0 and measured['microbatch'] == 2
    assert measured['measures'] == 'the transformer forward and backward only (no optimizer step, no encoders)'
    (model,) = models
    wrapped = [module for module in model.denoiser.modules() if getattr(module, '_compiled_call_impl', None)]
    assert wrapped and model.denoiser not in wrapped and not counters['graph_break']
    assert len(batches) == 2 + 5  # two warm-ups (compiling, then any recompile), five timed
    batch, gradients = batches[-1], []
    for compiled in (True, False):  # the compiled blocks, then the same modules run eagerly
        for module in wrapped:
            module._compiled_call_impl = module._compiled_call_impl if compiled else None
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        model.loss(model(batch), batch).backward()
        gradients.append([p.grad for p in model.denoiser.parameters()])
        if compiled:
            kept = [module._compiled_call_impl for module in wrapped]
    for module, call in zip(wrapped, kept):
        module._compiled_call_impl = call
    assert all(grad is not None and torch.isfinite(grad).all() for grad in gradients[0])
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-4, atol=1e-6)
    assert not campaign_probes.main(argv)['compiled']


# ------------------------------------------------------------------------------------- the smoke T5 tokenizer


@pytest.mark.stack
def test_the_smoke_t5_tokenizer_gives_t5s_ids_padding_and_end_of_text(tmp_path):
    from transformers import AutoTokenizer

    from settings.tokenizer import TokenizerError, check_tokenizer, empty_caption_ids, t5_smoke_tokenizer_folder

    folder = str(t5_smoke_tokenizer_folder(tmp_path / 't5-smoke'))
    for name in TWINS.values():
        check_tokenizer(folder, caption_inputs(builtin_folder(name)))  # T5's ids, or a one-line ConfigError
    inputs = caption_inputs(builtin_folder('tiny-flux-schnell'))
    t5 = column_tokenizers(folder, inputs)[inputs.id_columns[inputs.vocab_sizes.index(T5_VOCAB_SIZE)]]
    caption = 'A red circle on a blue background, 3 cats!'
    ids = t5(caption).tolist()
    words = ids[: ids.index(T5_END_ID)]
    assert len(ids) == 256 and ids[len(words) + 1 :] == [T5_PAD_ID] * (255 - len(words))
    assert all(2 < i < T5_VOCAB_SIZE for i in words)  # no padding, </s> or <unk> inside an ASCII caption
    loaded = AutoTokenizer.from_pretrained(folder)  # as an exported pipeline loads it
    assert loaded.decode(words) == caption
    assert loaded(caption, padding='max_length', max_length=256).input_ids == ids  # the pipeline's ids: training's
    assert t5('').tolist() == empty_caption_ids(T5_PAD_ID, 256).tolist()  # the empty caption of caption dropout
    assert t5('A cat').tolist() != t5('a cat').tolist()  # cased, as T5
    assert t5(' '.join(['cat'] * 400))[-1] == T5_END_ID  # truncated with </s> kept last
    # Written once: a second call (make t5-smoke-tokenizer again, another rank) leaves the folder as it is.
    written = (tmp_path / 't5-smoke' / 'tokenizer.json').stat().st_mtime_ns
    assert t5_smoke_tokenizer_folder(tmp_path / 't5-smoke') == tmp_path / 't5-smoke'
    assert (tmp_path / 't5-smoke' / 'tokenizer.json').stat().st_mtime_ns == written
    with pytest.raises(TokenizerError, match='not empty, and no tokenizer.json in it: give a new folder'):
        t5_smoke_tokenizer_folder(tmp_path)  # a folder of other files is never mixed into


def test_tiny_flux_trains_on_a_converted_folder_with_the_smoke_t5_tokenizer(tmp_path):
    """The smoke run of docs/models.md: captioned images through convert.py, then Flux's twin on them."""
    import convert
    from settings.tokenizer import t5_smoke_tokenizer_folder

    photos = tmp_path / 'photos'
    photos.mkdir()
    for i in range(8):
        (photos / f'{i}.jpg').write_bytes(jpeg(i))
        (photos / f'{i}.txt').write_text(f'A photo of {i} red circles on a blue background')
    assert convert.convert([str(photos)], str(tmp_path / 'mds'), progress=False)['written'] == 8
    tokenizer = str(t5_smoke_tokenizer_folder(tmp_path / 't5-smoke'))
    flags = ['--model_name', 'tiny-flux-schnell', '--local', str(tmp_path / 'mds'), '--tokenizer', tokenizer]
    start = WeightsAtStart()
    trainer = main(settled([*flags, '--image_size', '32', '--batch_size', '4', '--max_duration', '2ba']), (start,))
    assert trainer.state.timestamp.batch.value == 2 and math.isfinite(float(trainer.state.loss))
    assert moved_weights(trainer, start) == {f'transformer.{key}' for key in start.reached}


# ------------------------------------------------------------------------------------- a folder's own fields

SCHEDULER, VAE_CONFIG, UNET_CONFIG = 'scheduler/scheduler_config.json', 'vae/config.json', 'unet/config.json'
TRANSFORMER_CONFIG_FILE = 'transformer/config.json'


def twin_folder(tmp_path, name, changes):
    """A copy of a twin's folder with fields of its configs changed: {config file: {field: value}}."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(CONFIGS_DIR / name, folder)
    for file, fields in changes.items():
        path = folder / file
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


def flux_dev_twin(tmp_path):
    """Flux.1-dev's differences from schnell: a guidance embedding, and the scheduler's dynamic shifting."""
    changes = {TRANSFORMER_CONFIG_FILE: {'guidance_embeds': True}}
    changes[SCHEDULER] = {'use_dynamic_shifting': True, 'shift': 3.0}
    return twin_folder(tmp_path, 'tiny-flux-schnell', changes)


def flux_loss_with_guidance_by_hand(folder, model, batch, guidance):
    """Diffusers' Flux training example on a precomputed batch (latent log-variance 0), its guidance tensor passed."""
    vae = json.loads((folder / VAE_CONFIG).read_text())
    x = (batch['latent_mean'] + batch['latent_noise'] - vae['shift_factor']) * vae['scaling_factor']
    pooled, states = batch['pooled_text_embedding'], batch['text_embedding']
    return flux_flow_loss(model.transformer, x, batch['noise'], batch['sigmas'], pooled, states, guidance)


def test_a_guidance_distilled_flux_embeds_its_guidance_in_the_step(tmp_path):
    folder = flux_dev_twin(tmp_path)
    torch.manual_seed(0)
    model = build_model(folder, precomputed=True, recipe=Recipe(flux_guidance=2.0))
    generator = torch.Generator().manual_seed(0)
    batch = {name: torch.randn(2, 16, 8, 8, generator=generator) for name in ('latent_mean', 'latent_noise', 'noise')}
    batch['latent_logvar'] = torch.zeros(2, 16, 8, 8)
    batch['text_embedding'] = torch.randn(2, 256, 32, generator=generator)
    batch['pooled_text_embedding'] = torch.randn(2, 32, generator=generator)
    batch['sigmas'] = torch.tensor([0.3, 0.8])
    loss = model.loss(model(batch), batch)
    with torch.no_grad():
        at_two, at_default = (flux_loss_with_guidance_by_hand(folder, model, batch, g) for g in (2.0, 3.5))
    assert loss.item() == pytest.approx(at_two.item(), rel=1e-5)
    assert at_two.item() != pytest.approx(at_default.item(), rel=1e-4)  # the guidance reaches the output
    loss.backward()
    assert model.transformer.time_text_embed.guidance_embedder.linear_1.weight.grad.abs().sum() > 0  # and trains
    assert build_model(folder, precomputed=True).guidance == 3.5  # Diffusers' Flux example's default


def test_a_guidance_distilled_flux_folder_trains_and_samples_at_its_guidance(tmp_path, t5_tokenizer):
    flags = ['--model_name', str(flux_dev_twin(tmp_path)), '--use_synth_data', '--image_size', '64']
    pipe = tmp_path / 'pipe'
    exported = ['--export_pipeline', str(pipe), '--tokenizer', t5_tokenizer]
    trainer = main(settled([*flags, '--batch_size', '4', '--max_duration', '2ba', '--flux_guidance', '2.5', *exported]))
    assert trainer.state.timestamp.batch.value == 2 and math.isfinite(float(trainer.state.loss))
    assert trainer.state.model.guidance == 2.5
    # The exported folder records the guidance, and the pipeline embeds the one it is given.
    assert json.loads((pipe / 'run_description.json').read_text())['flux_guidance'] == 2.5
    pipeline = DiffusionPipeline.from_pretrained(pipe, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    at_trained, at_other = (generate_images(pipeline, ['a cat'], [0], 1, 1.0, 32, None, g) for g in (2.5, 9.0))
    assert (at_trained - at_other).abs().max() > 1e-4
    config = resolve_config(parse_args(flags))
    assert (config.objective.flux_guidance, config.objective.recipe.flux_guidance) == (3.5, 3.5)
    schnell = resolve_config(parse_args(['--model_name', 'tiny-flux-schnell', '--use_synth_data']))
    assert schnell.objective.flux_guidance is None


def test_pixart_trains_the_target_its_scheduler_names(tmp_path):
    folder = twin_folder(tmp_path, 'tiny-pixart-sigma', {SCHEDULER: {'prediction_type': 'v_prediction'}})
    torch.manual_seed(0)
    model = build_model(folder)
    timesteps = torch.tensor([10, 900])
    batch = {**twin_batch('tiny-pixart-sigma'), 'timesteps': timesteps}
    prediction, target, weights = model(batch)
    with torch.no_grad():
        x, _ = model.encode(batch)
    # v = sqrt(alpha_bar) noise - sqrt(1 - alpha_bar) x, on PixArt's linear betas 0.0001 to 0.02 over 1000 steps.
    alpha_bar = torch.cumprod(1 - torch.linspace(0.0001, 0.02, 1000), 0)[timesteps].view(-1, 1, 1, 1)
    velocity = alpha_bar.sqrt() * batch['noise'] - (1 - alpha_bar).sqrt() * x
    torch.testing.assert_close(target, velocity)
    assert not torch.allclose(target, batch['noise'], atol=0.1)
    assert model.loss((prediction, target, weights), batch).item() == pytest.approx(
        ((prediction - velocity) ** 2).mean().item(), rel=1e-5
    )
    pixart = resolve_config(parse_args(['--model_name', str(folder), '--use_synth_data', '--image_size', '64']))
    assert pixart.objective.recipe


@pytest.mark.parametrize(
    'name, changes, flags, message',
    [
        ('tiny-flux-schnell', {SCHEDULER: {'_class_name': 'DDPMScheduler'}}, [], r"names 'DDPMScheduler', but Flux"),
        ('tiny-sd3.5-medium', {SCHEDULER: {'_class_name': 'FlowMatchHeunDiscreteScheduler'}}, [], r'draws its noise'),
        (
            'tiny-pixart-sigma',
            {SCHEDULER: {'_class_name': 'FlowMatchEulerDiscreteScheduler'}},
            [],
            r'a flow matching schedule; PixArtTransformer2DModel trains on the DDPM noise',
        ),
        (
            'tiny-pixart-sigma',
            {SCHEDULER: {'_class_name': 'DPMSolverMultistepScheduler', 'use_flow_sigmas': True}},
            [],
            r"'DPMSolverMultistepScheduler' with flow sigmas",
        ),
        ('tiny-pixart-sigma', {SCHEDULER: {'prediction_type': 'sample'}}, [], r"prediction_type 'sample'; PixArt.*$"),
        ('tiny', {SCHEDULER: {'prediction_type': 'sample'}}, [], r"'sample'; a UNet trains .*: pass --prediction_type"),
        ('tiny', {SCHEDULER: {'_class_name': 'EDMEulerScheduler'}}, [], r'an EDM schedule; a UNet trains'),
        ('tiny', {SCHEDULER: {'beta_schedule': 'exp'}}, [], r"beta_schedule 'exp'; the DDPM training step knows"),
        ('tiny', {VAE_CONFIG: {'latents_mean': [0.0] * 4, 'latents_std': [1.0] * 4}}, [], r'latents_mean/latents_std'),
        ('tiny', {UNET_CONFIG: {'time_cond_proj_dim': 32}}, [], r'time_cond_proj_dim .* would stay untrained$'),
        ('tiny', {VAE_CONFIG: {'shift_factor': 0.1159}}, [], r'shift_factor 0.1159, which the UNets'),
        ('tiny-flux-schnell', {}, ['--flux_guidance', '2'], r'^--flux_guidance: .* embeds no guidance scale'),
        ('tiny-pixart-sigma', {}, ['--precondition_outputs'], r'^--precondition_outputs: a flow matching option'),
        ('tiny', {}, ['--no-precondition_outputs'], r'^--precondition_outputs: .* is a UNet \(DDPM\)'),
    ],
)
def test_a_field_the_step_would_not_honour_is_refused_in_one_line(tmp_path, name, changes, flags, message):
    folder = twin_folder(tmp_path, name, changes)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_config(parse_args(['--model_name', str(folder), '--use_synth_data', '--image_size', '64', *flags]))
    assert '\n' not in str(error.value)


def test_a_unet_folders_target_is_the_flags_where_given(tmp_path):
    folder = twin_folder(tmp_path, 'tiny', {SCHEDULER: {'prediction_type': 'sample'}})
    flags = ['--model_name', str(folder), '--use_synth_data', '--image_size', '64', '--prediction_type', 'epsilon']
    assert resolve_config(parse_args(flags)).model.prediction_type == 'epsilon'


@pytest.mark.parametrize('weighting', ['none', 'cosmap'])
def test_preconditioned_outputs_give_the_sd3_examples_loss(weighting):
    torch.manual_seed(0)
    plain = build_model(CONFIGS_DIR / 'tiny-sd3.5-medium', recipe=Recipe(loss_weighting=weighting))
    preconditioned = build_model(
        CONFIGS_DIR / 'tiny-sd3.5-medium', recipe=Recipe(loss_weighting=weighting, precondition_outputs=True)
    )
    preconditioned.load_state_dict(plain.state_dict())
    sigmas = torch.tensor([0.3, 0.9])
    batch = {**twin_batch('tiny-sd3.5-medium'), 'sigmas': sigmas}
    loss = preconditioned.loss(preconditioned(batch), batch)
    # Diffusers' SD3 example with --precondition_outputs 1: the output v becomes noisy - sigma v, against x.
    with torch.no_grad():
        x, _ = plain.encode(batch)
        output, _, _ = plain(batch)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1 - s) * x + s * batch['noise']
    weight = 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2)) if weighting == 'cosmap' else torch.ones(2)
    by_hand = (weight * ((output * (-s) + noisy - x) ** 2).flatten(1).mean(1)).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    # which is the rectified-flow loss scaled by sigma squared per sample
    flow = (weight * sigmas**2 * ((output - (batch['noise'] - x)) ** 2).flatten(1).mean(1)).mean()
    assert loss.item() == pytest.approx(flow.item(), rel=1e-4)
    assert loss.item() < 0.9 * plain.loss(plain(batch), batch).item()
    # The validation loss stays the velocity's, so runs with and without it compare.
    validation = {**batch, 'noise': torch.randn(2, 8, 16, 8, 8)}
    torch.testing.assert_close(preconditioned.validation_losses(validation), plain.validation_losses(validation))


def test_precondition_outputs_is_a_flow_recipe_option_off_by_default():
    flags = ['--model_name', 'tiny-sd3.5-medium', '--use_synth_data']
    assert resolve_config(parse_args(flags)).objective.recipe.precondition_outputs is False
    config = resolve_config(parse_args([*flags, '--precondition_outputs']))
    assert config.objective.recipe.precondition_outputs is True and config.as_dict()['precondition_outputs'] is True
