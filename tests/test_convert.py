"""CPU tests of convert.py (image folders, img2dataset tars, refusing to overwrite) and of S3 remotes on a
local S3-compatible server (moto, started here): upload with the converter, train from s3://, clear and
bounded errors for a missing bucket, a wrong prefix or a server that is down, and recovery from a killed run."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import boto3
import pytest
from conftest import REPO, free_port, jpeg, run_process, settled
from streaming import StreamingDataset
from test_data import RecordSamples

import convert
import precompute
from data import StreamingLAIONDataset
from datapath.streaming_fixes import prefix_lock
from guards.arguments import ConfigError
from runs.run import main
from settings.dataset_checks import DataError

PYTHON_BIN = Path(sys.executable).parent


def read_mds(location) -> list[tuple[bytes, str]]:
    dataset = StreamingDataset(local=str(location), batch_size=1, shuffle=False)
    return [(dataset[i]['jpg'], dataset[i]['caption']) for i in range(dataset.num_samples)]


def make_photo_folder(root: Path) -> list[tuple[bytes, str]]:
    """Six images, three of them bad; returns the (bytes, caption) that should be written, in order."""
    (root / 'sub').mkdir(parents=True)
    png = io.BytesIO()
    from PIL import Image

    Image.new('RGBA', (40, 30), (0, 128, 255, 128)).save(png, 'PNG')
    files = {
        'a.jpg': (jpeg(1), 'a red photo\n'),
        'c.jpg': (jpeg(2), None),  # no caption file
        'd.jpg': (b'<html><body>404 Not Found</body></html>', 'an error page'),
        'e.jpg': (jpeg(3)[:500], 'truncated'),
        'f.jpeg': (jpeg(4, (64, 96)), ''),  # an empty caption is a valid caption
        'sub/b.png': (png.getvalue(), 'ünïcödé caption 猫 🐱'),
    }
    for name, (data, caption) in files.items():
        (root / name).write_bytes(data)
        if caption is not None:
            (root / name).with_suffix('.txt').write_text(caption, encoding='utf-8')
    return [(files[name][0], files[name][1].strip()) for name in ('a.jpg', 'f.jpeg', 'sub/b.png')]


def test_image_folder_round_trip(tmp_path):
    expected = make_photo_folder(tmp_path / 'photos')
    stats = convert.convert([str(tmp_path / 'photos')], str(tmp_path / 'out'), progress=False)
    assert stats['written'] == 3 and stats['shards'] == 1
    assert stats['skipped'] == {'no caption file': 1, 'not an image': 1, 'corrupt image': 1}
    assert read_mds(tmp_path / 'out') == expected  # bytes exactly as in the files: nothing re-encoded


def test_captions_kept_in_a_hugging_face_image_folders_metadata(tmp_path):
    """metadata.jsonl (Diffusers' 'text' column, a file_name in a subfolder) and metadata.csv ('caption', in a
    subfolder of its own): each image takes its row; a same-name .txt file still wins; one listed nowhere is skipped."""
    photos = tmp_path / 'photos'
    (photos / 'train' / 'more').mkdir(parents=True)
    for number, name in enumerate(['train/a.jpg', 'train/more/b.jpg', 'train/c.jpg', 'train/d.jpg', 'other/e.jpg']):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        (photos / name).write_bytes(jpeg(number))
    rows = [{'file_name': 'a.jpg', 'text': 'a red barn'}, {'file_name': 'more/b.jpg', 'text': 'two "cats", 猫'}]
    rows.append({'file_name': 'c.jpg', 'text': 'from the metadata'})
    (photos / 'train' / 'metadata.jsonl').write_text('\n'.join(json.dumps(row) for row in rows) + '\n')
    (photos / 'train' / 'c.txt').write_text('from its caption file')
    (photos / 'other' / 'metadata.csv').write_text('file_name,caption,width\ne.jpg,"a quay, at dusk",64\n')
    stats = convert.convert([str(photos)], str(tmp_path / 'out'), progress=False)
    assert stats['written'] == 4 and stats['skipped'] == {'no caption file': 1}  # train/d.jpg
    assert read_mds(tmp_path / 'out') == [
        (jpeg(4), 'a quay, at dusk'),
        (jpeg(0), 'a red barn'),
        (jpeg(2), 'from its caption file'),
        (jpeg(1), 'two "cats", 猫'),
    ]


@pytest.mark.parametrize(
    'file, text, line',
    [
        (
            'metadata.jsonl',
            '{"file_name": "a.jpg", "text": "ok"}\n{"file_name": "b.jpg", "text": }\n',
            'line 2 is not JSON (Expecting value at column 32)',
        ),
        (
            'metadata.jsonl',
            '{"file_name": "a.jpg", "alt": "a barn"}\n',
            'no caption column (text, caption, prompt) among file_name, alt; name it with --caption_column',
        ),
        ('metadata.csv', 'name,text\na.jpg,a barn\n', 'row 2 has no file_name (the image it captions)'),
    ],
    ids=['not JSON', 'no caption column', 'no file_name'],
)
def test_metadata_that_cannot_give_captions_is_one_line_before_anything_is_written(tmp_path, file, text, line):
    photos = tmp_path / 'photos'
    photos.mkdir()
    (photos / 'a.jpg').write_bytes(jpeg(0))
    (photos / file).write_text(text)
    with pytest.raises(convert.ConvertError) as refused:
        convert.main([str(photos), str(tmp_path / 'out')])
    assert str(refused.value) == f'{photos / file}: {line}'
    assert not (tmp_path / 'out').exists()
    if 'caption_column' in line:  # named, it is read
        convert.main([str(photos), str(tmp_path / 'out'), '--caption_column', 'alt'])
        assert read_mds(tmp_path / 'out') == [(jpeg(0), 'a barn')]


def write_tar(path: Path, members: list[tuple[str, bytes]], truncate: int | None = None) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w') as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue()[:truncate])


def test_img2dataset_tars_round_trip(tmp_path):
    shards = tmp_path / 'laion'
    shards.mkdir()

    def meta(caption):
        return json.dumps({'url': 'http://x', 'caption': caption, 'status': 'success'}).encode()

    write_tar(
        shards / '00000.tar',
        [
            ('000000000.jpg', jpeg(10)),
            ('000000000.txt', b'first caption'),
            ('000000000.json', meta('first caption')),
            ('000000001.jpg', jpeg(11)),
            ('000000001.json', meta('caption from json only')),
            ('000000002.txt', b'no image'),
            ('000000002.json', meta('no image')),
            ('000000003.jpg', jpeg(12)[:400]),
            ('000000003.txt', b'truncated image'),
        ],
    )
    write_tar(shards / '00001.tar', [('000010000.jpg', jpeg(13)), ('000010000.txt', b'second tar')])
    write_tar(shards / '00002.tar', [('000020000.jpg', jpeg(14)), ('000020000.txt', b'cut')], truncate=700)
    stats = convert.convert([str(shards)], str(tmp_path / 'out'), progress=False)
    assert stats['written'] == 3
    assert stats['skipped'] == {
        'no image member': 1,
        'corrupt image': 1,
        'unreadable tar (ReadError), rest of the file skipped': 1,
    }
    # a sample is named by its tar and its key, as webdataset names it (not `00000.tar:/000000002`)
    assert stats['skipped_named'][:2] == [
        (f'{shards}/00000.tar:000000002', 'no image member'),
        (f'{shards}/00000.tar:000000003', 'corrupt image'),
    ]
    assert read_mds(tmp_path / 'out') == [
        (jpeg(10), 'first caption'),
        (jpeg(11), 'caption from json only'),
        (jpeg(13), 'second tar'),
    ]


def skipped_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(('skipped ', '... and'))]


def test_skipped_files_are_named_with_their_reason(tmp_path, capsys):
    make_photo_folder(tmp_path / 'photos')
    convert.main([str(tmp_path / 'photos'), str(tmp_path / 'out')])
    photos = tmp_path / 'photos'
    assert skipped_lines(capsys.readouterr().err) == [
        f'skipped {photos}/c.jpg: no caption file c.txt',
        f'skipped {photos}/d.jpg: not an image',
        f'skipped {photos}/e.jpg: corrupt image',
    ]
    assert not (tmp_path / 'out' / convert.STAGING).exists() and len(read_mds(tmp_path / 'out')) == 3
    assert 'warning' not in capsys.readouterr().err  # half skipped: no more than half


def write_uncaptioned(folder: Path, n: int) -> Path:
    folder.mkdir()
    for i in range(n):
        (folder / f'{i:02}.jpg').write_bytes(jpeg(i))
    return folder


def test_a_conversion_that_writes_nothing_fails_and_leaves_the_output_as_it_was(tmp_path, capsys):
    uncaptioned = write_uncaptioned(tmp_path / 'uncaptioned', 12)
    with pytest.raises(convert.ConvertError, match=r'no samples written, all 12 skipped \(12 no caption file\)'):
        convert.main([str(uncaptioned), str(tmp_path / 'new')])
    lines = skipped_lines(capsys.readouterr().err)
    assert lines == [f'skipped {uncaptioned}/{i:02}.jpg: no caption file {i:02}.txt' for i in range(10)] + [
        '... and 2 more skipped'
    ]
    assert not (tmp_path / 'new').exists()  # no empty dataset for a later run to read
    # An earlier output given with --overwrite keeps its samples.
    expected = make_photo_folder(tmp_path / 'photos')
    convert.convert([str(tmp_path / 'photos')], str(tmp_path / 'earlier'), progress=False)
    with pytest.raises(convert.ConvertError, match='the output is left as it was'):
        convert.main([str(uncaptioned), str(tmp_path / 'earlier'), '--overwrite'])
    assert read_mds(tmp_path / 'earlier') == expected and not (tmp_path / 'earlier' / convert.STAGING).exists()
    write_tar(tmp_path / 'empty.tar', [])
    with pytest.raises(convert.ConvertError, match='no samples written, the inputs hold none'):
        convert.convert([str(tmp_path / 'empty.tar')], str(tmp_path / 'new'), progress=False)
    assert not (tmp_path / 'new').exists()


def test_an_empty_folder_is_one_line_and_exit_status_2(tmp_path):
    (tmp_path / 'empty' / 'sub').mkdir(parents=True)
    (tmp_path / 'empty' / 'sub' / 'notes.txt').write_text('a caption without an image')
    run = subprocess.run(
        [sys.executable, str(REPO / 'convert.py'), str(tmp_path / 'empty'), str(tmp_path / 'out')],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f'error: {tmp_path}/empty: no .tar files, and no image files (.jpg, .jpeg, .png, .webp, .bmp, .gif, .tif, '
        '.tiff) at any depth; nothing written'
    ]
    assert not (tmp_path / 'out').exists()


def test_a_dataset_appears_only_whole(tmp_path):
    """An error part way (here the inputs' reader; Ctrl-C alike) leaves the earlier output, or none; a staging
    folder a killed conversion left behind is not counted as contents and is cleared by the next one."""
    photos = tmp_path / 'photos'
    expected = make_photo_folder(photos)
    out = tmp_path / 'out'
    convert.convert([str(photos)], str(out), progress=False)

    def failing_part_way():
        for i in range(8):
            yield f'sample {i}', jpeg(i), f'caption {i}', None, False
        raise RuntimeError('the disk went away')

    for target in (out, tmp_path / 'new'):
        with pytest.raises(RuntimeError, match='the disk went away'):
            convert.write_mds(failing_part_way(), str(target), overwrite=True, size_limit=len(jpeg(0)), progress=False)
    assert read_mds(out) == expected and not (out / convert.STAGING).exists()
    assert not (tmp_path / 'new').exists()

    (tmp_path / 'killed' / convert.STAGING).mkdir(parents=True)
    (tmp_path / 'killed' / convert.STAGING / 'shard.00000.mds').write_bytes(b'half a shard')
    assert convert.convert([str(photos)], str(tmp_path / 'killed'), progress=False)['written'] == 3
    assert sorted(path.name for path in (tmp_path / 'killed').iterdir()) == ['index.json', 'shard.00000.mds']
    # --overwrite replaces an earlier output's files, shards it no longer needs included.
    many = convert.convert([str(photos)], str(out), overwrite=True, size_limit=len(jpeg(0)), progress=False)
    small = convert.convert([str(photos)], str(out), overwrite=True, progress=False)
    assert many['shards'] > 1 and small['shards'] == 1
    assert sorted(path.name for path in out.iterdir()) == ['index.json', 'shard.00000.mds']
    assert read_mds(out) == expected


# ------------------------------------------------------------------------- captions and the held-out split


def test_caption_files_are_named_and_file_names_can_caption(tmp_path, capsys):
    photos = tmp_path / 'photos'
    photos.mkdir()
    (photos / 'a.jpg').write_bytes(jpeg(1))
    (photos / 'a.jpg.txt').write_text('beside the image, under a name not looked for')
    (photos / 'b.jpg').write_bytes(jpeg(2))
    (photos / 'b.txt').write_text('a caption file')
    (photos / 'red_barn-at--dusk.jpg').write_bytes(jpeg(3))
    convert.main([str(photos), str(tmp_path / 'out')])
    err = capsys.readouterr().err.splitlines()
    assert skipped_lines('\n'.join(err)) == [
        f'skipped {photos}/a.jpg: no caption file a.txt',
        f'skipped {photos}/red_barn-at--dusk.jpg: no caption file red_barn-at--dusk.txt',
    ]
    # More than half the inputs skipped: said, with the fix; still written, and no error (exit status 0).
    assert err[-1] == (
        'warning: 2 of 3 inputs skipped, more than half (2 no caption file); each image needs a caption file of its '
        "name ('a.jpg': 'a.txt') or a row in a metadata.jsonl or metadata.csv, or pass --caption_from_filename"
    )
    assert read_mds(tmp_path / 'out') == [(jpeg(2), 'a caption file')]

    stats = convert.main([str(photos), str(tmp_path / 'named'), '--caption_from_filename'])
    assert stats['skipped'] == {} and 'warning' not in capsys.readouterr().err
    # A caption file still wins over the file name.
    assert read_mds(tmp_path / 'named') == [(jpeg(1), 'a'), (jpeg(2), 'a caption file'), (jpeg(3), 'red barn at dusk')]


@pytest.mark.slow
def test_many_shards_and_refusing_a_non_empty_output(tmp_path, capsys):
    photos = tmp_path / 'photos'
    photos.mkdir()
    for i in range(12):
        (photos / f'{i:02}.jpg').write_bytes(jpeg(i))
        (photos / f'{i:02}.txt').write_text(f'caption {i}')
    stats = convert.main([str(photos), str(tmp_path / 'out'), '--size_limit', str(3 * len(jpeg(0)))])
    shard_files = list((tmp_path / 'out').glob('shard.*.mds'))
    assert stats['written'] == 12 and stats['shards'] == len(shard_files) >= 4
    assert f'wrote 12 samples in {len(shard_files)} shard(s)' in capsys.readouterr().out
    assert [caption for _, caption in read_mds(tmp_path / 'out')] == [f'caption {i}' for i in range(12)]
    with pytest.raises(convert.ConvertError, match='is not empty; pass --overwrite'):
        convert.convert([str(photos)], str(tmp_path / 'out'))
    assert convert.convert([str(photos)], str(tmp_path / 'out'), overwrite=True, progress=False)['written'] == 12
    with pytest.raises(convert.ConvertError, match='contains an input'):
        convert.convert([str(photos)], str(tmp_path), overwrite=True)
    run = subprocess.run(
        [sys.executable, str(REPO / 'convert.py'), str(photos), str(tmp_path / 'out')],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and 'error:' in run.stderr and 'Traceback' not in run.stderr


# ---------------------------------------------------------------------------------------- S3 remotes


def upload(s3, tmp_path, prefix, n=24) -> str:
    photos = tmp_path / f'photos-{prefix}'
    photos.mkdir()
    for i in range(n):
        (photos / f'{i:03}.jpg').write_bytes(jpeg(i, (80, 64)))
        (photos / f'{i:03}.txt').write_text(f'photo {i}')
    remote = f's3://bucket/{prefix}/mds'
    assert convert.convert([str(photos)], remote, progress=False)['written'] == n
    return remote


@pytest.mark.slow
def test_converter_uploads_and_training_streams_from_s3(s3, tmp_path):
    remote = upload(s3, tmp_path, 'train')
    keys = [o['Key'] for o in boto3.client('s3', endpoint_url=s3).list_objects_v2(Bucket='bucket')['Contents']]
    assert 'train/mds/index.json' in keys and 'train/mds/shard.00000.mds' in keys
    with pytest.raises(convert.ConvertError, match='s3://bucket/train/mds is not empty'):
        convert.convert([str(tmp_path / 'photos-train')], remote)
    record = RecordSamples()
    trainer = main(
        settled(
            [
                '--model_name',
                'tiny',
                '--remote',
                remote,
                '--batch_size',
                '4',
                '--max_duration',
                '1ep',
                '--num_workers',
                '2',
            ]
        ),
        (record,),
    )
    assert int(trainer.state.timestamp.batch) == 6
    assert sorted(i for batch in record.batches for i in batch) == list(range(24))
    # Two datasets on one remote get their own caches (Streaming refuses to share one between live datasets).
    first, second = (StreamingLAIONDataset(remote=remote, image_size=32, batch_size=4) for _ in range(2))
    assert first.streams[0].local != second.streams[0].local
    assert len(list(first)) == len(list(second)) == 24


@pytest.mark.slow
def test_a_remote_gets_an_index_only_when_whole(s3, tmp_path):
    """No index.json for a conversion that wrote nothing (an earlier one's stays) or stopped part way (an earlier
    one's is gone, since its shards were being written over, and so is its held-out split's)."""
    remote = upload(s3, tmp_path, 'whole', n=4)
    client = boto3.client('s3', endpoint_url=s3)

    def index():
        return client.get_object(Bucket='bucket', Key='whole/mds/index.json')['Body'].read()

    def keys():
        return {item['Key'] for item in client.list_objects_v2(Bucket='bucket', Prefix='whole/mds')['Contents']}

    earlier = index()
    uncaptioned = write_uncaptioned(tmp_path / 'uncaptioned', 3)
    for target in (remote, 's3://bucket/whole/new'):
        with pytest.raises(convert.ConvertError, match='no samples written'):
            convert.convert([str(uncaptioned)], target, overwrite=True, progress=False)
    assert index() == earlier
    assert 'Contents' not in client.list_objects_v2(Bucket='bucket', Prefix='whole/new')
    stats = convert.convert([str(tmp_path / 'photos-whole')], remote, overwrite=True, validation_fraction=0.3)
    assert (stats['written'], stats['held_out']) == (2, 2)
    assert {'whole/mds/index.json', 'whole/mds/validation/index.json', 'whole/mds/validation/shard.00000.mds'} <= keys()

    def failing_part_way():
        for i in range(6):
            yield f'sample {i}', jpeg(i), f'caption {i}', None, False
        raise RuntimeError('the network went away')

    with pytest.raises(RuntimeError, match='the network went away'):
        convert.write_mds(failing_part_way(), remote, overwrite=True, size_limit=len(jpeg(0)), progress=False)
    assert 'whole/mds/shard.00000.mds' in keys()
    assert not {'whole/mds/index.json', 'whole/mds/validation/index.json'} & keys()


@pytest.mark.slow
def test_precompute_from_and_to_s3_reruns_and_trains(s3, tmp_path):
    remote = upload(s3, tmp_path, 'precompute', n=12)
    out = 's3://bucket/precompute/latents'
    flags = ['--remote', remote, '--out', out, '--model_name', 'tiny', '--image_size', '32', '--part_size', '8']
    assert precompute.main(flags) == {'encoded': 12, 'bad': 0, 'parts': 2, 'skipped_parts': 0}
    keys = {o['Key'] for o in boto3.client('s3', endpoint_url=s3).list_objects_v2(Bucket='bucket')['Contents']}
    assert {
        'precompute/latents/index.json',
        'precompute/latents/precompute.json',
        'precompute/latents/part-00000/index.json',
        'precompute/latents/part-00001/index.json',
    } <= keys
    # Finished parts are found on the remote: a rerun redoes nothing and merges the same index again.
    assert precompute.main(flags) == {'encoded': 0, 'bad': 0, 'parts': 2, 'skipped_parts': 2}
    with pytest.raises(ConfigError, match='made with other settings'):
        precompute.main([*flags, '--seed', '3'])
    trainer = main(
        settled(
            [
                '--model_name',
                'tiny',
                '--precomputed_latents',
                '--remote',
                out,
                '--batch_size',
                '4',
                '--max_duration',
                '1ep',
            ]
        )
    )
    assert int(trainer.state.timestamp.batch) == 3


@pytest.mark.slow
def test_remote_errors_name_the_remote_within_bounded_time(s3, tmp_path, monkeypatch):
    upload(s3, tmp_path, 'errors', n=4)
    with pytest.raises(DataError, match="s3://no-such-bucket/mds: bucket 'no-such-bucket' does not exist"):
        StreamingLAIONDataset(remote='s3://no-such-bucket/mds', batch_size=1)
    with pytest.raises(DataError, match='s3://bucket/errors/wrong: no index.json under this prefix'):
        StreamingLAIONDataset(remote='s3://bucket/errors/wrong', batch_size=1)
    down = f'http://127.0.0.1:{free_port()}'
    env = {**os.environ, 'S3_ENDPOINT_URL': down, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    run = run_process(
        [
            sys.executable,
            str(REPO / 'benchmark.py'),
            '--model_name',
            'tiny',
            '--remote',
            's3://bucket/errors/mds',
            '--batch_size',
            '4',
        ],
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f'error: s3://bucket/errors/mds: cannot reach the S3 server {down} after 3 attempts' in run.stderr
    assert 'Traceback' not in run.stderr


def shared_memory() -> set[str]:
    return set(os.listdir('/dev/shm')) if os.path.isdir('/dev/shm') else set()


@pytest.mark.slow
def test_a_killed_run_does_not_block_the_next(s3, tmp_path):
    """A job killed while streaming (the whole process group, as a scheduler does, so Python's resource
    tracker dies too) leaves Streaming's shared memory and a half-filled cache behind."""
    remote = upload(s3, tmp_path, 'killed')
    cache = tmp_path / 'cache'
    env = {**os.environ, 'PYTHONPATH': str(REPO), 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    victim = subprocess.Popen(
        [
            sys.executable,
            '-c',
            'import sys, time; from data import StreamingLAIONDataset; '
            f'd = StreamingLAIONDataset(remote="{remote}", local="{cache}", image_size=32, batch_size=4); '
            'next(iter(d)); print("streaming", d._shm_prefix_int, flush=True); time.sleep(600)',
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        started, prefix = victim.stdout.readline().split()
    finally:
        # Under the machine's prefix lock: no other job's cleaner removes the victim's segments before they are seen.
        with prefix_lock():
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            # The victim's segments alone, by the prefix Streaming names them with: another test's are not its.
            left_behind = {name for name in shared_memory() if name.startswith(f'{int(prefix):06}_')}
    assert started == 'streaming'
    assert (cache / 'index.json').is_file()
    results = tmp_path / 'results.json'
    run = run_process(
        [
            sys.executable,
            str(REPO / 'benchmark.py'),
            '--model_name',
            'tiny',
            '--remote',
            remote,
            '--local',
            str(cache),
            '--batch_size',
            '4',
            '--max_duration',
            '1ep',
            '--results_json',
            str(results),
        ],
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert left_behind or not os.path.isdir('/dev/shm'), 'the killed job should have left shared memory behind'
    for name in left_behind & shared_memory():  # the victim's, known dead: do not leak it past the test
        os.unlink(f'/dev/shm/{name}')
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(results.read_text())['img_per_sec'] > 0


def test_an_input_that_is_not_there_is_named_as_missing(tmp_path):
    with pytest.raises(convert.ConvertError, match=f'^{tmp_path}/nophotos: no such file or folder$'):
        convert.main([str(tmp_path / 'nophotos'), str(tmp_path / 'out')])
    (tmp_path / 'notes.txt').write_text('a file, not images')
    with pytest.raises(convert.ConvertError, match=r'notes.txt: not a \.tar or \.parquet file, or a folder$'):
        convert.main([str(tmp_path / 'notes.txt'), str(tmp_path / 'out')])
    assert not (tmp_path / 'out').exists()
