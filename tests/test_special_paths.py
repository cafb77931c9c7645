"""Paths with characters that mean something somewhere (braces to Composer's format strings, '#' and '?' to URL
parsers, '%', spaces, non-ASCII) are used as given by every path flag, or refused in one line where a library would
read them otherwise: benchmark.py's --save_folder (Composer reads it as a URL and a template), its other outputs and
data folders, convert.py's input and output, precompute.py's --out, generate.py's --checkpoint and --out."""

import json
import os
import re
from pathlib import Path

import pytest
from conftest import jpeg, settled

import convert
import generate
import precompute
from guards.arguments import ConfigError
from runs.run import main
from settings.config import resolve_config
from settings.flags import parse_args

# A folder name with each character that means something: a Composer template field and a lone brace, a
# percent sign, spaces, a URL's fragment and query marks, a parameter mark, non-ASCII letters.
NAME = 'run {run_name} {rank {x} 50% #1 ?q ;p é ü'
# The same for --save_folder, less what Composer would change there (braces, '#', '?', ';'): refused, below.
SAVE_NAME = 'ckpt 50% é ü'
REAL_DATA = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4']
QUICK = [*REAL_DATA, '--use_synth_data']


def test_save_folder_is_used_as_given_and_resumes_from_there(tmp_path):
    folder = tmp_path / SAVE_NAME
    flags = [*QUICK, '--save_folder', str(folder), '--run_name', 'r', '--save_interval', '1ba']
    main(settled([*flags, '--max_duration', '2ba']))
    assert [path.name for path in tmp_path.iterdir()] == [SAVE_NAME]
    assert (folder / 'latest-rank0.pt').readlink().name == 'ep0-ba2-rank0.pt'
    trainer = main(settled([*flags, '--max_duration', '3ba', '--autoresume']))
    assert int(trainer.state.timestamp.batch) == 3
    assert (folder / 'latest-rank0.pt').readlink().name == 'ep0-ba3-rank0.pt'


def test_a_relative_save_folder_that_reads_as_a_url_scheme_is_used_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(settled([*QUICK, '--max_duration', '1ba', '--save_folder', 'run:2', '--save_interval', '1ba']))
    assert (tmp_path / 'run:2' / 'ep0-ba1-rank0.pt').is_file()


@pytest.mark.parametrize('char', ['#', '?', ';'])
def test_a_save_folder_that_composer_would_cut_is_refused_in_one_line(tmp_path, char):
    folder = str(tmp_path / f'ckpt {char}1')
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args([*QUICK, '--save_folder', folder]))
    assert str(refused.value) == (
        f"--save_folder {folder}: Composer reads it as a URL, whose path ends before the '{char}': the checkpoints "
        "would go to another folder; give one without '#', '?' or ';'"
    )


@pytest.mark.parametrize('name', ['ckpt-{run_name}', 'ckpt {', 'ckpt }', 'ckpt {x}'])
def test_a_save_folder_with_braces_is_refused_in_one_line(tmp_path, name):
    """Composer formats the folder, and each checkpoint's path in it again as it saves: no escaping keeps a brace,
    and a {run_name} filled in would not be the folder this run reads for --autoresume."""
    folder = str(tmp_path / name)
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args([*QUICK, '--save_folder', folder, '--run_name', 'r']))
    assert str(refused.value) == (
        f'--save_folder {folder}: Composer fills in braces as a template ({{run_name}}, {{rank}}), where this run '
        "reads the folder as given: the checkpoints would go to another folder; give one without '{' or '}'"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_other_outputs_of_a_run_take_any_name(tmp_path):
    folder = tmp_path / NAME
    flags = ['--results_json', str(folder / 'results {x} %.json'), '--sample_dir', str(folder / 'samples')]
    flags += ['--sample_interval', '1ba', '--export_pipeline', str(folder / 'pipeline'), '--profile', str(folder / 'p')]
    main(settled([*QUICK, '--max_duration', '2ba', *flags]))
    assert json.loads((folder / 'results {x} %.json').read_text())['img_per_sec'] > 0
    assert sorted(path.name for path in (folder / 'samples').iterdir()) == [
        'samples-ba000000.png',
        'samples-ba000001.png',
        'samples-ba000002.png',
    ]
    assert (folder / 'pipeline' / 'model_index.json').is_file()
    assert list((folder / 'p').glob('*.json'))  # the profiler's trace, in the folder as named
    assert sorted(path.name for path in tmp_path.iterdir()) == [NAME]


@pytest.fixture(scope='module')
def converted(tmp_path_factory) -> Path:
    """Captioned images under a folder of that name, with such names themselves, converted into another, a
    quarter held out."""
    root = tmp_path_factory.mktemp('data')
    images = root / NAME / 'images'
    images.mkdir(parents=True)
    for i in range(16):
        (images / f'photo {i} #{i} {{x}} 5% é.jpg').write_bytes(jpeg(i))
        (images / f'photo {i} #{i} {{x}} 5% é.txt').write_text(f'photo number {i}')
    out = root / NAME / 'mds'
    stats = convert.main([str(images), str(out), '--validation_fraction', '0.25'])
    assert stats['written'] + stats['held_out'] == 16 and stats['held_out']
    return out


def test_convert_reads_and_writes_any_name_and_a_run_trains_on_it(converted):
    index = json.loads((converted / 'index.json').read_text())
    assert [shard['raw_data']['basename'] for shard in index['shards']] == ['shard.00000.mds']
    flags = ['--local', str(converted), '--eval_local', str(converted / 'validation'), '--eval_interval', '1ba']
    trainer = main(settled([*REAL_DATA, '--max_duration', '2ba', *flags]))
    assert int(trainer.state.timestamp.batch) == 2


def test_precompute_writes_to_any_name_and_a_run_trains_on_it(converted, tmp_path):
    """Streaming's merge_index reads its folder as a URL: merged there, a '#' or '?' in --out cut the path, and the
    indexes of the folder above were merged in."""
    out = tmp_path / NAME / 'latents'
    (tmp_path / 'index.json').write_text('{"version": 2, "shards": []}')  # what a cut path would have merged
    flags = ['--local', str(converted), '--out', str(out), '--model_name', 'tiny', '--image_size', '32']
    precompute.main([*flags, '--part_size', '4'])
    index = json.loads((out / 'index.json').read_text())
    converted_samples = json.loads((converted / 'index.json').read_text())['shards'][0]['samples']
    assert sum(shard['samples'] for shard in index['shards']) == converted_samples
    assert all(shard['raw_data']['basename'].startswith('part-0000') for shard in index['shards'])
    flags = ['--precomputed_latents', '--local', str(out), '--max_duration', '2ba']
    trainer = main(settled([*REAL_DATA, *flags]))
    assert int(trainer.state.timestamp.batch) == 2


def test_relative_folders_with_a_colon_are_folders_not_urls(converted, tmp_path, monkeypatch):
    """urlparse gives `a:b` the scheme 'a', and Streaming's writer refused it as an unknown cloud (a traceback):
    convert.py's output, precompute.py's --out and a run's --local, each relative with a colon, are folders."""
    monkeypatch.chdir(tmp_path)
    images = tmp_path / 'images'
    images.mkdir()
    for i in range(8):
        (images / f'{i}.jpg').write_bytes(jpeg(i))
        (images / f'{i}.txt').write_text(f'photo number {i}')
    assert convert.main([str(images), 'run:2'])['written'] == 8 and (tmp_path / 'run:2' / 'index.json').is_file()
    precompute.main(['--local', 'run:2', '--out', 'latents:2', '--model_name', 'tiny', '--image_size', '32'])
    assert (tmp_path / 'latents:2' / 'index.json').is_file()
    for flags in (['--local', 'run:2'], ['--precomputed_latents', '--local', 'latents:2']):
        assert int(main(settled([*REAL_DATA, '--max_duration', '2ba', *flags])).state.timestamp.batch) == 2


def test_generate_reads_a_checkpoint_and_writes_images_under_any_name(tmp_path):
    save_folder = tmp_path / SAVE_NAME
    main(settled([*QUICK, '--max_duration', '1ba', '--save_folder', str(save_folder), '--save_interval', '1ba']))
    out = tmp_path / NAME / 'images'
    checkpoint = save_folder / 'latest-rank0.pt'
    generate.main(
        generate.parse_args(['--checkpoint', str(checkpoint), '--prompt', 'a cat', '--steps', '1', '--out', str(out)])
    )
    assert sorted(os.listdir(out)) == ['0000.png', 'grid.png', 'prompts.txt']
    assert sorted(os.listdir(tmp_path / NAME)) == ['images']  # nothing staged left beside it


def test_file_names_that_are_not_utf8_are_converted_or_skipped_by_name(tmp_path, capsys):
    """A name in another encoding (Latin-1's é, a stray byte), as a folder copied from an old machine holds:
    converted, held out by the same hash of its bytes, and named in a skip line; before, a traceback."""
    photos = tmp_path / 'photos'
    photos.mkdir()
    folder = os.fsencode(photos)
    for i, name in enumerate([b'caf\xe9', b'stray\xff', b'plain', b'uncaptioned\xfe']):
        Path(os.fsdecode(folder + b'/' + name + b'.jpg')).write_bytes(jpeg(i))
        if not name.startswith(b'uncaptioned'):
            Path(os.fsdecode(folder + b'/' + name + b'.txt')).write_text(f'photo {i}')
    stats = convert.main([str(photos), str(tmp_path / 'mds'), '--validation_fraction', '0.5'])
    assert stats['written'] + stats['held_out'] == 3 and stats['skipped'] == {'no caption file': 1}
    assert (
        'skipped ' + str(photos) + '/uncaptioned\\xfe.jpg: no caption file uncaptioned\\xfe.txt'
        in capsys.readouterr().err
    )
    assert stats['held_out'] == sum(
        convert.split_position(os.fsdecode(n)) < 0.5 for n in [b'caf\xe9.jpg', b'stray\xff.jpg', b'plain.jpg']
    )


@pytest.mark.parametrize(
    ('flag', 'name'),
    [('--run_name', '../../x'), ('--run_name', 'a/b'), ('--run_name', '..'), ('--wandb_name', '..\\x')],
)
def test_a_name_that_would_leave_its_folder_is_refused(flag, name, tmp_path):
    """--run_name names the sample grids' folder under results/samples (and W&B's run): '../../x' wrote them
    outside the results folder."""
    flags = [*QUICK, flag, name, '--sample_interval', '1ba', '--max_duration', '1ba']
    with pytest.raises(ConfigError, match=rf"^{flag} '{re.escape(name)}': a name, not a path"):
        resolve_config(parse_args(flags))


def test_a_name_with_dots_inside_is_a_name(tmp_path):
    config = resolve_config(parse_args([*QUICK, '--run_name', 'v1..2', '--sample_interval', '1ba']))
    assert Path(config.evaluation.sample_dir) == Path('results', 'samples', 'v1..2')
