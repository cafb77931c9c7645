"""Files from elsewhere run no code: a checkpoint that names code is refused in one line by generate.py, by
--autoresume's own check and by Composer's load of the checkpoint it resumes from, unless --trust_checkpoint is
given; a real checkpoint of this repo (EMA included) loads weights-only; a dataset column of pickles is refused."""

import pathlib

import pytest
import torch
from conftest import TINY, good_samples, settled, write_dataset

import generate
from guards.arguments import ConfigError
from runs.checkpoints import composer_load, load_checkpoint_file
from runs.composer_fixes import load_checkpoints_weights_only
from runs.run import main
from settings.dataset_checks import DataError, describe_dataset

RUN = [*TINY, '--image_size', '32', '--batch_size', '4', '--run_name', 'u', '--save_interval', '1ba', '--use_ema']


class TouchesAFile:
    """Unpickled, it creates `marker`: the harmless stand-in for code a planted checkpoint would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.fixture(scope='module')
def save_folder(tmp_path_factory):
    """A save folder of 2 batches of the tiny model with EMA, its latest checkpoint whole."""
    folder = tmp_path_factory.mktemp('trusted') / 'ckpt'
    main(settled([*RUN, '--max_duration', '2ba', '--save_folder', str(folder)]))
    return folder


def planted(checkpoint, path, marker):
    """A copy of the checkpoint with one more value in its state: an object whose unpickling runs code."""
    saved = torch.load(checkpoint, map_location='cpu', weights_only=False)
    saved['state']['planted'] = TouchesAFile(marker)
    torch.save(saved, path)
    return path


@pytest.mark.stack
def test_a_checkpoint_of_this_repo_loads_weights_only_with_its_ema_and_random_state(save_folder):
    loaded = load_checkpoint_file(save_folder / 'latest-rank0.pt')
    trained = torch.load(save_folder / 'latest-rank0.pt', map_location='cpu', weights_only=False)
    state, trained_state = loaded['state'], trained['state']
    assert state['timestamp']['Timestamp']['batch'] == 2
    ema = dict(state['algorithms'])['EMA']['ema']
    assert ema and all(
        torch.equal(ema[name], trained_ema)
        for name, trained_ema in dict(trained_state['algorithms'])['EMA']['ema'].items()
    )
    numpy_state, trained_numpy_state = loaded['rng'][0]['numpy'], trained['rng'][0]['numpy']
    assert (numpy_state[1] == trained_numpy_state[1]).all()  # NumPy's random state, an array


@pytest.mark.stack
def test_generate_refuses_a_checkpoint_that_names_code_unless_trusted(save_folder, tmp_path, capfd):
    marker = tmp_path / 'ran'
    evil = planted(save_folder / 'latest-rank0.pt', tmp_path / 'evil.pt', marker)
    flags = ['--checkpoint', str(evil), '--prompt', 'a red circle', '--steps', '1']
    with pytest.raises(SystemExit) as stop:
        generate.cli([*flags, '--out', str(tmp_path / 'refused')])
    assert stop.value.code == 2
    err = capfd.readouterr().err
    assert f'--checkpoint {evil}: refused, it names code that loading would run' in err
    assert '--trust_checkpoint' in err and 'Traceback' not in err
    assert not marker.exists() and not (tmp_path / 'refused').exists()
    generate.main(generate.parse_args([*flags, '--out', str(tmp_path / 'trusted'), '--trust_checkpoint']))
    assert marker.exists()  # trusted on purpose: loaded as torch.load(weights_only=False) would


@pytest.mark.stack
def test_autoresume_refuses_a_planted_checkpoint_before_loading_it(save_folder, tmp_path):
    folder = tmp_path / 'ckpt'
    folder.mkdir()
    marker = tmp_path / 'ran'
    planted(save_folder / 'latest-rank0.pt', folder / 'ep0-ba2-rank0.pt', marker)
    (folder / 'latest-rank0.pt').symlink_to('ep0-ba2-rank0.pt')
    with pytest.raises(ConfigError, match=r'--autoresume: the checkpoint .*latest-rank0.pt: refused, it names code'):
        main(settled([*RUN, '--max_duration', '3ba', '--save_folder', str(folder), '--autoresume']))
    assert not marker.exists()


def test_composers_own_load_is_weights_only_too(save_folder, tmp_path):
    from composer.utils import checkpoint as composer_checkpoint

    marker = tmp_path / 'ran'
    evil = planted(save_folder / 'latest-rank0.pt', tmp_path / 'evil.pt', marker)
    original = composer_checkpoint._torch_load_with_validation
    try:
        load_checkpoints_weights_only(composer_load(trust=False))
        resumed = composer_checkpoint.safe_torch_load(str(save_folder / 'latest-rank0.pt'))
        assert resumed['state']['timestamp']['Timestamp']['batch'] == 2
        with pytest.raises(ConfigError, match='refused, it names code that loading would run'):
            composer_checkpoint.safe_torch_load(str(evil))
        assert not marker.exists()
        load_checkpoints_weights_only(composer_load(trust=True))
        composer_checkpoint.safe_torch_load(str(evil))
        assert marker.exists()
    finally:
        composer_checkpoint._torch_load_with_validation = original


def test_a_dataset_column_of_pickles_is_refused(tmp_path):
    samples = [{**sample, 'extra': {'any': 'object'}} for sample in good_samples(2)]
    folder = write_dataset(tmp_path / 'mds', samples, columns={'jpg': 'bytes', 'caption': 'str', 'extra': 'pkl'})
    with pytest.raises(DataError, match=r"stores column 'extra' as pickles \('pkl'\), which reading would run as code"):
        describe_dataset(None, folder)
