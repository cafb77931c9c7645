"""Does it learn: the validation loss (fixed draws per sample, any batch size or rank count, outside the throughput
windows), sample grids, the exported pipeline and generate.py, the learning curve, and the stability options."""

import json
import logging
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from composer.core import Callback
from conftest import TINY, good_samples, run_cli, settled, write_dataset

import generate
from benchmarks import learning_curve
from guards.arguments import ConfigError
from models.parts import ValidationLoss
from models.stable_diffusion import build_model, validation_timesteps
from runs.evaluation import ValidationSplit, sample_draws
from runs.export import pipeline_tokenizer
from runs.run import main
from runs.stability import CaptionDropout
from settings.config import resolve_config
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR, caption_inputs, read_model_folder
from settings.tokenizer import CaptionTokenizer

SMALL = [*TINY, '--image_size', '32', '--batch_size', '4']


@pytest.fixture(scope='module')
def split(tmp_path_factory):
    """A held-out split of 7 images (an odd count: two ranks get a repeated sample to even out)."""
    return write_dataset(tmp_path_factory.mktemp('validation') / 'mds', good_samples(7))


# -------------------------------------------------------------------------------- validation loss


def test_draws_depend_on_the_sample_index_only():
    assert validation_timesteps(1000).tolist() == [62, 187, 312, 437, 562, 687, 812, 937]
    first, again, other = sample_draws(5, (4, 4, 4)), sample_draws(5, (4, 4, 4)), sample_draws(6, (4, 4, 4))
    assert first['noise'].shape == (8, 4, 4, 4) and first['latent_noise'].shape == (4, 4, 4)
    assert torch.equal(first['noise'], again['noise']) and torch.equal(first['latent_noise'], again['latent_noise'])
    assert not torch.equal(first['noise'], other['noise'])


def mean_loss(model, split_dataset, batches) -> float:
    metric = ValidationLoss()
    for indices in batches:
        batch = torch.utils.data.default_collate([split_dataset[i] for i in indices])
        metric.update(model.validation_losses(batch), batch['valid'])
    return float(metric.compute())


@torch.no_grad()
def test_validation_loss_is_the_same_for_any_batching(split):
    torch.manual_seed(0)
    model = build_model(CONFIGS_DIR / 'tiny').eval()
    dataset = ValidationSplit(split, (4, 4, 4), 32)
    whole = mean_loss(model, dataset, [range(7)])
    assert mean_loss(model, dataset, [[i] for i in range(7)]) == pytest.approx(whole, rel=1e-6)
    # Two ranks, batches of 2, as Composer's sampler deals them (its eval loop drops the repeat evening them out).
    assert mean_loss(model, dataset, [[0, 2], [4, 6], [1, 3], [5]]) == pytest.approx(whole, rel=1e-6)


def test_a_bad_validation_sample_is_left_out(tmp_path):
    samples = good_samples(3)
    samples[1]['jpg'] = b'not an image'
    dataset = ValidationSplit(write_dataset(tmp_path / 'mds', samples), (4, 4, 4), 32)
    assert [int(dataset[i]['valid']) for i in range(3)] == [1, 0, 1]
    metric = ValidationLoss()
    metric.update(torch.tensor([1.0, 100.0, 3.0]), torch.tensor([1, 0, 1]))
    assert float(metric.compute()) == 2.0


class SlowEvaluation(Callback):
    """Makes every evaluation take at least `seconds` longer."""

    def __init__(self, seconds):
        self.seconds, self.evaluations = seconds, 0

    def eval_start(self, state, logger):
        self.evaluations += 1
        time.sleep(self.seconds)


def test_evaluation_stays_out_of_the_throughput_windows(split, tmp_path, capfd):
    slow = SlowEvaluation(1.0)
    results = tmp_path / 'results.json'
    flags = [*SMALL, '--max_duration', '2ba', '--eval_local', split, '--eval_interval', '2ba']
    started = time.perf_counter()
    trainer = main(settled([*flags, '--results_json', str(results)]), (slow,))
    elapsed = time.perf_counter() - started
    summary = json.loads(results.read_text())
    assert slow.evaluations == 2  # at the start, and after batch 2 (the end: not twice)
    assert [samples for samples, _ in summary['val_loss_curve']] == [0, 8]
    # Composer's training clock, which is all SpeedMonitor's windows read, leaves the 2 seconds of sleep out.
    assert summary['train_seconds'] == trainer.state.timestamp.total_wct.total_seconds() < elapsed - 2
    assert summary['eval_seconds'] >= 2
    out = capfd.readouterr().out
    assert 'validation loss: ' in out and 'of the run; outside the throughput windows' in out


# ------------------------------------------------------------------------------------ flags and checks


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--eval_interval', '10ba'], '--eval_interval: no held-out split to validate on'),
        (['--eval_local', '/no/such/split'], '--eval_local: no Streaming dataset at /no/such/split'),
        (['--eval_local', 'a', '--eval_remote', 's3://b/p'], '--eval_local and --eval_remote: give one'),
        (['--sample_interval', 'often'], "--sample_interval 'often'"),
        (['--sample_interval', '0ba'], '--sample_interval 0ba: must be positive'),
        (['--sample_steps', '0'], '--sample_steps 0: must be positive'),
        (['--guidance_scale', '-1'], '--guidance_scale -1.0: must be 0 or more'),
        (['--sample_prompts', '/no/such/file'], '--sample_prompts /no/such/file: no such file'),
        (['--grad_clip_norm', '0'], '--grad_clip_norm 0.0: must be a positive number'),
        (['--grad_clip_norm', 'nan'], '--grad_clip_norm nan: must be a positive number'),
        (['--lr_warmup', 'soon'], "--lr_warmup 'soon'"),
        (['--lr_warmup', '0ba'], '--lr_warmup 0ba: must be positive'),
        (['--caption_dropout', '1'], '--caption_dropout 1.0: a probability'),
        (['--caption_dropout', '-0.1'], '--caption_dropout -0.1: a probability'),
        (['--precomputed_latents', '--sample_interval', '5ba'], '--sample_interval: with --precomputed_latents'),
        (['--precomputed_latents', '--caption_dropout', '0.1'], '--caption_dropout: with --precomputed_latents'),
    ],
)
def test_bad_quality_flags_fail_fast_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
        resolve_config(parse_args(TINY + flags))


def test_output_folders_and_prompt_files_are_checked(tmp_path):
    used = tmp_path / 'used'
    used.mkdir()
    (used / 'x').write_text('')
    with pytest.raises(ConfigError, match='--export_pipeline .*: is not empty; give a new folder'):
        resolve_config(parse_args([*TINY, '--export_pipeline', str(used)]))
    with pytest.raises(ConfigError, match='--sample_dir .*: is a file'):
        resolve_config(parse_args([*TINY, '--sample_interval', '1ba', '--sample_dir', str(used / 'x')]))
    with pytest.raises(ConfigError, match='--sample_prompts .*: holds no prompt'):
        resolve_config(parse_args([*TINY, '--sample_prompts', str(used / 'x')]))
    prompts = tmp_path / 'prompts.txt'
    prompts.write_text('a red circle\n\n  a blue square \n')
    config = resolve_config(parse_args([*TINY, '--sample_interval', '1ba', '--sample_prompts', str(prompts)]))
    assert config.evaluation.sample_prompts == ('a red circle', 'a blue square')


def test_everything_new_is_off_by_default(split):
    for flags in (['--model_name', 'sd2-base', '--use_synth_data'], ['--model_name', 'tiny']):
        config = resolve_config(parse_args(flags))
        evaluation, objective = config.evaluation, config.objective
        assert (evaluation.eval_interval, evaluation.sample_interval, evaluation.export_pipeline) == (None, None, None)
        assert (objective.grad_clip_norm, objective.lr_warmup, objective.caption_dropout) == (None, None, 0.0)
    # A split given: validated at the start and at the end of the run.
    assert resolve_config(parse_args([*SMALL, '--eval_local', split])).evaluation.eval_interval == '40ba'


# ------------------------------------------------------------------------------------ stability options


def test_caption_dropout_rate_is_within_tolerance():
    empty = CaptionTokenizer()('')
    empty_2 = CaptionTokenizer(pad_id=49407)('')  # SDXL: a second column, padded as its first encoder was trained
    captions = torch.randint(1, 1000, (20_000, 77))
    state = SimpleNamespace(batch={'input_ids': captions.clone(), 'input_ids_2': captions.clone()})
    torch.manual_seed(0)
    CaptionDropout(0.1, {'input_ids': empty, 'input_ids_2': empty_2}).apply(None, state, None)
    dropped = (state.batch['input_ids'] == empty).all(dim=1)
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.01)  # 4.7 standard deviations
    assert torch.equal(state.batch['input_ids'][~dropped], captions[~dropped])
    assert torch.equal((state.batch['input_ids_2'] == empty_2).all(dim=1), dropped)  # the same captions in both


class RecordOptimizer(Callback):
    def __init__(self):
        self.learning_rates, self.grad_norms = [], []

    def batch_start(self, state, logger):
        self.learning_rates.append(state.optimizers[0].param_groups[0]['lr'])

    def after_train_batch(self, state, logger):  # after GradientClipping, before the optimizer step
        grads = [p.grad for p in state.model.unet.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def test_warmup_rises_linearly_to_the_published_rate():
    record = RecordOptimizer()
    main(settled([*SMALL, '--max_duration', '6ba', '--lr_warmup', '4ba']), (record,))
    # Composer steps its schedulers at the end of a batch, before counting it: batch k trains at (k - 1) / 4 of the
    # rate (the first two at 0), the published 1e-4 from batch 5 on.
    assert record.learning_rates == pytest.approx([0, 0, 2.5e-5, 5e-5, 7.5e-5, 1e-4])


def test_gradient_clipping_bounds_the_gradient_norm():
    plain, clipped = RecordOptimizer(), RecordOptimizer()
    main(settled([*SMALL, '--max_duration', '3ba']), (plain,))
    main(settled([*SMALL, '--max_duration', '3ba', '--grad_clip_norm', '0.01']), (clipped,))
    assert min(plain.grad_norms) > 0.1
    assert max(clipped.grad_norms) == pytest.approx(0.01, rel=1e-4)


# ------------------------------------------------------------------------------------ export, generate


@pytest.mark.parametrize('pad_id', [0, 49407])  # OpenCLIP's (SD 2), OpenAI CLIP's (SD 1.5)
@pytest.mark.stack
def test_the_exported_tokenizer_gives_the_training_ids(pad_id):
    exported, trained = pipeline_tokenizer(pad_id=pad_id), CaptionTokenizer(pad_id=pad_id)
    for prompt in ('A  Red Circle on a BLUE background', 'a cat, on the mat.', ' x' * 100):
        ids = exported(prompt, padding='max_length', max_length=77, truncation=True).input_ids
        assert ids == trained(prompt).tolist()
    assert exported('a cat', padding='max_length', max_length=77).input_ids[-1] == pad_id


@torch.no_grad()
def test_validation_loss_of_the_other_models(split):
    """Each twin's split carries what its model takes (SDXL: both caption columns and the size), and the same
    weights give the same loss for any batching."""
    for name in ('tiny-sd1.5', 'tiny-sd2-768-v', 'tiny-sdxl-base'):
        torch.manual_seed(0)
        model = build_model(CONFIGS_DIR / name).eval()
        dataset = ValidationSplit(split, (4, 4, 4), 32, inputs=caption_inputs(read_model_folder(model.model_dir)))
        if name == 'tiny-sdxl-base':
            assert dataset[0]['input_ids_2'][-1] == 0 and dataset[0]['time_ids'].tolist() == [64, 80, 0, 4, 32, 32]
        whole = mean_loss(model, dataset, [range(7)])
        assert mean_loss(model, dataset, [[i] for i in range(7)]) == pytest.approx(whole, rel=1e-6)
    with pytest.raises(ConfigError, match="--export_pipeline: sample images and pipeline exports use Diffusers'"):
        resolve_config(parse_args([*SMALL[:1], 'tiny-sdxl-base', *SMALL[2:], '--export_pipeline', '/tmp/x']))


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--prompt', 'a'], 'the following arguments are required'),
        (['--pipeline', '/no/pipe', '--out', 'o'], 'no prompt'),
        (['--pipeline', '/no/pipe', '--prompt', 'a', '--out', 'o'], '--pipeline /no/pipe: no model_index.json'),
        (['--checkpoint', '/no/ckpt.pt', '--prompt', 'a', '--out', 'o'], '--checkpoint /no/ckpt.pt: no such file'),
    ],
)
def test_generate_bad_input_is_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit:
        generate.cli(flags)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def label_band(grid, columns, rows_below, height=32, cell=96, left=0):
    """The band of labels above a grid's first row: the pixels above `rows_below` rows of `height`-pixel images, in
    columns of `cell` pixels from `left` on (past the rows' labels), one column at a time, as (H, W, 3) arrays."""
    pixels = np.asarray(grid)
    band = pixels[: pixels.shape[0] - rows_below * (height + 2)]
    return [band[:, left + 2 + c * (cell + 2) : left + 2 + c * (cell + 2) + cell] for c in range(columns)]


class RecordMessages(logging.Handler):
    """Keeps the messages of the records a logger hands it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def diffusers_messages():
    """What Diffusers logs: to its own handler, which neither pytest's capture nor caplog sees."""
    handler = RecordMessages()
    logging.getLogger('diffusers').addHandler(handler)
    yield handler.messages
    logging.getLogger('diffusers').removeHandler(handler)


@pytest.mark.stack
def test_generate_draws_at_the_trained_size_and_grids_carry_their_prompts(tmp_path, capfd, diffusers_messages):
    """A run at 32px (the tiny model's own sample size is 64px): generate.py draws 32px images from its exported
    folder and from its checkpoint unless --image_size says otherwise, prints no score it was not asked for, and
    loads the folder without Diffusers' warning about accelerate. The run's sample grids and generate.py's grid
    carry each prompt above its column."""
    from PIL import Image

    pipe, samples, checkpoints = tmp_path / 'pipe', tmp_path / 'samples', tmp_path / 'ckpt'
    flags = [*SMALL, '--max_duration', '1ba', '--export_pipeline', str(pipe), '--save_folder', str(checkpoints)]
    flags += ['--save_interval', '1ba', '--sample_interval', '1ba', '--sample_steps', '1', '--sample_dir', str(samples)]
    main(settled(flags))
    capfd.readouterr()
    common = ['--prompt', 'a red circle on a blue background', '--prompt', 'a square', '--steps', '1']
    checkpoint = ['--checkpoint', str(checkpoints / 'latest-rank0.pt'), '--model_name', 'tiny']
    for name, source in (('folder', ['--pipeline', str(pipe)]), ('checkpoint', checkpoint)):
        images = generate.main(generate.parse_args([*common, *source, '--out', str(tmp_path / name)]))
        assert images.shape == (2, 3, 32, 32), name
        out = capfd.readouterr().out
        assert 'generating 2 image(s) of 32x32 (the size the run trained at)' in out
        assert 'CLIP score' not in out and 'FID' not in out
    assert not [message for message in diffusers_messages if 'accelerate' in message]
    larger = generate.main(
        generate.parse_args([*common, *checkpoint, '--image_size', '64', '--out', str(tmp_path / 'x')])
    )
    assert larger.shape == (2, 3, 64, 64) and 'of 64x64 (--image_size)' in capfd.readouterr().out

    grid = Image.open(tmp_path / 'folder' / 'grid.png')
    # Two columns 96px wide (a label's least width), each a 32px image centered under a band of labels.
    assert grid.width == 2 * 98 + 2 and grid.height > 34 + 2
    saved = [Image.open(tmp_path / 'folder' / f'000{i}.png') for i in range(2)]
    lefts = [2 + 98 * i + 32 for i in range(2)]
    bottom = (grid.height - 34, grid.height - 2)
    assert [list(grid.crop((x, bottom[0], x + 32, bottom[1])).getdata()) for x in lefts] == [
        list(image.getdata()) for image in saved
    ]
    sample_grids = sorted(samples.iterdir())
    assert [path.name for path in sample_grids] == ['samples-ba000000.png', 'samples-ba000001.png']
    first, sample_grid = (Image.open(path) for path in sample_grids)
    # The default 4 prompts as columns, the 2 seeds as rows (each labeled on its left), the prompts above the first
    # row only, and a title line naming the batch and the weights (which tells the two grids' tops apart).
    margin = sample_grid.width - (4 * 98 + 2)
    assert margin > 10 and sample_grid.height > 2 * 34 + 2
    row_labels = np.asarray(sample_grid)[-2 * 34 :, :margin]
    assert (row_labels.min(axis=2) < 100).sum() > 20  # 'seed 0', 'seed 1': dark text on white
    assert np.asarray(first)[:12].tolist() != np.asarray(sample_grid)[:12].tolist()  # batch 0 / batch 1
    for labels, columns, rows, left in ((grid, 2, 1, 0), (sample_grid, 4, 2, margin)):
        for column in label_band(labels, columns, rows, left=left):
            assert column.shape[0] >= 10 and (column.min(axis=2) < 100).sum() > 10  # dark text on white


def test_a_label_is_shortened_to_fit_its_column():
    from PIL import ImageFont

    from runs.export import label_lines

    font = ImageFont.load_default(10)
    lines = label_lines('a watercolor painting of a lighthouse on a rocky coast at dawn', font, 64)
    assert len(lines) == 2 and lines[-1].endswith('...')
    assert all(font.getlength(line) <= 64 for line in lines)
    assert label_lines('a  red   circle', font, 200) == ['a red circle'] and label_lines('', font, 64) == []
    assert ' '.join(line.removesuffix('...') for line in lines).startswith('a watercolor')


# ------------------------------------------------------------------------------------ the learning curve


def test_learning_curve_plots_runs_and_names_a_file_without_one(tmp_path, capsys):
    def results(name, curve, ema=None):
        path = tmp_path / f'{name}.json'
        fields = {'schema': 'sd2-benchmark-results/1', 'val_loss_curve': curve, 'val_loss_ema_curve': ema}
        path.write_text(json.dumps(fields))
        return str(path)

    plain = results('plain', [[0, 1.1], [800, 0.6], [1600, 0.5]], [[0, 1.1], [800, 0.8], [1600, 0.6]])
    fast = results('fast', [[0, 1.1], [800, 0.62], [1600, 0.52]])
    out = tmp_path / 'curve.png'
    import matplotlib.pyplot as plt

    drawn, close = [], plt.close
    with pytest.MonkeyPatch.context() as patch:  # each figure kept as it is closed, to read what it draws
        patch.setattr(plt, 'close', lambda figure: (drawn.append(figure), close(figure)))
        assert learning_curve.main([plain, fast, '--out', str(out)]) == 0
    lines = {line.get_label(): line for line in drawn[0].axes[0].get_lines()}
    assert sorted(lines) == ['fast', 'plain', 'plain (EMA weights)']
    for label, curve in (
        ('plain', [[0, 1.1], [800, 0.6], [1600, 0.5]]),
        ('fast', [[0, 1.1], [800, 0.62], [1600, 0.52]]),
    ):
        assert [list(point) for point in zip(lines[label].get_xdata(), lines[label].get_ydata())] == curve
    assert list(lines['plain (EMA weights)'].get_ydata()) == [1.1, 0.8, 0.6]
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert '| plain | 1600 | 1.1000 | 0.5000 | 0.6000 |' in capsys.readouterr().out
    assert learning_curve.main([plain, results('none', None)]) == 2
    assert 'none.json: no validation loss in it' in capsys.readouterr().err


# ------------------------------------------------------------------------------------ slow: whole runs


def results_of(run, path) -> dict:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.mark.slow
def test_training_lowers_the_validation_loss_well_below_its_start(tmp_path):
    results = tmp_path / 'results.json'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '8', '--max_duration', '80ba']
    run = run_cli(*flags, '--eval_interval', '80ba', '--results_json', str(results), launcher=('python',))
    summary = results_of(run, results)
    start, end = summary['val_loss_curve'][0][1], summary['val_loss']
    assert [samples for samples, _ in summary['val_loss_curve']] == [0, 80 * 8]
    assert end < 0.6 * start, (start, end)


@pytest.mark.slow
def test_validation_loss_is_the_same_on_one_and_two_ranks_and_two_batch_sizes(split, tmp_path):
    """The loss of the same (initial) weights, from batches of 4 and 2 on one rank and 2 per rank on two."""
    losses = []
    for name, batch_size, launcher in (('a', 4, ('python',)), ('b', 2, ('python',)), ('c', 4, ('composer', '-n', '2'))):
        results = tmp_path / f'{name}.json'
        flags = [*TINY, '--image_size', '32', '--batch_size', str(batch_size), '--max_duration', '1ba']
        run = run_cli(
            *flags,
            '--eval_local',
            split,
            '--results_json',
            str(results),
            launcher=launcher,
            env={'OMP_NUM_THREADS': '1'},
        )
        summary = results_of(run, results)
        assert summary['world_size'] == (2 if name == 'c' else 1)
        losses.append(summary['val_loss_curve'][0][1])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)


def tiny_clip_folder(folder):
    """A randomly initialized CLIP model with its processor, in the layout CLIPModel.from_pretrained reads."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizerFast

    from settings.tokenizer import clip_tokenizer_folder

    small = {'hidden_size': 32, 'intermediate_size': 37, 'num_attention_heads': 4, 'num_hidden_layers': 2}
    config = CLIPConfig(
        text_config={**small, 'max_position_embeddings': 77},
        vision_config={**small, 'image_size': 32, 'patch_size': 8},
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={'shortest_edge': 32}, crop_size={'height': 32, 'width': 32}),
        tokenizer=CLIPTokenizerFast.from_pretrained(clip_tokenizer_folder()),
    )
    processor.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_exported_pipeline_checkpoint_and_sample_grids(split, tmp_path, capfd):
    import torchvision
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from runs.export import build_pipeline
    from runs.export import generate as draw

    pipe, samples, checkpoints = tmp_path / 'pipe', tmp_path / 'samples', tmp_path / 'ckpt'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '8', '--max_duration', '30ba', '--use_ema']
    flags += [
        '--ema_half_life',
        '10ba',
        '--sample_interval',
        '30ba',
        '--sample_steps',
        '4',
        '--sample_dir',
        str(samples),
    ]
    flags += ['--export_pipeline', str(pipe), '--save_folder', str(checkpoints), '--save_interval', '30ba']
    main(settled(flags))
    grids = sorted(path.name for path in samples.iterdir())
    assert grids == [
        'samples-ba000000.png',
        'samples-ba000030.png',
        'samples-ema-ba000000.png',
        'samples-ema-ba000030.png',
    ]
    untrained, trained = (Image.open(samples / grid) for grid in grids[:2])
    assert untrained.size == trained.size and untrained.width > 4 * 98 + 2  # 4 prompts x 2 seeds, seeds labeled
    margin, height = trained.width - (4 * 98 + 2), trained.height  # the seeds' labels; 96px columns
    boxes = [(margin + 34 + 98 * c, height - 68 + 34 * r) for c in range(4) for r in range(2)]  # each 32px image

    def drawn(grid):
        return torch.tensor([list(grid.crop((x, y, x + 32, y + 32)).getdata()) for x, y in boxes])

    assert (drawn(untrained) - drawn(trained)).abs().float().mean() > 5  # what it learned shows

    pipeline = StableDiffusionPipeline.from_pretrained(pipe, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)

    def image(pipeline):
        generator = torch.Generator().manual_seed(3)
        return pipeline('a red circle', height=32, width=32, num_inference_steps=4, generator=generator).images[0]

    first, second = image(pipeline), image(pipeline)
    assert list(first.getdata()) == list(second.getdata())  # the same seed, the same image
    torch.manual_seed(17)  # benchmark.py's seed: the untrained model of the run
    untrained_pipeline = build_pipeline(build_model(CONFIGS_DIR / 'tiny'))
    untrained_pipeline.set_progress_bar_config(disable=True)
    assert list(image(untrained_pipeline).getdata()) != list(first.getdata())

    # generate.py from the folder and from the checkpoint's EMA weights: the same images.
    prompts = ['a red circle on a blue background', 'a yellow square']
    common = ['--prompt', prompts[0], '--prompt', prompts[1], '--steps', '4', '--batch_size', '1', '--image_size', '32']
    from_folder = generate.main(generate.parse_args([*common, '--pipeline', str(pipe), '--out', str(tmp_path / 'g1')]))
    checkpoint = ['--checkpoint', str(checkpoints / 'latest-rank0.pt'), '--model_name', 'tiny', '--ema']
    torch.manual_seed(0)  # Inception v3 weights made here, at random: nothing is downloaded
    weights = tmp_path / 'inception.pt'
    torch.save(torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=True).state_dict(), weights)
    scores = [
        '--clip_model',
        tiny_clip_folder(tmp_path / 'clip'),
        '--fid_reference',
        split,
        '--fid_weights',
        str(weights),
    ]
    args = generate.parse_args([*common, *checkpoint, *scores, '--out', str(tmp_path / 'g2')])
    from_checkpoint = generate.main(args)
    assert from_folder.shape == from_checkpoint.shape == (2, 3, 32, 32)
    assert torch.allclose(from_folder, from_checkpoint, atol=1e-5)
    assert sorted(path.name for path in (tmp_path / 'g2').iterdir()) == [
        '0000.png',
        '0001.png',
        'grid.png',
        'prompts.txt',
    ]
    out = capfd.readouterr().out
    assert 'CLIP score: ' in out.split('2 image(s)')[-1] and 'FID: ' in out.split('2 image(s)')[-1]
    direct = draw(pipeline, prompts, [0, 1], 4, 7.5, 32, CaptionTokenizer(str(pipe / 'tokenizer')))
    assert torch.allclose(direct, from_folder, atol=1e-5)  # as above: float rounding of two loads of one model


def test_a_run_description_that_is_not_a_json_object_is_one_line(tmp_path):
    from runs.generation import recorded_description

    record = tmp_path / 'run_description.json'
    assert recorded_description(record) == {}  # a folder Diffusers saved: no record
    record.write_text('{"image_size": 32}')
    assert recorded_description(record) == {'image_size': 32}
    for text in ('[32]', '{"image_size": '):
        record.write_text(text)
        with pytest.raises(ConfigError, match='not the JSON object of a run description; pass --image_size$'):
            recorded_description(record)


def test_the_clip_score_is_clips_cosine_of_image_and_prompt_times_100(tmp_path):
    """runs.generation.clip_score (torchmetrics') against the score computed from the CLIP model itself: 100 times
    the cosine of the image's and the prompt's embeddings, averaged, and at least 0 (torchmetrics' CLIPScore clamps
    the mean)."""
    from transformers import CLIPModel, CLIPProcessor

    from runs.generation import clip_score

    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = ['a red circle', 'a blue square on grass', 'two cats']
    pixels = [(image * 255).round().byte() for image in images]
    for seed in range(32):  # the first tiny CLIP whose score is well above the clamp at 0 (weights vary by release)
        torch.manual_seed(seed)
        folder = tiny_clip_folder(tmp_path / f'clip-{seed}')
        model, processor = CLIPModel.from_pretrained(folder), CLIPProcessor.from_pretrained(folder)
        inputs = processor(text=prompts, images=pixels, return_tensors='pt', padding=True)
        with torch.no_grad():  # the model's own output: the projected embeddings, normalized, on every Transformers
            embedded = model(**inputs)
        expected = (100 * (embedded.image_embeds * embedded.text_embeds).sum(-1)).mean()
        if expected > 1:
            break
    printed = float(re.match(r'CLIP score: ([\d.]+) ', clip_score(images, prompts, folder)).group(1))
    assert expected > 1 and printed == pytest.approx(float(expected), abs=1e-3)


@pytest.mark.slow
def test_the_fid_is_the_frechet_distance_of_the_inception_features_and_0_for_the_reference_itself(tmp_path):
    """runs.generation.fid (torchmetrics') against the distance computed here from the same Inception features:
    the squared distance of the means, plus the covariances' traces, less twice the trace of the square root of
    their product, which is the nuclear norm of the centered features' cross product (exact for a few images of
    2048 features each, where the covariances are singular); and the reference images against themselves: 0."""
    import torchvision

    from runs.generation import InceptionFeatures, fid

    torch.manual_seed(0)  # Inception v3 at random: nothing is downloaded
    inception = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=True)
    # Its batch norms' statistics taken from a batch, as training would set them: left at 0 and 1, the features
    # grow to about 1e11, and the distance's terms to 1e23, where float64 keeps no digit of a small distance.
    for norm in (module for module in inception.modules() if isinstance(module, torch.nn.BatchNorm2d)):
        norm.reset_running_stats()
        norm.momentum = None  # the running statistics are the batch's
    calibrating = InceptionFeatures(inception).train()
    with torch.no_grad():
        calibrating(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
    weights = tmp_path / 'inception.pt'
    torch.save(inception.state_dict(), weights)
    reference = write_dataset(tmp_path / 'reference', good_samples(6, size=(32, 32)))
    split = ValidationSplit(reference, (4, 1, 1), 32)
    real = torch.stack([split[i]['image'] for i in range(len(split))]).float() / 255
    generated = real[1:].flip(-1)  # images like the reference's: the covariances' term counts

    def printed(images):
        return float(re.match(r'FID: (-?[\d.]+) \(', fid(images, reference, str(weights), 32)).group(1))

    inception.fc = torch.nn.Identity()
    with torch.no_grad():
        a, b = (InceptionFeatures(inception)(images).double() for images in (real, generated))
    centered_a, centered_b = a - a.mean(0), b - b.mean(0)
    trace_a = (centered_a**2).sum() / (len(a) - 1)
    trace_b = (centered_b**2).sum() / (len(b) - 1)
    cross = torch.linalg.svdvals(centered_a @ centered_b.T).sum() / ((len(a) - 1) * (len(b) - 1)) ** 0.5
    expected = float(((a.mean(0) - b.mean(0)) ** 2).sum() + trace_a + trace_b - 2 * cross)
    assert expected > 1 and printed(generated) == pytest.approx(expected, rel=1e-4, abs=0.01)
    # 0 up to the rounding of the eigenvalues torchmetrics takes of the covariances' product (about 2e-6 of them)
    assert abs(printed(real)) < 1e-5 * 2 * float(trace_a)


def test_a_run_on_an_exported_folder_takes_what_its_run_trained_with(tmp_path, capfd):
    """A folder --export_pipeline wrote describes its run: a run on it leaves the published preset (512px, batch
    2048) for the exported run's size, batch, microbatch and prediction type, a flag given still winning; the
    pipeline draws at that size when given none; its parts load without Diffusers' accelerate warning."""
    from diffusers import StableDiffusionPipeline

    from models.parts import build_part

    pipe = tmp_path / 'pipe'
    flags = ['--model_name', 'tiny', '--use_synth_data', '--image_size', '32', '--batch_size', '6']
    flags += ['--device_train_microbatch_size', '3', '--prediction_type', 'v_prediction', '--max_duration', '1ba']
    main(settled([*flags, '--export_pipeline', str(pipe)]))
    config = resolve_config(parse_args(['--model_name', str(pipe), '--use_synth_data']))
    assert (config.data.image_size, config.batch.batch_size, config.batch.device_train_microbatch_size) == (32, 6, 3)
    assert config.model.prediction_type == 'v_prediction'
    assert f"from the exported run's ({pipe / 'run_description.json'}) preset" in config.notes[0]
    given = resolve_config(parse_args(['--model_name', str(pipe), '--use_synth_data', '--image_size', '64']))
    assert given.data.image_size == 64 and given.batch.batch_size == 6
    pipeline = StableDiffusionPipeline.from_pretrained(pipe, local_files_only=True)
    assert pipeline.unet.config.sample_size * pipeline.vae_scale_factor == 32
    capfd.readouterr()
    build_part(pipe, 'unet')
    build_part(pipe, 'vae')
    assert 'accelerate' not in capfd.readouterr().err
    record = json.loads((pipe / 'run_description.json').read_text())
    (pipe / 'run_description.json').write_text(json.dumps({**record, 'tokenizer': str(tmp_path / 'gone')}))
    with pytest.raises(ConfigError, match=r"^--tokenizer: .*'s run read captions with .*gone, which is no folder here"):
        resolve_config(parse_args(['--model_name', str(pipe), '--use_synth_data']))
    (pipe / 'run_description.json').write_text('[32]')
    with pytest.raises(ConfigError, match=r'run_description.json: not the JSON object of a run description; export '):
        resolve_config(parse_args(['--model_name', str(pipe), '--use_synth_data']))


@pytest.mark.slow
def test_a_resumed_runs_learning_curve_holds_the_points_before_its_resumption(split, tmp_path):
    """The curve is kept in the checkpoints: a run resumed at batch 2 reports the points of 0 and 2 (as validated
    before the stop) and 4, with the EMA's curve the same way, not only the points after it resumed."""
    flags = [*SMALL, '--eval_local', split, '--eval_interval', '2ba', '--use_ema', '--ema_half_life', '2ba']
    flags += ['--save_folder', str(tmp_path / 'ckpt'), '--save_interval', '2ba', '--run_name', 'curve']
    first, resumed = tmp_path / 'first.json', tmp_path / 'resumed.json'
    main(settled([*flags, '--max_duration', '2ba', '--results_json', str(first)]))
    main(settled([*flags, '--max_duration', '4ba', '--autoresume', '--results_json', str(resumed)]))
    before, after = json.loads(first.read_text()), json.loads(resumed.read_text())
    for curve in ('val_loss_curve', 'val_loss_ema_curve'):
        assert [samples for samples, _ in after[curve]] == [0, 8, 16]
        assert after[curve][:2] == before[curve]
    assert after['val_loss'] == after['val_loss_curve'][-1][1] != before['val_loss']
