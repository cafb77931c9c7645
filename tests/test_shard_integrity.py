"""Corrupted bytes never train silently: convert.py, precompute.py and the sample dataset write each shard with
its hash, and a run reading a shard whose bytes no longer match (flipped on disk, the size unchanged) ends in one
line naming the shard, from the main process or a loader worker."""

import json
from pathlib import Path

import pytest
from conftest import REPO, jpeg, run_cli, settled

import convert
from runs.run import main
from settings.dataset_checks import SHARD_HASH, DataError

RUN = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '1ep']


@pytest.fixture
def converted(tmp_path):
    """24 captioned photos converted by convert.py into small shards, 4 of them held out."""
    photos = tmp_path / 'photos'
    photos.mkdir()
    for i in range(24):
        (photos / f'{i:02}.jpg').write_bytes(jpeg(i, (48, 40)))
        (photos / f'{i:02}.txt').write_text(f'photo number {i}')
    convert.main([str(photos), str(tmp_path / 'mds'), '--size_limit', '8kb', '--validation_fraction', '0.2'])
    return tmp_path / 'mds'


def shards(folder: Path) -> list[dict]:
    return json.loads((folder / 'index.json').read_text())['shards']


def flip_bytes_inside(path: Path) -> None:
    """64 bytes inverted in the middle of the shard's sample data: the size, the header and the offsets as they
    were, so that only a hash can tell."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - byte for byte in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def test_convert_writes_a_hash_of_every_shard_and_its_held_out_split(converted):
    for folder in (converted, converted / 'validation'):
        listed = shards(folder)
        assert listed and all(SHARD_HASH in shard['raw_data']['hashes'] for shard in listed)


def test_a_shard_whose_bytes_changed_ends_the_run_naming_it(converted):
    damaged = shards(converted)[1]['raw_data']['basename']
    flip_bytes_inside(converted / damaged)
    with pytest.raises(DataError, match=rf'{converted}: shard {damaged} does not match the {SHARD_HASH} hash'):
        main(settled([*RUN, '--local', str(converted)]))


def test_a_shards_hash_is_checked_before_its_first_sample_is_read(converted):
    """Offsets damaged in a shard's header (its size and sample count kept): Streaming's reader, reading first,
    failed on them (IndexError: sample 0 is not present); the hash names the shard first."""
    damaged = shards(converted)[0]['raw_data']['basename']
    data = bytearray((converted / damaged).read_bytes())
    count = int.from_bytes(data[:4], 'little')
    data[4 : 8 + 4 * count] = bytes(4 + 4 * count)  # every sample starts and ends at 0
    (converted / damaged).write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf'{converted}: shard {damaged} does not match the {SHARD_HASH} hash'):
        main(settled([*RUN, '--local', str(converted), '--seed', '1']))


def test_whole_shards_train_to_the_end(converted):
    trainer = main(settled([*RUN, '--local', str(converted)]))
    assert int(trainer.state.timestamp.epoch) == 1


@pytest.mark.slow
def test_a_damaged_shard_read_by_a_loader_worker_ends_the_run_in_one_line(converted):
    damaged = shards(converted)[-1]['raw_data']['basename']
    flip_bytes_inside(converted / damaged)
    run = run_cli(*RUN, '--local', str(converted), '--num_workers', '2', launcher=('python',))
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f'error: {converted}: shard {damaged} does not match the {SHARD_HASH} hash index.json records (damaged on '
        'disk or in transfer): it cannot be trusted; restore it, or convert the dataset again'
    )
    assert 'Traceback' not in run.stderr and str(REPO) not in run.stderr.splitlines()[-1]
