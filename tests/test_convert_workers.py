"""convert.py --workers: each worker converts its share of the inputs into a part of the output, one index is
merged over the parts, and the result holds the samples one process writes, in its order, with the same skipped
samples named and the same held-out split; a killed worker or a signal stops the conversion in one line and leaves
the output as it was; training and precompute.py read what the workers wrote."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO, jpeg, settled
from test_convert import read_mds, write_tar
from test_data import RecordSamples
from tqdm import tqdm

import convert
import precompute
from datapath import convert_inputs, convert_workers
from datapath.mds_output import write_samples
from runs.run import main


@pytest.fixture
def small_slices(monkeypatch):
    """A folder shared out four images at a time, so that a few dozen images make several workers' shares."""
    monkeypatch.setattr(convert_inputs, 'FOLDER_SLICE', 4)


def write_folder(folder: Path, n: int, bad_every: int | None = 3) -> Path:
    """n captioned images, every bad_every-th one without a caption file (skipped, and named)."""
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f'{i:03}.jpg').write_bytes(jpeg(i, (24, 16)))
        if bad_every is None or i % bad_every:
            (folder / f'{i:03}.txt').write_text(f'photo {i}')
    return folder


def index_of(folder: Path) -> dict:
    return json.loads((folder / 'index.json').read_text())


@pytest.mark.parametrize('workers', [2, 3])
def test_workers_write_the_samples_one_process_writes(tmp_path, small_slices, workers):
    photos = write_folder(tmp_path / 'photos', 45)
    one = convert.convert([str(photos)], str(tmp_path / 'one'), validation_fraction=0.2, progress=False)
    many = convert.convert(
        [str(photos)], str(tmp_path / 'many'), validation_fraction=0.2, progress=False, workers=workers
    )
    for key in ('written', 'held_out', 'skipped', 'skipped_named'):
        assert many[key] == one[key], key
    assert one['skipped'] == {'no caption file': 15} and len(one['skipped_named']) == convert.SKIPPED_NAMED
    assert read_mds(tmp_path / 'many') == read_mds(tmp_path / 'one')  # the same bytes and captions, in order
    assert read_mds(tmp_path / 'many' / 'validation') == read_mds(tmp_path / 'one' / 'validation')
    parts = sorted(path.name for path in (tmp_path / 'many').glob('part-*'))
    assert parts == [f'part-{index:05}' for index in range(workers)]
    shards = index_of(tmp_path / 'many')['shards']
    assert [shard['raw_data']['basename'].split('/')[0] for shard in shards] == parts
    assert all(shard['raw_data']['hashes'].keys() == {'xxh64'} for shard in shards)  # shard hashes kept
    assert not (tmp_path / 'many' / convert.STAGING).exists()


@pytest.mark.parametrize('workers', ['0', '-2'])
def test_fewer_than_one_worker_is_refused(tmp_path, workers):
    photos = write_folder(tmp_path / 'photos', 2)
    with pytest.raises(convert.ConvertError, match=rf'^--workers {workers}: the number of processes converting'):
        convert.main([str(photos), str(tmp_path / 'out'), '--workers', workers])
    assert not (tmp_path / 'out').exists()


def test_tars_shared_out_give_the_samples_of_one_process(tmp_path):
    laion = tmp_path / 'laion'
    laion.mkdir()
    for number in range(4):
        members = []
        for key in range(5):
            sample = f'{number:03}{key:03}'
            members += [(f'{sample}.jpg', jpeg(number * 10 + key)), (f'{sample}.txt', f'tar {number} {key}'.encode())]
        write_tar(laion / f'{number:05}.tar', members, truncate=1500 if number == 2 else None)
    one = convert.convert([str(laion)], str(tmp_path / 'one'), progress=False)
    many = convert.convert([str(laion)], str(tmp_path / 'many'), progress=False, workers=2)
    assert many['skipped'] == one['skipped'] == {'unreadable tar (ReadError), rest of the file skipped': 1}
    assert many['written'] == one['written'] == 15  # the truncated tar's first member is cut
    assert read_mds(tmp_path / 'many') == read_mds(tmp_path / 'one')


def test_a_killed_worker_stops_the_conversion_and_leaves_the_output_as_it_was(tmp_path, small_slices, monkeypatch):
    photos = write_folder(tmp_path / 'photos', 16)
    out = tmp_path / 'out'
    convert.convert([str(photos)], str(out), progress=False)
    earlier = read_mds(out)
    read = convert_workers.piece_samples

    def killed_on_its_last_piece(piece, reading):
        if piece.images and piece.images[-1].name == '015.jpg':  # the second worker's share
            os.kill(os.getpid(), signal.SIGKILL)
        return read(piece, reading)

    monkeypatch.setattr(convert_workers, 'piece_samples', killed_on_its_last_piece)
    with pytest.raises(convert.ConversionStopped) as stopped:
        convert.convert([str(photos)], str(out), overwrite=True, progress=False, workers=2)
    assert str(stopped.value).startswith('conversion worker 2 of 2 (pid ')
    assert str(stopped.value).endswith(
        f'was killed by SIGKILL before it was done: conversion stopped; {out} is left as it was'
    )
    assert read_mds(out) == earlier and sorted(path.name for path in out.iterdir()) == ['index.json', 'shard.00000.mds']
    with pytest.raises(convert.ConversionStopped):
        convert.convert([str(photos)], str(tmp_path / 'new'), progress=False, workers=2)
    assert not (tmp_path / 'new').exists()


def test_workers_convert_while_another_thread_holds_the_progress_bars_lock():
    """The main process's progress bar and its monitor thread take tqdm's lock, a thread lock and a semaphore across
    processes. A worker forked while another thread held it, taking it, would wait for that semaphore and then for
    ever on its copy of the thread lock, holding the semaphore the main process's bar then waits on: workers take
    no lock of tqdm's."""
    taken, release = threading.Event(), threading.Event()

    def hold_the_bars_lock():
        with tqdm.get_lock():
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold_the_bars_lock)
    holder.start()
    taken.wait()
    skipped = ('a.jpg', None, None, 'no caption file', False)
    results = []

    def convert_shares():
        def convert_share(index, share, counts):
            return write_samples(None, None, share, None, False, None)

        results.extend(convert_workers.run_workers(convert_share, [[skipped], [skipped]], lambda done: None))

    others = set(multiprocessing.active_children())  # this test process's from other tests
    runner = threading.Thread(target=convert_shares)
    try:
        runner.start()
        runner.join(120)  # a hang guard: the two workers convert one sample each
        hung = runner.is_alive()
    finally:
        release.set()
        holder.join()
    if hung:
        for child in set(multiprocessing.active_children()) - others:
            child.kill()
        runner.join()
    assert not hung, "the workers waited on the progress bar's lock"
    share = {
        'written': 0,
        'held_out': 0,
        'skipped': {'no caption file': 1},
        'skipped_named': [skipped[:1] + skipped[3:4]],
    }
    assert results == [share, share]


def test_a_worker_that_does_not_end_on_sigterm_is_killed_as_the_conversion_stops(monkeypatch):
    """A worker blocks SIGTERM, and ends on its parent's from a thread of its own: one stuck before that thread
    runs is killed, and the main process's stop is not held up by it."""
    monkeypatch.setattr(
        convert_workers, 'leave_signals_to_parent', lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    )
    monkeypatch.setattr(convert_workers, 'TERMINATE_WAIT_S', 0.5)
    started = multiprocessing.get_context('fork').Event()

    def stuck(index, share, counts):
        started.set()
        threading.Event().wait()

    def stopped_once_started(done):
        if started.is_set():
            raise KeyboardInterrupt

    others = set(multiprocessing.active_children())  # this test process's from other tests
    with pytest.raises(KeyboardInterrupt):
        convert_workers.run_workers(stuck, [['a'], ['b']], stopped_once_started)
    assert set(multiprocessing.active_children()) <= others


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_worker_in_one_line(tmp_path, signum):
    """A worker blocked reading a tar that is a named pipe: the conversion is under way until the test says. Ctrl-C
    reaches the whole group; SIGTERM the main process alone."""
    laion = tmp_path / 'laion'
    laion.mkdir()
    for number in range(2):
        write_tar(laion / f'{number:05}.tar', [(f'{number}.jpg', jpeg(number)), (f'{number}.txt', b'a caption')])
    os.mkfifo(laion / '00002.tar')
    out = tmp_path / 'out'
    write_folder(tmp_path / 'photos', 3, bad_every=None)
    convert.convert([str(tmp_path / 'photos')], str(out), progress=False)
    earlier = read_mds(out)
    command = [sys.executable, str(REPO / 'convert.py'), str(laion), str(out), '--overwrite', '--workers', '2']
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with open(laion / '00002.tar', 'wb'):  # opens once a worker opens the pipe to read it
        if signum == signal.SIGINT:
            os.killpg(run.pid, signum)
        else:
            run.send_signal(signum)
        stderr = run.stderr.read()
    assert run.wait(timeout=120) == 128 + signum
    name = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else 'SIGTERM'
    lines = [line for line in stderr.splitlines() if line.strip() and 'converting' not in line]
    assert lines == [f'error: {name}: conversion stopped; {out} is left as it was (nothing of this conversion kept)']
    assert read_mds(out) == earlier and not (out / convert.STAGING).exists()


def test_training_and_precompute_read_what_the_workers_wrote(tmp_path, small_slices):
    photos = write_folder(tmp_path / 'photos', 18, bad_every=None)
    out = tmp_path / 'mds'
    assert convert.convert([str(photos)], str(out), progress=False, workers=2)['written'] == 18
    assert len(index_of(out)['shards']) == 2
    record = RecordSamples()
    flags = ['--model_name', 'tiny', '--local', str(out), '--image_size', '32', '--batch_size', '3']
    trainer = main(settled([*flags, '--max_duration', '1ep']), (record,))
    assert int(trainer.state.timestamp.batch) == 6
    assert sorted(i for batch in record.batches for i in batch) == list(range(18))
    latents = ['--local', str(out), '--out', str(tmp_path / 'latents'), '--model_name', 'tiny', '--image_size', '32']
    assert precompute.main(latents)['encoded'] == 18


@pytest.mark.slow
def test_workers_upload_their_parts_and_one_merged_index_to_s3(s3, tmp_path, small_slices):
    import boto3
    from streaming import StreamingDataset

    photos = write_folder(tmp_path / 'photos', 30)
    remote = 's3://bucket/workers/mds'
    stats = convert.convert([str(photos)], remote, progress=False, workers=2, validation_fraction=0.5)
    one = convert.convert([str(photos)], str(tmp_path / 'one'), progress=False, validation_fraction=0.5)
    assert (stats['written'], stats['held_out']) == (one['written'], one['held_out']) and one['held_out'], one
    keys = {item['Key'] for item in boto3.client('s3', endpoint_url=s3).list_objects_v2(Bucket='bucket')['Contents']}
    assert {'workers/mds/index.json', 'workers/mds/validation/index.json', 'workers/mds/part-00000/index.json'} <= keys
    assert 'workers/mds/part-00001/shard.00000.mds' in keys

    def samples(remote_folder: str, local: Path) -> list:
        dataset = StreamingDataset(remote=remote_folder, local=str(local), batch_size=1, shuffle=False)
        return [(dataset[i]['jpg'], dataset[i]['caption']) for i in range(dataset.num_samples)]

    assert samples(remote, tmp_path / 'cache') == read_mds(tmp_path / 'one')
    assert samples(f'{remote}/validation', tmp_path / 'split-cache') == read_mds(tmp_path / 'one' / 'validation')
    with pytest.raises(convert.ConvertError, match='is not empty; pass --overwrite'):
        convert.convert([str(photos)], remote, progress=False, workers=2)
