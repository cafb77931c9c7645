"""Inputs that are not what they claim are refused in one `error:` line naming the file and what it is not, exit
status 2, no traceback: report.py given an image, a folder or a binary file; generate.py given half a checkpoint, an
empty file, a results file, a pipeline folder missing a part; a --model_name folder whose weights are missing or cut
short; a --tokenizer of another model family."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, run_process, settled, write_t5_tokenizer
from PIL import Image

import generate
from guards.arguments import ConfigError
from models.parts import build_part
from runs.run import main
from settings.config import resolve_config
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR, resolve_model_dir

PROMPT = ['--prompt', 'a red circle', '--steps', '1']


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'OMP_NUM_THREADS': '1'}
    command = [sys.executable, str(REPO / name), *args]
    return run_process(command, cwd=REPO, env=environment, timeout=600)


def refused(run: subprocess.CompletedProcess) -> str:
    """The one line of a run refused as bad input: exit status 2, no traceback."""
    assert run.returncode == 2, run.stderr[-3000:]
    assert 'Traceback' not in run.stderr and run.stderr.count('\n') == 1, run.stderr[-3000:]
    assert run.stderr.startswith('error: ')
    return run.stderr.strip()


def generate_refuses(capsys, *argv: str) -> str:
    """generate.py's command line, in process: its one line, exit status 2."""
    with pytest.raises(SystemExit) as stopped:
        generate.cli(list(argv))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith('error: ') and err.count('\n') == 1, err
    return err.strip()


# --------------------------------------------------------------------------------------------- report.py


def write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def write_png(path: Path) -> str:
    Image.new('RGB', (8, 8), 'red').save(path, format='PNG')  # named .json, as a file given by mistake
    return str(path)


@pytest.mark.parametrize(
    'make, what',
    [
        (write_png, 'not a results file: binary data, not the JSON text benchmark.py writes'),
        (lambda path: path.mkdir() or str(path), 'is a folder, not a results file'),
        (lambda path: write_bytes(path, bytes(range(256)) * 4), 'not a results file: binary data'),
    ],
    ids=['png', 'folder', 'binary'],
)
def test_report_names_a_results_file_that_is_not_one(tmp_path, make, what):
    path = make(tmp_path / 'results.json')
    line = refused(script('report.py', path, '--csv', '', '--plot', ''))
    assert line.startswith(f'error: {path}: {what}')


# ------------------------------------------------------------------------------------------- generate.py


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of a one-batch run of the tiny model."""
    folder = tmp_path_factory.mktemp('run') / 'ckpt'
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '1ba', '--run_name', 'r']
    main(settled([*flags, '--save_folder', str(folder), '--save_interval', '1ba']))
    return folder / 'ep0-ba1-rank0.pt'


def test_generate_names_a_checkpoint_cut_short(checkpoint, tmp_path, capsys):
    half = tmp_path / 'half.pt'
    half.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    line = generate_refuses(capsys, '--checkpoint', str(half), *PROMPT, '--out', str(tmp_path / 'out'))
    assert line.startswith(
        f'error: --checkpoint {half}: a checkpoint cut short ({half.stat().st_size:,} bytes and no end'
    )
    assert line.endswith('; give a checkpoint of benchmark.py --save_folder (e.g. latest-rank0.pt)')


@pytest.mark.parametrize(
    'content, what',
    [
        (b'', 'an empty file, not a checkpoint'),
        (
            json.dumps({'schema': 'sd2-benchmark-results/1', 'img_per_sec': 3.2}).encode(),
            'a JSON file (a results file?)',
        ),
        (b'\x89PNG\r\n\x1a\n' + bytes(100), 'not a checkpoint (not the zip archive torch.save writes)'),
    ],
    ids=['empty', 'results-json', 'png'],
)
def test_generate_names_a_file_that_is_no_checkpoint(tmp_path, capsys, content, what):
    path = tmp_path / 'latest-rank0.pt'
    path.write_bytes(content)
    line = generate_refuses(capsys, '--checkpoint', str(path), *PROMPT, '--out', str(tmp_path / 'out'))
    assert line.startswith(f'error: --checkpoint {path}: {what}')
    assert not (tmp_path / 'out').exists()


def test_generate_names_a_torch_file_that_is_no_composer_checkpoint(tmp_path, capsys):
    path = tmp_path / 'weights.pt'
    torch.save({'unet': torch.zeros(2)}, path)  # torch's zip archive, but not Composer's state
    line = generate_refuses(
        capsys, '--checkpoint', str(path), '--model_name', 'tiny', *PROMPT, '--out', str(tmp_path / 'o')
    )
    assert (
        line == f"error: --checkpoint {path}: a torch file without Composer's 'state', not a checkpoint of benchmark.py"
    )


def test_generate_names_a_checkpoint_damaged_inside(checkpoint, tmp_path, capsys):
    """The archive's directory whole, a record inside it overwritten: torch.load's own error, in one line."""
    data = bytearray(checkpoint.read_bytes())
    start = data.index(b'data.pkl') + 200  # inside the pickle, past its local header
    data[start : start + 64] = bytes(64)
    damaged = tmp_path / 'damaged.pt'
    damaged.write_bytes(bytes(data))
    line = generate_refuses(
        capsys, '--checkpoint', str(damaged), '--model_name', 'tiny', *PROMPT, '--out', str(tmp_path / 'out')
    )
    assert line.startswith(f'error: --checkpoint {damaged}: cannot be read, damaged? (')
    assert not (tmp_path / 'out').exists()


@pytest.fixture(scope='module')
def pipeline(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp('export') / 'pipeline'
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '1ba']
    main(settled([*flags, '--export_pipeline', str(folder)]))
    return folder


def damaged_copy(pipeline: Path, tmp_path: Path, damage) -> Path:
    copy = Path(shutil.copytree(pipeline, tmp_path / 'pipeline'))
    damage(copy)
    return copy


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize(
    'damage, what',
    [
        (
            lambda folder: shutil.rmtree(folder / 'vae'),
            'no vae/ folder, which its model_index.json lists (AutoencoderKL)',
        ),
        (
            lambda folder: (folder / 'unet' / 'diffusion_pytorch_model.safetensors').unlink(),
            'unet/ holds no weights (diffusion_pytorch_model.safetensors or diffusion_pytorch_model.bin)',
        ),
        (
            lambda folder: cut_short(folder / 'text_encoder' / 'model.safetensors'),
            'text_encoder/model.safetensors: cut short: ',
        ),
    ],
    ids=['no-vae', 'no-unet-weights', 'text-encoder-cut-short'],
)
def test_generate_names_the_part_a_pipeline_folder_lacks(pipeline, tmp_path, capsys, damage, what):
    folder = damaged_copy(pipeline, tmp_path, damage)
    line = generate_refuses(capsys, '--pipeline', str(folder), *PROMPT, '--out', str(tmp_path / 'out'))
    assert line.startswith(f'error: --pipeline {folder}: {what}')
    assert line.endswith('; give a whole pipeline folder (export it again)')


@pytest.mark.slow
def test_generate_refuses_a_pipeline_folder_in_a_subprocess_without_a_traceback(pipeline, tmp_path):
    folder = damaged_copy(pipeline, tmp_path, lambda folder: shutil.rmtree(folder / 'vae'))
    line = refused(script('generate.py', '--pipeline', str(folder), *PROMPT, '--out', str(tmp_path / 'out')))
    assert line.startswith(f'error: --pipeline {folder}: no vae/ folder')


# ---------------------------------------------------------------------------------------- --model_name


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """The tiny model's configs, with the UNet's weights saved in shards of about 100 KB (as large models' are)."""
    folder = Path(shutil.copytree(CONFIGS_DIR / 'tiny', tmp_path / 'model'))
    unet, _ = build_part(folder, 'unet')
    unet.save_pretrained(folder / 'unet', max_shard_size='100KB')
    assert len(list((folder / 'unet').glob('*.safetensors'))) > 1
    return folder


def test_a_model_folder_with_sharded_weights_loads_them(model_folder):
    assert resolve_model_dir(str(model_folder)) == model_folder
    _, loaded = build_part(model_folder, 'unet')
    assert loaded  # the index is weights: not a random init


def test_a_model_folder_missing_a_shard_is_refused_at_start(model_folder):
    shard = sorted((model_folder / 'unet').glob('*.safetensors'))[1]
    shard.unlink()
    with pytest.raises(ConfigError) as refused_model:
        resolve_config(parse_args(['--model_name', str(model_folder), '--use_synth_data']))
    assert str(refused_model.value) == (
        f"--model_name '{model_folder}': unet/{shard.name}: missing (the index of the sharded weights lists it); "
        'download the folder again, whole'
    )


def test_a_model_folder_with_weights_cut_short_is_refused_by_every_script(model_folder, tmp_path, capsys):
    shard = sorted((model_folder / 'unet').glob('*.safetensors'))[0]
    cut_short(shard)
    what = f"--model_name '{model_folder}': unet/{shard.name}: cut short: {shard.stat().st_size:,} of the "
    line = refused(script('benchmark.py', '--model_name', str(model_folder), '--use_synth_data'))
    assert line.startswith(f'error: {what}') and line.endswith('bytes its header gives; download it again')
    line = refused(script('precompute.py', '--model_name', str(model_folder), '--out', str(tmp_path / 'latents')))
    assert line.startswith(f'error: {what}')
    path = tmp_path / 'any.pt'
    torch.save({'state': {}}, path)
    line = generate_refuses(capsys, '--checkpoint', str(path), '--model_name', str(model_folder), *PROMPT, '--out', 'o')
    assert line.startswith(f'error: {what}')


def test_a_weights_file_that_is_not_safetensors_is_named(tmp_path):
    folder = Path(shutil.copytree(CONFIGS_DIR / 'tiny', tmp_path / 'model'))
    (folder / 'vae' / 'diffusion_pytorch_model.safetensors').write_text('<html>404 Not Found</html>')
    with pytest.raises(ConfigError, match=r'vae/diffusion_pytorch_model\.safetensors: not a safetensors file \(26 '):
        resolve_model_dir(str(folder))


# ----------------------------------------------------------------------------------------- --tokenizer


def test_a_t5_tokenizer_for_a_clip_model_is_refused_by_every_script(tmp_path, capsys):
    t5 = write_t5_tokenizer(tmp_path / 't5')
    expected = f'--tokenizer {t5}: gives ids '
    with pytest.raises(ConfigError) as refused_tokenizer:
        resolve_config(parse_args([*TINY, '--tokenizer', t5]))
    assert str(refused_tokenizer.value).startswith(expected)
    assert (
        "not CLIP's (<|startoftext|> = 49406 first, <|endoftext|> = 49407 after the words, all below 49408): "
        in str(refused_tokenizer.value)
    )
    line = refused(script('precompute.py', '--model_name', 'tiny', '--tokenizer', t5, '--out', str(tmp_path / 'o')))
    assert line.startswith(f'error: {expected}')
    path = tmp_path / 'any.pt'
    torch.save({'state': {}}, path)
    line = generate_refuses(
        capsys, '--checkpoint', str(path), '--model_name', 'tiny', '--tokenizer', t5, *PROMPT, '--out', 'o'
    )
    assert line.startswith(f'error: {expected}')


def test_a_clip_tokenizer_for_a_t5_model_is_refused(tmp_path):
    from settings.tokenizer import clip_tokenizer_folder

    clip = str(clip_tokenizer_folder())
    with pytest.raises(ConfigError, match=r"not T5's \(below 32128, ending in </s> = 1\)"):
        resolve_config(parse_args(['--model_name', 'tiny-pixart-sigma', '--use_synth_data', '--tokenizer', clip]))


@pytest.mark.parametrize(
    ('given', 'meant'), [('--max-duration', '--max_duration'), ('--model_nam', '--model_name'), ('--zzzz', None)]
)
def test_a_mistyped_flag_is_named_with_the_flag_it_resembles(given, meant, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args([given, '3ba'])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    hint = f'; did you mean {meant}?' if meant else ''
    assert err == f'error: unrecognized arguments: {given}{hint} (see {Path(sys.argv[0]).name} --help)'
