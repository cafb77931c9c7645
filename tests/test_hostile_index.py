"""A dataset's index.json is untrusted input: a name leading outside the dataset's folder (`..`, absolute, a
backslash, a NUL, a link) or a field sized to exhaust memory or disk is refused in one line naming the dataset and
the name, before anything is downloaded or read, by every reader of an index: a run's training and validation data
(--remote and --local), the dataset checks, Streaming's own dataset, precompute.py's merge and generate.py's FID
reference (the validation split's reader)."""

import json
import os
import re
from pathlib import Path

import pytest
from conftest import good_samples, s3_client, settled, write_dataset

from datapath.streaming_fixes import CheckedStreamingDataset
from guards.arguments import ConfigError
from runs.evaluation import ValidationSplit, fetch_split
from runs.precomputing import merge_parts
from settings import dataset_checks
from settings.dataset_checks import DataError, describe_dataset, first_captions

RUN = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '2ba']


def dataset_with(folder: Path, change) -> Path:
    """A dataset of 12 samples in 3 or more shards, its index.json's second shard changed by `change(shard)`."""
    write_dataset(folder, good_samples(12), size_limit=1 << 12)
    index = json.loads((folder / 'index.json').read_text())
    change(index['shards'][1])
    (folder / 'index.json').write_text(json.dumps(index))
    return folder


def renamed(name: str):
    def change(shard):
        shard['raw_data']['basename'] = name

    return change


ESCAPING_NAMES = {
    'parent': ('../escaped.mds', "holds a '..' part"),
    'deeper': ('sub/../../../escaped.mds', "holds a '..' part"),
    'absolute': ('/tmp/escaped.mds', 'is absolute'),
    'backslash': ('..\\escaped.mds', 'holds a backslash'),
    'nul': ('shard\0.mds', 'holds a NUL'),
}


@pytest.mark.parametrize('name, reason', ESCAPING_NAMES.values(), ids=ESCAPING_NAMES)
def test_a_remote_folders_index_naming_a_file_outside_is_refused_before_anything_is_cached(tmp_path, name, reason):
    """Before: the run trained, exit 0, and Streaming wrote CACHE/escaped.mds beside its cache folder CACHE/c."""
    remote = dataset_with(tmp_path / 'remote', renamed(name))
    cache = tmp_path / 'cache' / 'c'
    expected = f'{remote}: index.json names a file {name!r} (raw_data of shard 1), which {reason}: refused'
    with pytest.raises(ConfigError, match=f'^{re.escape(expected)}'):  # the line a run ends with, exit 2
        settled([*RUN, '--remote', str(remote), '--local', str(cache)])
    with pytest.raises(DataError) as refused:
        CheckedStreamingDataset(remote=str(remote), local=str(cache), batch_size=4)
    assert str(refused.value).startswith(expected) and '\n' not in str(refused.value)
    assert sorted(path.name for path in (tmp_path / 'cache').rglob('*')) == ['c', 'index.json']


def test_a_local_dataset_or_split_naming_a_file_outside_is_refused(tmp_path):
    (tmp_path / 'escaped.mds').write_bytes(b'outside')
    data = dataset_with(tmp_path / 'data', renamed('../escaped.mds'))
    refused = f"{data}: index.json names a file '../escaped.mds' (raw_data of shard 1), which holds a '..' part"
    with pytest.raises(ConfigError, match=re.escape(refused)):
        settled([*RUN, '--local', str(data)])
    for read in (
        lambda: ValidationSplit(str(data), (4, 4, 4), 32),  # --eval_local and generate.py's --fid_reference
        lambda: first_captions(str(data), 4),
        lambda: CheckedStreamingDataset(local=str(data), batch_size=4),
    ):
        with pytest.raises(DataError, match=re.escape(refused)):
            read()


@pytest.mark.parametrize('linked', ['file', 'folder'])
def test_a_name_that_a_link_leads_outside_the_folder_is_refused(tmp_path, linked):
    outside = dataset_with(tmp_path / 'outside', lambda shard: None)
    data = dataset_with(tmp_path / 'data', lambda shard: None)
    name = json.loads((data / 'index.json').read_text())['shards'][1]['raw_data']['basename']
    if linked == 'file':
        (data / name).unlink()
        (data / name).symlink_to(outside / name)
    else:
        (data / 'part').symlink_to(outside, target_is_directory=True)
        index = json.loads((data / 'index.json').read_text())
        index['shards'][1]['raw_data']['basename'] = f'part/{name}'
        (data / 'index.json').write_text(json.dumps(index))
    with pytest.raises(DataError, match=f'a link in {data} leads outside it: refused'):
        describe_dataset(None, str(data))


HUGE_FIELDS = {
    'bytes': (lambda shard: shard['raw_data'].update(bytes=1 << 40), 'holds 1099511627776 bytes, not a whole number'),
    'samples': (lambda shard: shard.update(samples=10**12), 'holds 1000000000000 samples, not a whole number up to'),
    'negative': (lambda shard: shard.update(samples=-1), 'holds -1 samples'),
    'columns': (
        lambda shard: shard.update(
            column_names=[f'c{i}' for i in range(10**4)],
            column_encodings=['bytes'] * 10**4,
            column_sizes=[None] * 10**4,
        ),
        'that are not lists of one length up to 256',
    ),
    'zip': (
        lambda shard: shard.update(zip_data={'basename': '../x.zstd', 'bytes': 1, 'hashes': {}}),
        re.escape("names a file '../x.zstd' (zip_data of shard 1)"),
    ),
}


@pytest.mark.parametrize('change, message', HUGE_FIELDS.values(), ids=HUGE_FIELDS)
def test_fields_sized_to_exhaust_memory_or_disk_are_refused_in_one_line(tmp_path, change, message):
    data = dataset_with(tmp_path / 'data', change)
    with pytest.raises(DataError, match=message) as refused:
        describe_dataset(None, str(data))
    assert str(refused.value).startswith(f'{data}: index.json ') and '\n' not in str(refused.value)
    with pytest.raises(DataError, match=message):
        CheckedStreamingDataset(local=str(data), batch_size=4)


def test_an_index_file_too_large_is_refused_before_it_is_read(tmp_path, monkeypatch):
    data = dataset_with(tmp_path / 'data', lambda shard: None)
    size = (data / 'index.json').stat().st_size
    monkeypatch.setattr(dataset_checks, 'MAX_INDEX_BYTES', size - 1)
    with pytest.raises(DataError, match=f'{data}: index.json is {size:,} bytes, more than {size - 1:,}: refused'):
        describe_dataset(None, str(data))


def test_a_buckets_index_naming_a_file_outside_is_refused_before_any_shard_is_fetched(s3, tmp_path, monkeypatch):
    source = dataset_with(tmp_path / 'source', renamed('../../escaped.mds'))
    client = s3_client(s3)
    client.create_bucket(Bucket='hostile')
    for path in source.iterdir():
        client.upload_file(str(path), 'hostile', f'mds/{path.name}')
    client.put_object(Bucket='hostile', Key='escaped.mds', Body=b'not a shard')
    refused = "s3://hostile/mds: index.json names a file '../../escaped.mds' (raw_data of shard 1)"
    with pytest.raises(ConfigError, match=re.escape(refused)):
        settled([*RUN, '--remote', 's3://hostile/mds', '--local', str(tmp_path / 'cache' / 'c')])
    with pytest.raises(DataError, match=re.escape(refused)):
        fetch_split('s3://hostile/mds')  # --eval_remote
    with pytest.raises(DataError, match=re.escape(refused)):
        CheckedStreamingDataset(remote='s3://hostile/mds', local=str(tmp_path / 'cache' / 'c'), batch_size=4)
    assert not (tmp_path / 'escaped.mds').exists() and not (tmp_path / 'cache' / 'escaped.mds').exists()
    size = client.head_object(Bucket='hostile', Key='mds/index.json')['ContentLength']
    monkeypatch.setattr(dataset_checks, 'MAX_INDEX_BYTES', size - 1)
    with pytest.raises(DataError, match=f'^s3://hostile/mds: index.json is {size:,} bytes, more than'):
        dataset_checks.check_dataset('s3://hostile/mds', None)


def test_precomputes_merge_refuses_a_part_whose_index_names_a_file_outside(tmp_path):
    out = tmp_path / 'out'
    dataset_with(out / 'part-00000', lambda shard: None)
    dataset_with(out / 'part-00001', renamed('../../escaped.mds'))
    with pytest.raises(DataError, match=f"--out {out}: index.json names a file '../../escaped.mds'"):
        merge_parts(str(out), 2)
    assert not (out / 'index.json').exists()
    assert sorted(os.listdir(out)) == ['part-00000', 'part-00001']
