"""generate.py reads the run from its checkpoint: --model_name, --prediction_type and --tokenizer default to what
the checkpoint's run recorded (beside it in its save folder, else inside it), a flag given overrides with a line
saying so, and a checkpoint without the record asks for --model_name in one line."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, settled

import generate
from runs.checkpoints import RunDescription
from runs.run import main
from settings.run_record import RUN_DESCRIPTION_FILE, write_run_description
from settings.tokenizer import clip_tokenizer_folder

PROMPTS = ['--prompt', 'a red circle', '--steps', '1']


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """The last checkpoint of a 32px run of the tiny model trained to predict v, captions read by a tokenizer folder
    of its own."""
    folder = tmp_path_factory.mktemp('run')
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '1ba', '--run_name', 'v']
    flags += ['--prediction_type', 'v_prediction', '--tokenizer', str(clip_tokenizer_folder())]
    main(settled([*flags, '--save_folder', str(folder / 'ckpt'), '--save_interval', '1ba']))
    return folder / 'ckpt' / 'latest-rank0.pt'


def draw(checkpoint, out, *flags):
    return generate.main(generate.parse_args(['--checkpoint', str(checkpoint), *PROMPTS, '--out', str(out), *flags]))


def rewritten(checkpoint, path, change):
    """A copy of the checkpoint, on its own, whose run description `change` edits (None: removes), as another
    version wrote."""
    saved = torch.load(checkpoint, map_location='cpu', weights_only=False)
    callbacks = saved['state']['callbacks']
    callbacks[RunDescription.__name__] = change(dict(callbacks[RunDescription.__name__]))
    if callbacks[RunDescription.__name__] is None:
        del callbacks[RunDescription.__name__]
    torch.save(saved, path)
    return path


def recorded_inside(checkpoint) -> dict:
    return torch.load(checkpoint, map_location='cpu', weights_only=False)['state']['callbacks']['RunDescription']


@pytest.mark.stack
def test_a_checkpoint_alone_draws_with_its_runs_model_prediction_type_and_tokenizer(checkpoint, tmp_path, capfd):
    capfd.readouterr()
    alone = draw(checkpoint, tmp_path / 'alone')
    out = capfd.readouterr().out
    tokenizer = clip_tokenizer_folder().resolve()
    assert (
        f"from the checkpoint's run: --model_name tiny --prediction_type v_prediction --tokenizer {tokenizer} "
        '(a flag given overrides)'
    ) in out.splitlines()
    assert 'generating 1 image(s) of 32x32 (the size the run trained at)' in out
    flags = ['--model_name', 'tiny', '--prediction_type', 'v_prediction', '--tokenizer', str(tokenizer)]
    given = draw(checkpoint, tmp_path / 'given', *flags)
    assert "from the checkpoint's run" not in capfd.readouterr().out  # all given: nothing taken, nothing differs
    assert torch.equal(alone, given)
    # The checkpoint's trained weights draw them: the same checkpoint with its UNet's last layer zeroed draws others.
    saved = torch.load(checkpoint, map_location='cpu', weights_only=False)
    saved['state']['model']['unet.conv_out.weight'].zero_()
    torch.save(saved, tmp_path / 'changed.pt')
    assert not torch.equal(draw(tmp_path / 'changed.pt', tmp_path / 'changed'), alone)
    capfd.readouterr()
    # A flag given is used, with a line saying that it differs from the run's.
    epsilon = draw(checkpoint, tmp_path / 'epsilon', '--prediction_type', 'epsilon')
    lines = capfd.readouterr().out.splitlines()
    assert (
        "--prediction_type epsilon: given, where the checkpoint's run trained with v_prediction; epsilon is used"
    ) in lines
    assert f"from the checkpoint's run: --model_name tiny --tokenizer {tokenizer} (a flag given overrides)" in lines
    assert not torch.equal(alone, epsilon)


@pytest.mark.stack
def test_a_checkpoint_without_the_record_asks_for_the_model_in_one_line(checkpoint, tmp_path, capsys):
    older = rewritten(checkpoint, tmp_path / 'older.pt', lambda description: None)
    with pytest.raises(SystemExit) as exit:
        generate.cli(['--checkpoint', str(older), *PROMPTS, '--out', str(tmp_path / 'o')])
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --checkpoint {older}: records no model (a checkpoint of an older version); pass the run's "
        '--model_name (e.g. tiny, sd2-base)\n'
    )
    # Given --model_name, it draws (the model's own prediction type, the default tokenizer), saying nothing.
    images = draw(older, tmp_path / 'drawn', '--model_name', 'tiny')
    assert images.shape == (1, 3, 64, 64)  # no size recorded: the model's sample size
    assert "checkpoint's run" not in capsys.readouterr().out


@pytest.mark.stack
def test_a_record_without_prediction_type_or_tokenizer_takes_the_model_and_says_what_it_lacks(
    checkpoint, tmp_path, capsys
):
    def before_drawing_settings(description):
        return {key: value for key, value in description.items() if key not in ('prediction_type', 'tokenizer')}

    older = rewritten(checkpoint, tmp_path / 'older.pt', before_drawing_settings)
    draw(older, tmp_path / 'drawn')
    lines = capsys.readouterr().out.splitlines()
    assert "from the checkpoint's run: --model_name tiny (a flag given overrides)" in lines
    assert (
        f'{older} records no --prediction_type or --tokenizer (a checkpoint of an older version): drawn with the '
        "model's own prediction type and the default tokenizer; pass the run's if it gave others"
    ) in lines


def test_a_recorded_tokenizer_folder_that_is_gone_is_one_line(checkpoint, tmp_path, capsys):
    folder = tmp_path / 'moved'
    folder.mkdir()
    moved = shutil.copy(checkpoint, folder / 'latest-rank0.pt')
    write_run_description(folder, {**recorded_inside(checkpoint), 'tokenizer': '/gone'})
    with pytest.raises(SystemExit):
        generate.cli(['--checkpoint', str(moved), *PROMPTS, '--out', str(tmp_path / 'o')])
    assert capsys.readouterr().err == (
        "error: --tokenizer: the checkpoint's run read captions with /gone, which is no folder here; pass the "
        'tokenizer folder\n'
    )
    given = generate.parse_args(['--checkpoint', str(moved), '--tokenizer', str(tmp_path), *PROMPTS, '--out', 'o'])
    settings, _ = generate.check_args(given)  # given: the record's folder is not needed
    assert settings.model_name == 'tiny' and settings.tokenizer == str(tmp_path)


@pytest.mark.stack
def test_the_record_beside_a_checkpoint_is_the_one_inside_which_a_copy_alone_is_drawn_with(
    checkpoint, tmp_path, capsys
):
    """The run writes its record beside its checkpoints (read without torch); a checkpoint copied on its own
    carries the same record inside, read once torch loads it: the same flags, the same images."""
    beside = json.loads((checkpoint.parent / RUN_DESCRIPTION_FILE).read_text())
    assert beside == recorded_inside(checkpoint) and beside['model_name'] == 'tiny'
    with_record = draw(checkpoint, tmp_path / 'with-record')
    printed = capsys.readouterr().out
    alone = draw(shutil.copy(checkpoint, tmp_path / 'alone.pt'), tmp_path / 'alone')
    assert "from the checkpoint's run: --model_name tiny --prediction_type v_prediction" in printed
    assert capsys.readouterr().out == printed.replace('with-record', 'alone') and torch.equal(with_record, alone)
    (tmp_path / RUN_DESCRIPTION_FILE).write_text('[1, 2]')  # beside the copy now: not a record
    with pytest.raises(SystemExit):
        generate.cli(['--checkpoint', str(tmp_path / 'alone.pt'), *PROMPTS, '--out', str(tmp_path / 'o')])
    assert capsys.readouterr().err == (
        f'error: {tmp_path / RUN_DESCRIPTION_FILE}: not the JSON object of a run description; remove it (the '
        'checkpoint holds the record too)\n'
    )


def test_the_flags_are_settled_from_the_record_before_torch_loads(checkpoint, tmp_path):
    """Read before torch and Diffusers are loaded (seconds), so that a flag the record makes bad is answered at once."""
    argv = ['--checkpoint', str(checkpoint), '--prompt', 'a', '--out', str(tmp_path)]
    code = (
        'import sys, generate\n'
        f'args = generate.parse_args({argv!r})\n'
        'settings, _ = generate.check_args(args)\n'
        "print(settings.model_name, settings.prediction_type, 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines()[-1] == 'tiny v_prediction False', run.stderr
