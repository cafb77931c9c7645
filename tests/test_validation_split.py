"""convert.py's held-out split (--validation_fraction, by a hash of each file's name) and a run's use of it: found
beside the training data, refused where its images are the training set's, its captions drawn as sample grids."""

import shutil
import warnings
from pathlib import Path

import pytest
from composer.core import Callback
from conftest import jpeg, settled
from test_convert import read_mds

import convert
from guards.arguments import ConfigError
from runs.run import main
from settings import split_overlap
from settings.config import resolve_config
from settings.flags import parse_args


def write_captioned(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f'{i:03}.jpg').write_bytes(jpeg(i, (32, 32)))
        (folder / f'{i:03}.txt').write_text(f'photo {i}')
    return folder


def captions(location) -> list[str]:
    return [caption for _, caption in read_mds(location)]


def test_validation_fraction_holds_out_the_same_files_on_every_conversion(tmp_path, capsys):
    photos = write_captioned(tmp_path / 'photos', 40)
    out, split = tmp_path / 'out', tmp_path / 'out' / 'validation'
    stats = convert.main([str(photos), str(out), '--validation_fraction', '0.25'])
    training, held_out = captions(out), captions(split)
    assert (stats['written'], stats['held_out']) == (len(training), len(held_out)) == (34, 6)
    assert sorted(training + held_out) == sorted(f'photo {i}' for i in range(40))  # each once, on one side
    assert held_out != [f'photo {i}' for i in range(6)]  # by name, not the first ones
    # 6 of 40 where a quarter was asked for: said, with why.
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(
            f'wrote 34 training samples in 1 shard(s) to {out}, 6 held out for validation in {split} (15% of 40, where '
            '--validation_fraction 0.25 asked for about 10: images are held out by a hash of their names, which only a '
            'large folder splits evenly), in '
        )
    )
    # By each file's name within its input folder: the same split from a copy elsewhere, and a larger fraction only
    # adds to it.
    moved = shutil.copytree(photos, tmp_path / 'moved' / 'pictures')
    convert.convert([str(moved)], str(tmp_path / 'again'), validation_fraction=0.25, progress=False)
    assert captions(tmp_path / 'again' / 'validation') == held_out
    convert.convert([str(photos)], str(out), overwrite=True, validation_fraction=0.5, progress=False)
    assert set(held_out) < set(captions(split))
    # Converting again without it leaves no earlier split behind (it would overlap the training samples).
    convert.convert([str(photos)], str(out), overwrite=True, progress=False)
    assert not split.exists() and len(captions(out)) == 40
    assert convert.split_name(f'{tmp_path}/laion/00000.tar:sub/000123', tmp_path / 'laion') == '00000.tar:sub/000123'


def test_a_split_that_falls_on_one_side(tmp_path, capsys):
    photos = write_captioned(tmp_path / 'photos', 1)
    stats = convert.main([str(photos), str(tmp_path / 'few'), '--validation_fraction', '0.01'])
    assert stats['held_out'] == 0 and not (tmp_path / 'few' / 'validation').exists()
    assert 'none held out for validation (too few images for --validation_fraction 0.01)' in capsys.readouterr().out
    with pytest.raises(convert.NothingWritten, match='no training samples written, all 1 held out for validation'):
        convert.main([str(photos), str(tmp_path / 'all'), '--validation_fraction', '0.99'])
    assert not (tmp_path / 'all').exists()


@pytest.mark.parametrize('fraction', ['1', '1.5', '-0.1', 'nan'])
def test_a_validation_fraction_outside_0_to_1_is_refused(tmp_path, fraction):
    photos = write_captioned(tmp_path / 'photos', 1)
    refused = r'--validation_fraction .*: the fraction of images held out, at least 0 and below 1 \(e.g. 0.05\)'
    with pytest.raises(convert.ConvertError, match=refused):
        convert.main([str(photos), str(tmp_path / 'out'), '--validation_fraction', fraction])
    assert not (tmp_path / 'out').exists()


class RecordEvaluations(Callback):
    """The size of the split each evaluation reads."""

    def __init__(self):
        self.sizes = []

    def eval_start(self, state, logger):
        self.sizes.append(len(state.dataloader.dataset))


def test_a_validation_split_of_training_images_is_refused_and_a_few_shared_are_named(tmp_path, monkeypatch):
    """A split converted apart from the same images (here: all of them) would validate on what the run trains on."""
    photos = write_captioned(tmp_path / 'photos', 24)
    convert.convert([str(photos)], str(tmp_path / 'train'), progress=False)
    convert.convert([str(photos)], str(tmp_path / 'same'), progress=False)
    flags = ['--model_name', 'tiny', '--local', str(tmp_path / 'train'), '--image_size', '32', '--eval_interval', '2ba']
    with pytest.raises(ConfigError, match=rf'same: 24 of its 24 images are also in the training set {tmp_path}/train'):
        resolve_config(parse_args([*flags, '--eval_local', str(tmp_path / 'same')]))

    others = write_captioned(tmp_path / 'others', 60)  # its images 0-23 are the training set's
    for i in range(24):
        if i != 5:  # one image shared of the 37 the split holds
            for suffix in ('jpg', 'txt'):
                (others / f'{i:03}.{suffix}').unlink()
    convert.convert([str(others)], str(tmp_path / 'few'), progress=False)
    config = resolve_config(parse_args([*flags, '--eval_local', str(tmp_path / 'few')]))
    assert f'validation split {tmp_path}/few: 1 of its 37 images are also in the training set' in ' '.join(config.notes)

    monkeypatch.setattr(split_overlap, 'MAX_TRAINING_BYTES', 1000)
    config = resolve_config(parse_args([*flags, '--eval_local', str(tmp_path / 'same')]))
    assert any('not checked for images the run trains on (the training set is' in note for note in config.notes)


def test_training_with_eval_interval_finds_the_converted_split(tmp_path, capfd):
    photos = write_captioned(tmp_path / 'photos', 24)
    out = tmp_path / 'mds'
    held_out = convert.convert([str(photos)], str(out), validation_fraction=0.25, progress=False)['held_out']
    flags = ['--model_name', 'tiny', '--local', str(out), '--image_size', '32', '--batch_size', '3']
    record = RecordEvaluations()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        main(settled([*flags, '--max_duration', '2ba', '--eval_interval', '2ba']), (record,))
    assert record.sizes == [held_out, held_out]  # at the start and at the end
    assert held_out % 3 and not [w for w in caught if 'Cannot split' in str(w.message)]  # a last, shorter batch
    assert (
        f'validation loss on {out}/validation ({held_out} images), the held-out split found beside the training '
        'data (where convert.py --validation_fraction writes one)' in capfd.readouterr().out
    )
    # Sample grids draw the split's captions: its first four (the tiny run's count of prompts).
    split_captions = [caption for _, caption in read_mds(out / 'validation')][:4]
    sampled = resolve_config(parse_args([*flags, '--eval_interval', '2ba', '--sample_interval', '2ba']))
    assert list(sampled.evaluation.sample_prompts) == split_captions and len(split_captions) == min(4, held_out)
    assert any(note.startswith('sample grids: the first ') for note in sampled.notes)
    given = tmp_path / 'prompts.txt'
    given.write_text('a lighthouse\n')
    chosen = resolve_config(
        parse_args([*flags, '--eval_interval', '2ba', '--sample_interval', '2ba', '--sample_prompts', str(given)])
    )
    assert chosen.evaluation.sample_prompts == ('a lighthouse',)  # a flag given wins
    # A converted folder without a split: the error says how to make one.
    convert.convert([str(photos)], str(out), overwrite=True, progress=False)
    how = r'no held-out split to validate on: .*, or convert with --validation_fraction, which writes one'
    with pytest.raises(ConfigError, match=how):
        resolve_config(parse_args([*flags, '--eval_interval', '2ba']))
