"""Faults end a run with one line naming the cause and a non-zero status, never with a silent exit 0: damaged
datasets (missing or truncated shards, wrong counts, a broken index), runs that trained less than asked, and
bad input to every script, refused before any work."""

import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from boto3.s3.transfer import TransferConfig
from composer import Callback
from conftest import (
    REPO,
    S3_CREDENTIALS,
    TINY,
    fake_gpu,
    final_weights,
    free_port,
    good_samples,
    jpeg,
    run_cli,
    run_process,
    s3_client,
    settled,
    start_process,
    start_s3_server,
    write_dataset,
)
from streaming.base.storage.download import CloudDownloader

import convert
import generate
import mcloud
import precompute
import report
from data import StreamingLAIONDataset
from datapath.streaming_fixes import S3DownloaderOneTransferAttempt
from guards.arguments import ConfigError
from runs.interrupts import StopOnSignal, Stopped
from runs.run import IncompleteRun, main
from settings import dataset_checks, output_paths
from settings.config import resolve_config
from settings.dataset_checks import DataError
from settings.flags import parse_args

# The tiny model on real images: 24 samples in shards of a few samples each, batches of 4.
REAL_DATA = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '1ep']


@pytest.fixture
def dataset(tmp_path) -> Path:
    folder = Path(write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 12))
    assert len(json.loads((folder / 'index.json').read_text())['shards']) > 3
    return folder


def shard(dataset: Path, number: int) -> tuple[dict, Path]:
    index = json.loads((dataset / 'index.json').read_text())
    entry = index['shards'][number]
    return entry, dataset / entry['raw_data']['basename']


def set_samples(dataset: Path, number: int, samples: int) -> None:
    index = json.loads((dataset / 'index.json').read_text())
    index['shards'][number]['samples'] = samples
    (dataset / 'index.json').write_text(json.dumps(index))


def damaged(dataset: Path, how: str) -> str:
    """Damages the dataset one way; returns what the error must say."""
    entry, path = shard(dataset, 2)
    name = entry['raw_data']['basename']
    if how == 'deleted shard':
        path.unlink()
        return f'shard {name} is missing'
    if how == 'truncated shard':
        path.write_bytes(path.read_bytes()[: entry['raw_data']['bytes'] // 2])
        return f'shard {name} has {entry["raw_data"]["bytes"] // 2} bytes where index.json says'
    if how == 'count too high':
        set_samples(dataset, 2, entry['samples'] + 5)
        return f'shard {name} holds {entry["samples"]} samples where index.json says {entry["samples"] + 5}'
    if how == 'count too low':
        set_samples(dataset, 2, entry['samples'] - 1)
        return f'shard {name} holds {entry["samples"]} samples where index.json says {entry["samples"] - 1}'
    if how == 'invalid index':
        (dataset / 'index.json').write_text('{"version": 2, "shards": [')
        return 'index.json is not a Streaming index'
    raise ValueError(how)


@pytest.mark.parametrize(
    'how', ['deleted shard', 'truncated shard', 'count too high', 'count too low', 'invalid index']
)
def test_a_damaged_dataset_is_named_before_anything_is_built(dataset, how):
    message = damaged(dataset, how)
    with pytest.raises(ConfigError, match=f'^{dataset}: {message}'):
        resolve_config(parse_args([*REAL_DATA, '--local', str(dataset)]))


def test_precompute_names_a_damaged_dataset_before_encoding(dataset, tmp_path):
    message = damaged(dataset, 'truncated shard')
    with pytest.raises(ConfigError, match=f'^{dataset}: {message}'):
        precompute.main(['--local', str(dataset), '--out', str(tmp_path / 'latents'), '--model_name', 'tiny'])
    assert not (tmp_path / 'latents').exists()


@pytest.mark.slow
def test_a_damaged_dataset_ends_the_command_with_one_line(dataset, tmp_path):
    message = damaged(dataset, 'deleted shard')
    results = tmp_path / 'results.json'
    run = run_cli(*REAL_DATA, '--local', str(dataset), '--results_json', str(results), launcher=('python',))
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip() == f'error: {dataset}: {message} (index.json lists it)'
    assert not results.exists()


def test_a_run_that_trains_less_than_asked_fails_and_writes_no_results(dataset, tmp_path):
    results = tmp_path / 'results.json'
    config = resolve_config(parse_args([*REAL_DATA, '--local', str(dataset), '--results_json', str(results)]))
    assert config.batch.num_batches == 6  # 24 samples in batches of 4
    # As when a loader runs dry early: Composer ends the epoch after the batches it got, and counts it done.
    with pytest.raises(IncompleteRun, match=r'training stopped after 6 of the 9 batches of --max_duration 1ep'):
        main(dataclasses.replace(config, batch=dataclasses.replace(config.batch, num_batches=9)))
    assert not results.exists()


def test_synthetic_and_sample_counts_are_whole_runs():
    assert resolve_config(parse_args([*TINY, '--batch_size', '4', '--max_duration', '10sp'])).batch.num_batches == 3


# ----------------------------------------------------------------------------------------------- bad input


def test_a_tokenizer_folder_without_a_tokenizer_is_refused_at_start(tmp_path, dataset):
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ConfigError, match=f'--tokenizer {tmp_path}/empty: no tokenizer Transformers can load'):
        resolve_config(parse_args([*REAL_DATA, '--local', str(dataset), '--tokenizer', str(tmp_path / 'empty')]))


def test_a_model_folder_with_a_broken_config_is_named(tmp_path):
    shutil.copytree(REPO / 'configs' / 'tiny', tmp_path / 'model')
    (tmp_path / 'model' / 'unet' / 'config.json').write_text('{"in_channels": 4,')
    with pytest.raises(ConfigError, match=f'{tmp_path}/model/unet/config.json is not valid JSON'):
        resolve_config(parse_args(['--model_name', str(tmp_path / 'model'), '--use_synth_data']))


def test_convert_follows_linked_folders_counts_loops_and_broken_links(tmp_path):
    photos = tmp_path / 'photos'
    (photos / 'real').mkdir(parents=True)
    for i, folder in enumerate([photos, photos / 'real']):
        (folder / f'{i}.jpg').write_bytes(jpeg(i))
        (folder / f'{i}.txt').write_text(f'photo {i}')
    (tmp_path / 'elsewhere').mkdir()
    (tmp_path / 'elsewhere' / '9.jpg').write_bytes(jpeg(9))
    (tmp_path / 'elsewhere' / '9.txt').write_text('photo 9')
    (photos / 'linked').symlink_to(tmp_path / 'elsewhere')  # followed
    (photos / 'real' / 'loop').symlink_to(photos)  # back up the tree: left out, counted
    (photos / 'gone.jpg').symlink_to(tmp_path / 'deleted.jpg')  # dangling
    (photos / 'gone.txt').write_text('a photo that is not there')
    stats = convert.convert([str(photos)], str(tmp_path / 'out'), progress=False)
    assert stats['written'] == 3
    assert stats['skipped'] == {'broken link': 1, 'linked folder already read (a loop or a second link)': 1}


def test_convert_refuses_an_output_that_is_a_file(tmp_path):
    (tmp_path / 'photos').mkdir()
    (tmp_path / 'out').write_text('a file')
    with pytest.raises(convert.ConvertError, match=f'{tmp_path}/out: is a file; give a folder'):
        convert.convert([str(tmp_path / 'photos')], str(tmp_path / 'out'), progress=False)
    assert (tmp_path / 'out').read_text() == 'a file'


def test_report_refuses_an_output_under_a_file_before_any_work(tmp_path):
    (tmp_path / 'a-file').write_text('a file')
    args = report.parse_args(['--throughput', '8=128.2', '--csv', str(tmp_path / 'a-file' / 'report.csv')])
    with pytest.raises(report.ReportError, match=f'--csv {tmp_path}/a-file/report.csv: cannot make its folder'):
        report.main(args)


# ----------------------------------------------------------------------------------------------- checkpoints

CHECKPOINTED = [*TINY, '--image_size', '32', '--batch_size', '4', '--save_interval', '2ba', '--run_name', 'run']


def checkpointed_run(folder: Path, batches: int, *flags):
    return main(settled([*CHECKPOINTED, '--save_folder', str(folder), '--max_duration', f'{batches}ba', *flags]))


@pytest.mark.slow
@pytest.mark.parametrize('damage', ['partial newer file', 'truncated latest'])
def test_a_checkpoint_cut_short_by_a_kill_never_blocks_autoresume(tmp_path, damage, capfd):
    """Killed while writing a checkpoint: the partial file is set aside, the run resumes from the newest complete
    checkpoint, and ends bitwise where an uninterrupted run does."""
    expected = final_weights(checkpointed_run(tmp_path / 'straight', 6))
    folder = tmp_path / 'killed'
    checkpointed_run(folder, 4)  # checkpoints of batches 2 and 4, 'latest' linking batch 4
    batch4 = folder / 'ep0-ba4-rank0.pt'
    if damage == 'partial newer file':  # killed while writing batch 6's, before the link moved
        (folder / 'ep0-ba6-rank0.pt').write_bytes(batch4.read_bytes()[: batch4.stat().st_size // 2])
        partial, resumes_from = 'ep0-ba6-rank0.pt', 'ep0-ba4-rank0.pt'
    else:  # the file 'latest' links is cut short
        batch4.write_bytes(batch4.read_bytes()[: batch4.stat().st_size // 2])
        partial, resumes_from = 'ep0-ba4-rank0.pt', 'ep0-ba2-rank0.pt'
    capfd.readouterr()
    trainer = checkpointed_run(folder, 6, '--autoresume')
    out = capfd.readouterr().out
    assert f'warning: {folder / partial}: an incomplete checkpoint' in out
    assert (folder / f'{partial}.incomplete').is_file()
    assert (folder / 'latest-rank0.pt').resolve().name == 'ep0-ba6-rank0.pt'  # the resumed run's own last one
    if damage == 'truncated latest':
        assert f'now links the newest complete checkpoint {resumes_from} (it linked {partial}, incomplete)' in out
    weights = final_weights(trainer)
    assert [name for name in expected if not torch.equal(weights[name], expected[name])] == []


# ----------------------------------------------------------------------------------------------- remotes


@pytest.fixture
def hung_server():
    """An S3 endpoint that accepts connections and never answers; yields its URL."""
    listener = socket.create_server(('127.0.0.1', 0))
    accepted, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # held open, never read from or written to
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f'http://127.0.0.1:{listener.getsockname()[1]}'
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()
    listener.close()


def test_a_hung_server_is_given_up_on_in_about_a_minute_by_default(monkeypatch):
    """The bound a hung or down server is reported within: each of 3 attempts waits at most 10 s to connect and
    20 s for data; S3_READ_TIMEOUT_SECONDS, read as a reader is made (not at import), sets the wait for data."""
    assert 'S3_READ_TIMEOUT_SECONDS' not in os.environ
    assert (dataset_checks.RETRIES + 1) * dataset_checks.read_timeout() == 60 and dataset_checks.CONNECT_TIMEOUT == 10
    monkeypatch.setenv('S3_READ_TIMEOUT_SECONDS', '2.5')
    assert dataset_checks.read_timeout() == 2.5 and dataset_checks.s3_client().meta.config.read_timeout == 2.5


@pytest.mark.slow
def test_a_hung_server_is_reported_once_its_read_timeouts_are_spent(hung_server):
    env = {'S3_ENDPOINT_URL': hung_server, 'AWS_ACCESS_KEY_ID': 'testing', 'AWS_SECRET_ACCESS_KEY': 'testing'}
    env['S3_READ_TIMEOUT_SECONDS'] = '2'  # the default's 20 s, waited out 3 times, would only slow the test
    run = run_cli(*REAL_DATA, '--remote', 's3://bucket/mds', launcher=('python',), env=env, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith(f'error: s3://bucket/mds: cannot reach the S3 server {hung_server} after 3 attempts')
    assert 'Read timeout' in run.stderr and 'Traceback' not in run.stderr


def run_probe_against_s3(tmp_path, endpoint, workers, env):
    """two_rank_probe.py on 400 samples in 200 shards uploaded to the S3 server at `endpoint`: its run; a hang guard of
    400 s, far above the seconds its reads' timeouts add up to."""
    folder = Path(write_dataset(tmp_path / 'mds', good_samples(400), size_limit=1 << 12))
    client = s3_client(endpoint)
    for path in folder.iterdir():
        client.upload_file(str(path), 'bucket', f'mds/{path.name}')
    env = {**os.environ, 'S3_ENDPOINT_URL': endpoint, **S3_CREDENTIALS, 'PROBE_DIR': str(tmp_path), **env}
    env.update({'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'})
    flags = [*REAL_DATA, '--batch_size', '8', '--remote', 's3://bucket/mds', '--num_workers', workers]
    return run_process(
        [sys.executable, str(REPO / 'tests' / 'two_rank_probe.py'), *flags, '--results_json', str(tmp_path / 'r')],
        env=env,
        timeout=400,
    )


@pytest.mark.slow
@pytest.mark.parametrize('workers', ['0', '2'])
def test_a_server_that_dies_mid_run_ends_it_with_one_line(tmp_path, workers):
    """400 samples in 200 shards on a real S3 server, killed when the first batch arrives: the run must end with
    the remote named, exit status 1 and no results, not run out its epoch early and exit 0."""
    server, endpoint = start_s3_server()
    try:
        run = run_probe_against_s3(tmp_path, endpoint, workers, {'PROBE_KILL_PID': str(server.pid)})
    finally:
        server.kill()
    assert run.returncode == 1, run.stderr[-3000:]
    assert 'error: s3://bucket/mds: reading shards failed: EndpointConnectionError' in run.stderr, run.stderr[-3000:]
    assert 'Traceback' not in run.stderr
    assert not (tmp_path / 'r').exists() and not (tmp_path / 'rank0.json').exists()


def test_a_read_failure_in_one_loader_worker_stops_the_others_with_the_same_line(tmp_path):
    """Loader workers and ranks on a node share the first failure: the run waits on the next worker's batch,
    not on the one that failed, and that worker must stop at its next read rather than fetch on its own."""
    folder = write_dataset(tmp_path / 'mds', good_samples(40), size_limit=1 << 12)
    worker = StreamingLAIONDataset(local=folder, image_size=32, batch_size=4)
    other_worker = pickle.loads(pickle.dumps(worker))  # as the loader hands the dataset to a spawned worker
    samples = iter(worker)
    next(samples)
    line = f'{folder}: reading shards failed: ReadTimeoutError: Read timeout on endpoint URL: "shard.00003.mds"'
    other_worker._record_failure(DataError(line))
    read = []
    with pytest.raises(DataError) as stopped:
        read.extend(samples)
    assert str(stopped.value) == line and len(read) <= 1  # at its next sample, not at the end of the epoch (39)
    with pytest.raises(DataError, match='reading shards failed'):  # nor does a new epoch start
        next(iter(worker))
    with pytest.raises(DataError, match='reading shards failed'):  # nor one more download
        worker.prepare_shard(5)


def test_s3_downloads_make_one_attempt_inside_each_of_streamings_tries(monkeypatch):
    """s3transfer would retry a download whose body stops arriving 5 times, and botocore a read that timed out 3
    times, in each of Streaming's 3 tries; the client's own setting, not AWS_MAX_ATTEMPTS for the whole process
    (which took the retries from Composer's checkpoint uploads too)."""
    import boto3.session

    calls, configs = [], []
    client = types.SimpleNamespace(download_file=lambda *args, **kwargs: calls.append((args, kwargs)))
    session = types.SimpleNamespace(client=lambda *args, config, **kwargs: configs.append(config) or client)
    monkeypatch.setattr(boto3.session, 'Session', lambda: session)
    monkeypatch.delenv('AWS_MAX_ATTEMPTS', raising=False)
    downloader = CloudDownloader.get('s3://bucket/mds')
    assert type(downloader) is S3DownloaderOneTransferAttempt
    downloader._create_s3_client(timeout=20)
    downloader._s3_client.download_file(
        'bucket', 'mds/shard.00000.mds', 'local', Config=TransferConfig(use_threads=False)
    )
    ((args, kwargs),) = calls
    assert args == ('bucket', 'mds/shard.00000.mds', 'local')
    assert kwargs['Config'].num_download_attempts == 1 and kwargs['Config'].use_threads is False
    assert configs[0].retries['total_max_attempts'] == 1 and configs[0].read_timeout == 20
    assert 'AWS_MAX_ATTEMPTS' not in os.environ


@pytest.mark.slow
def test_a_server_that_hangs_mid_run_ends_it_once_its_read_timeouts_are_spent(tmp_path):
    """The same, through a proxy that stops passing bytes when the first batch arrives: the server still
    accepts connections but never answers."""
    server, endpoint = start_s3_server()
    proxy = subprocess.Popen(
        [sys.executable, str(REPO / 'tests' / 'hanging_proxy.py'), endpoint.rsplit(':', 1)[1], str(tmp_path / 'hung')],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        proxied = f'http://127.0.0.1:{proxy.stdout.readline().strip()}'
        s3_client(proxied).list_objects_v2(Bucket='bucket')  # passes bytes until told to hang
        # Reads time out after 2 s (the default's 20 s, waited out once per try, would only slow the test).
        probe = {'PROBE_KILL_PID': str(proxy.pid), 'PROBE_SIGNAL': 'SIGUSR1', 'S3_READ_TIMEOUT_SECONDS': '2'}
        run = run_probe_against_s3(tmp_path, proxied, '2', probe)
    finally:
        proxy.kill()
        server.kill()
    assert run.returncode == 1, run.stderr[-3000:]
    assert 'error: s3://bucket/mds: reading shards failed: ' in run.stderr and 'timeout' in run.stderr.lower()
    assert 'Traceback' not in run.stderr and (tmp_path / 'hung').exists()
    assert not (tmp_path / 'r').exists()


# ----------------------------------------------------------------------------------------------- two jobs


@pytest.mark.skipif(not Path('/dev/shm').is_dir(), reason="Linux's shared memory folder")
def test_cleaning_shared_memory_leaves_a_live_jobs_alone():
    from multiprocessing import shared_memory

    from datapath.streaming_fixes import clean_stale_shared_memory

    # Prefixes of this process's own (as Streaming names segments: six digits), not another test's or machine-wide.
    live_prefix, stale_prefix = (f'{900000 + 2 * (os.getpid() % 49999) + k:06}' for k in (0, 1))
    live = shared_memory.SharedMemory(f'{live_prefix}_locals', create=True, size=64)  # mapped by this process
    # A live job's segment created a moment ago and not mapped yet: its prefix's _locals is mapped, so it stays.
    starting = Path(f'/dev/shm/{live_prefix}_barrier')
    starting.write_bytes(b'\0' * 64)
    stale = Path(f'/dev/shm/{stale_prefix}_locals')
    stale.write_bytes(b'\0' * 64)  # left by a killed run: mapped by no one
    try:
        clean_stale_shared_memory()
        assert Path(f'/dev/shm/{live_prefix}_locals').exists() and starting.exists() and not stale.exists()
    finally:
        live.close()
        live.unlink()
        for path in (starting, stale):
            path.unlink(missing_ok=True)


# benchmark.py that, once its first batch is trained, says so and waits for a file (sys.argv[1]) to appear.
PAUSED_AFTER_ITS_FIRST_BATCH = """
import pathlib, sys, time
from composer import Callback
from runs.run import main_reporting_errors
from settings.config import resolve_config
from settings.flags import parse_args

class Pause(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 1:
            print('trained batch 1', flush=True)
            while not pathlib.Path(sys.argv[1]).exists():
                time.sleep(0.05)

main_reporting_errors(resolve_config(parse_args(sys.argv[2:])), (Pause(),))
"""


@pytest.mark.slow
def test_two_jobs_on_one_machine_both_run_to_the_end(tmp_path):
    """A second job starting while the first trains, each on its own data: Streaming's cleaner removed the first
    job's shared memory, and the second could crash in it. The first waits after its first batch, its loader workers
    and shared memory live, until the second has trained a batch of its own."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    go_on, jobs = tmp_path / 'second-trained', []
    for name in ('first', 'second'):
        folder = write_dataset(tmp_path / name, good_samples(96), size_limit=1 << 14)
        flags = [*REAL_DATA, '--local', folder, '--num_workers', '2', '--results_json', str(tmp_path / f'{name}.json')]
        command = [sys.executable, '-c', PAUSED_AFTER_ITS_FIRST_BATCH, str(go_on), *flags]
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobs.append(job)
        assert any(line == 'trained batch 1\n' for line in iter(job.stdout.readline, '')), job.communicate()[1][-3000:]
    go_on.touch()
    assert jobs[0].poll() is None  # the first was training all along
    for job in jobs:
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
    assert (tmp_path / 'first.json').is_file() and (tmp_path / 'second.json').is_file()


@pytest.mark.slow
@pytest.mark.parametrize('when', ['training', 'writing a checkpoint'])
def test_a_run_killed_while_training_resumes_to_the_uninterrupted_weights(tmp_path, when):
    """SIGKILL to a run on MDS data with 2 loader workers once its first checkpoint is on disk (it may be writing
    the next one), or halfway through writing its second checkpoint: the resumed run sets aside the partial
    file, cleans the shared memory the dead one left, and ends bitwise where an uninterrupted run does."""
    folder = write_dataset(tmp_path / 'mds', good_samples(96), size_limit=1 << 14)
    flags = [*REAL_DATA, '--local', folder, '--num_workers', '2', '--max_duration', '1ep']  # 24 batches

    def probe(name, *extra, env=None):
        (tmp_path / name).mkdir()
        env = {
            **os.environ,
            'PROBE_DIR': str(tmp_path / name),
            'HF_HUB_OFFLINE': '1',
            'WANDB_MODE': 'offline',
            **(env or {}),
        }
        command = [sys.executable, str(REPO / 'tests' / 'two_rank_probe.py'), *flags, *extra]
        with open(tmp_path / name / 'output.log', 'w') as log:  # a file: a pipe left unread would fill and block
            return start_process(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def output(name):
        return (tmp_path / name / 'output.log').read_text()[-3000:]

    straight = probe('straight')
    assert straight.wait(timeout=300) == 0, output('straight')
    checkpoints = ['--save_folder', str(tmp_path / 'ckpt'), '--save_interval', '2ba', '--run_name', 'killed']
    if when == 'training':
        killed = probe('killed', *checkpoints)
        deadline = time.monotonic() + 120
        while not (tmp_path / 'ckpt' / 'latest-rank0.pt').exists():
            assert killed.poll() is None and time.monotonic() < deadline, 'no checkpoint was written'
            time.sleep(0.05)
        killed.kill()  # SIGKILL: no cleanup of any kind
    else:  # the process kills itself halfway through the file of batch 4
        killed = probe('killed', *checkpoints, env={'PROBE_KILL_IN_CHECKPOINT': '2'})
    assert killed.wait(timeout=300) == -signal.SIGKILL, output('killed')
    resumed = probe('resumed', *checkpoints, '--autoresume')
    assert resumed.wait(timeout=300) == 0, output('resumed')
    first, last = (json.loads((tmp_path / name / 'rank0.json').read_text()) for name in ('straight', 'resumed'))
    assert resumed.returncode == 0 and last['first_batch'] >= 2
    if when == 'writing a checkpoint':  # resumed from batch 2's, the last complete one
        assert last['first_batch'] == 2
        assert 'ep0-ba4-rank0.pt: an incomplete checkpoint' in (tmp_path / 'resumed' / 'output.log').read_text()
    assert last['batches'] == first['batches'][last['first_batch'] :]
    assert last['unet'] == first['unet']  # a digest of every UNet weight


@pytest.mark.slow
@pytest.mark.parametrize('workers, damage', [('0', 'DELETE'), ('2', 'DELETE'), ('2', 'TRUNCATE')])
def test_shards_deleted_or_cut_short_mid_run_end_it_with_one_line(tmp_path, workers, damage):
    folder = write_dataset(tmp_path / 'mds', good_samples(96), size_limit=1 << 12)
    env = {**os.environ, 'PROBE_DIR': str(tmp_path), f'PROBE_{damage}': f'{folder}/shard.*.mds'}
    env.update({'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'})
    flags = [*REAL_DATA, '--local', folder, '--num_workers', workers, '--results_json', str(tmp_path / 'r')]
    run = run_process(
        [sys.executable, str(REPO / 'tests' / 'two_rank_probe.py'), *flags],
        env=env,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    gone = r'shard shard\.\d+\.mds is gone or unreadable; it was whole at start'
    cut_short = r'reading shard shard\.\d+\.mds \(row \d+\) failed: IndexError: .* is not present in the'
    assert re.search(rf'error: {folder}: ({gone if damage == "DELETE" else cut_short})', run.stderr), run.stderr[-2000:]
    assert 'Traceback' not in run.stderr
    assert not (tmp_path / 'r').exists()


@pytest.mark.parametrize(
    'parse, flags',
    [
        (parse_args, ['--batch_size', 'abc']),
        (parse_args, ['--no_such_flag']),
        (parse_args, ['--attention', 'flash']),
        (precompute.parse_args, ['--part_size', 'x']),
        (report.parse_args, ['--price', 'x']),
        (generate.parse_args, ['--steps', 'x']),
        (convert.main, ['--bogus']),
        (mcloud.main, ['--bogus']),
    ],
    ids=lambda value: ' '.join(value) if isinstance(value, list) else value.__module__,
)
def test_flags_argparse_rejects_are_one_line(parse, flags, capsys):
    """argparse's own errors (a wrong type, an unknown flag, a bad choice) are one line pointing to --help, not
    the whole usage above it."""
    with pytest.raises(SystemExit) as stopped:
        parse(flags)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1 and err.rstrip().endswith('--help)'), err
    assert any(named in err for named in (flags[0], 'unrecognized arguments', 'arguments are required'))


def read_only(monkeypatch, root: Path) -> None:
    """Writing anywhere under `root` fails as on a read-only filesystem (permission bits cannot show it: the tests
    may run as root)."""
    real_mkdtemp = output_paths.tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(root):
            raise OSError(30, 'Read-only file system')
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(output_paths.tempfile, 'mkdtemp', mkdtemp)


@pytest.mark.parametrize(
    'flag, extra',
    [
        ('--save_folder', []),
        ('--results_json', []),
        ('--profile', ['--max_duration', '2ba']),
        ('--export_ema_unet', ['--use_ema']),
        ('--sample_dir', ['--sample_interval', '1ba']),
        ('--export_pipeline', []),
    ],
)
def test_an_unwritable_output_is_refused_before_training(tmp_path, monkeypatch, flag, extra):
    read_only(monkeypatch, tmp_path / 'ro')
    (tmp_path / 'ro').mkdir()
    target = str(tmp_path / 'ro' / ('out.json' if flag == '--results_json' else 'out'))
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args([*TINY, *extra, flag, target]))
    assert str(refused.value) == f'{flag} {target}: cannot write in {tmp_path / "ro"} (Read-only file system)'
    assert list((tmp_path / 'ro').iterdir()) == []
    resolve_config(parse_args([*TINY, *extra, flag, str(tmp_path / 'rw' / 'out')]))  # writable: accepted
    assert not (tmp_path / 'rw').exists()  # and nothing was made there


def test_a_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    # A full disk (or quota) still makes folders; only writing a file shows it.
    real_write_bytes = Path.write_bytes

    def write_bytes(path, data):
        if path.is_relative_to(tmp_path):
            raise OSError(28, 'No space left on device')
        return real_write_bytes(path, data)

    monkeypatch.setattr(Path, 'write_bytes', write_bytes)
    folder = tmp_path / 'ckpt'
    with pytest.raises(ConfigError) as refused:
        resolve_config(parse_args([*TINY, '--save_folder', str(folder)]))
    assert str(refused.value) == f'--save_folder {folder}: cannot write in {tmp_path} (No space left on device)'
    assert list(tmp_path.iterdir()) == []  # the scratch folder removed


@pytest.mark.slow
def test_a_save_folder_on_a_filesystem_that_refuses_writes_stops_the_run_at_start():
    try:
        os.mkdir('/sys/sd2-write-check')
    except OSError:
        pass
    else:
        os.rmdir('/sys/sd2-write-check')
        pytest.skip('/sys takes new folders here')
    run = run_cli(*TINY, '--save_folder', '/sys/sd2-checkpoints', launcher=('python',))
    assert run.returncode == 2
    assert run.stderr.startswith('error: --save_folder /sys/sd2-checkpoints: cannot write in /sys (')
    assert run.stderr.count('\n') == 1 and 'train ' not in run.stdout


def test_a_full_disk_at_the_results_file_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, capfd):
    import benchmark

    results = tmp_path / 'results.json'
    results.write_text('{"from": "an earlier run"}')
    real_write_text = Path.write_text

    def write_half_then_fail(path, text, *args, **kwargs):
        if path.name.endswith('.partial'):
            real_write_text(path, text[: len(text) // 2])
            raise OSError(28, 'No space left on device')
        return real_write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, 'write_text', write_half_then_fail)
    with pytest.raises(SystemExit) as stopped:
        benchmark.cli([*TINY, '--max_duration', '2ba', '--results_json', str(results)])
    assert stopped.value.code == 1
    err = capfd.readouterr().err.strip()  # after the progress bar, on its line
    assert err.endswith(
        f'error: {results}: No space left on device; nothing of it was written (an earlier file is as it was): free '
        'space there and run again'
    )
    assert err.count('error:') == 1
    assert results.read_text() == '{"from": "an earlier run"}'  # the earlier file kept whole
    assert sorted(path.name for path in tmp_path.iterdir()) == ['results.json']


class RunOutOfMemory(Callback):
    """A microbatch that does not fit, as the CUDA caching allocator reports it."""

    def before_backward(self, state, logger):
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity')


def test_a_microbatch_out_of_memory_is_one_line_with_a_smaller_one_to_try(tmp_path, capfd):
    import benchmark

    results = tmp_path / 'results.json'
    flags = ['--batch_size', '4', '--device_train_microbatch_size', '4', '--max_duration', '2ba']
    with pytest.raises(SystemExit) as stopped:
        benchmark.cli([*TINY, *flags, '--results_json', str(results)], callbacks=(RunOutOfMemory(),))
    assert stopped.value.code == 1
    err = capfd.readouterr().err.strip()  # after the progress bar, on its line
    assert err.endswith(
        'error: out of memory with microbatch 4 of tiny at 64px, allocating 2.00 GiB: pass '
        "--device_train_microbatch_size auto (Composer's search for one that fits) or --device_train_microbatch_size 2"
    )
    assert err.count('error:') == 1 and 'Traceback' not in err and not results.exists()


def test_out_of_memory_names_the_plan_and_the_peaks_on_a_gpu(monkeypatch):
    from runs.run import out_of_memory
    from settings import hardware

    h200 = hardware.Gpu('NVIDIA H200', 150_079_209_472, True, (9, 0))
    fake_gpu(monkeypatch, h200)
    config = resolve_config(parse_args(['--use_synth_data', '--precomputed_latents']))  # sd2-base, planned
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda: 139.04e9)
    monkeypatch.setattr(torch.cuda, 'max_memory_reserved', lambda: 148.21e9)
    line = out_of_memory(
        config.model,
        config.data,
        config.batch,
        torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0'),
    )
    assert line == (
        'out of GPU memory with microbatch 64 of sd2-base at 512px (planned: 13.9 GB state + 64 x 1.03 GB '
        'activations + 2.9 GB margin = 82.8 GB of 150.1 GB (90% usable)), allocating 1.50 GiB; peak 139.0 GB '
        "allocated, 148.2 GB reserved: pass --device_train_microbatch_size auto (Composer's search for one that "
        'fits) or --device_train_microbatch_size 32'
    )
    # Half of an odd microbatch: the largest below it that divides the device batch (9 of 27: 3, not 4).
    odd = dataclasses.replace(config.batch, device_train_microbatch_size=9, device_batch_size=27)
    assert out_of_memory(config.model, config.data, odd, torch.OutOfMemoryError('CUDA out of memory.')).endswith(
        'microbatch_size 3'
    )
    one = dataclasses.replace(config.batch, device_train_microbatch_size=1)
    assert out_of_memory(config.model, config.data, one, torch.OutOfMemoryError('CUDA out of memory.')).endswith(
        ': microbatch 1 is the smallest: pass --activation_checkpointing, or shard with --fsdp full_shard'
    )


def test_autoresume_of_a_finished_run_says_it_is_complete_and_exits_0(tmp_path, capfd):
    import benchmark

    flags = [*TINY, '--max_duration', '2ba', '--save_folder', str(tmp_path / 'ckpt'), '--run_name', 'r']
    benchmark.cli(flags)
    files = sorted((tmp_path / 'ckpt').iterdir())
    capfd.readouterr()
    results = tmp_path / 'again.json'
    trainer = benchmark.cli([*flags, '--autoresume', '--results_json', str(results)])  # returns: exit status 0
    out = capfd.readouterr().out
    complete = f"run 'r' is complete: its checkpoints in {tmp_path / 'ckpt'} hold all 2 batches of --max_duration 2ba"
    assert complete in out
    assert int(trainer.state.timestamp.batch) == 2 and sorted((tmp_path / 'ckpt').iterdir()) == files
    assert not results.exists()


def test_a_resumed_run_says_where_it_resumed_and_measures_the_batches_it_trained(tmp_path, capfd):
    """Resumed at batch 4 of 8: the line naming the checkpoint, a throughput of the 4 batches this process trained
    (the window sized for them), and, the output not being a terminal, plain progress lines without escapes."""
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--save_interval', '2ba', '--run_name', 'r']
    flags += ['--save_folder', str(tmp_path / 'ckpt')]
    main(settled([*flags, '--max_duration', '4ba']))
    capfd.readouterr()
    trainer = main(settled([*flags, '--max_duration', '8ba', '--autoresume']))
    captured = capfd.readouterr()
    out = captured.out.splitlines()
    assert "resumed run 'r' from ep0-ba4-rank0.pt (batch 4 of 8)" in out
    assert [line.split(':')[0] for line in out if line.startswith('batch ')] == [
        f'batch {b} of 8 ({100 * b // 8}%)' for b in (5, 6, 7, 8)
    ]
    assert out[-1].startswith('throughput: ') and 'img/s' in out[-1], out[-1]
    assert '\x1b[' not in captured.out + captured.err
    assert int(trainer.state.timestamp.batch) == 8
    threads = next(line for line in out if line.startswith('cpu threads: '))
    assert torch.get_num_threads() == int(threads.split()[2])


def test_the_cpu_thread_count_is_one_on_every_machine_unless_given(monkeypatch):
    """One count everywhere, so one command trains the same weights on any machine, busy or idle."""
    from settings import hardware

    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    for cores in (1, 2, 64):
        monkeypatch.setattr(hardware, 'process_cores', lambda cores=cores: cores)
        threads, given, why = hardware.cpu_threads()
        assert (threads, given) == (1, False) and why.startswith('the default on a CPU: the same weights')
        assert ('more may run faster' in why) == (cores > 1)
    monkeypatch.setenv('OMP_NUM_THREADS', '3')
    assert hardware.cpu_threads() == (3, True, 'OMP_NUM_THREADS=3')


def test_a_resumed_cpu_run_takes_its_checkpoints_thread_count_unless_one_is_given(monkeypatch, tmp_path):
    """Settled once, from the record beside the checkpoints --autoresume continues."""
    from settings.run_record import write_run_description

    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)  # else the count is given
    folder = tmp_path / 'ckpt'
    resuming = [*TINY, '--max_duration', '2ba', '--run_name', 'r', '--save_folder', str(folder), '--autoresume']
    chosen = resolve_config(parse_args(resuming))
    threads = chosen.data.cpu_threads  # a new folder: this process's own count
    assert not chosen.data.cpu_threads_given and not any('the checkpoint' in note for note in chosen.notes)
    folder.mkdir()
    write_run_description(folder, {'run_name': 'r', 'cpu_threads': threads + 1})
    resumed = resolve_config(parse_args(resuming))
    assert resumed.data.cpu_threads == threads + 1
    assert f"cpu threads: {threads + 1}, the checkpoint's (this process would choose {threads})" in resumed.notes[-1]
    given = resolve_config(parse_args([*resuming, '--cpu_threads', str(threads + 2)]))
    assert (
        given.data.cpu_threads == threads + 2
        and (
            f'warning: cpu threads: {threads + 2} given, where the checkpoint was trained with {threads + 1}: the '
            'continuation will not be bitwise what one uninterrupted run trains'
        )
        in given.notes
    )
    write_run_description(folder, {'run_name': 'r'})  # an older version's record: nothing to take
    assert resolve_config(parse_args(resuming)).data.cpu_threads == threads


@pytest.mark.stack
def test_export_pipeline_on_a_finished_run_exports_its_last_checkpoint(tmp_path, capfd):
    flags = [*TINY, '--image_size', '32', '--max_duration', '2ba', '--save_folder', str(tmp_path / 'ckpt')]
    flags += ['--run_name', 'r']
    trained = main(settled(flags))
    weights = {name: tensor.clone() for name, tensor in trained.state.model.denoiser.state_dict().items()}
    capfd.readouterr()
    main(settled([*flags, '--autoresume', '--export_pipeline', str(tmp_path / 'pipeline')]))
    out = capfd.readouterr().out
    assert 'is complete' in out and f'pipeline saved to {tmp_path / "pipeline"}' in out
    from diffusers import UNet2DConditionModel

    exported = UNet2DConditionModel.from_pretrained(tmp_path / 'pipeline' / 'unet').state_dict()
    assert [name for name in weights if not torch.equal(exported[name], weights[name])] == []


def test_a_second_signal_or_one_before_training_stops_at_once_naming_the_newest_checkpoint(tmp_path, capsys):
    folder = tmp_path / 'ckpt'
    config = resolve_config(
        parse_args([*TINY, '--save_folder', str(folder), '--run_name', 'r', '--max_duration', '9ba'])
    )
    folder.mkdir()
    (folder / 'ep0-ba5-rank0.pt').write_bytes(b'cut short')  # not a whole checkpoint: never named
    torch.save({'state': {}}, folder / 'ep0-ba4-rank0.pt')
    stopper = StopOnSignal(config.outputs, config.batch)
    with pytest.raises(Stopped, match=r'^SIGTERM: stopped before training started; nothing trained') as stopped:
        stopper.handle(signal.SIGTERM)
    assert stopped.value.exit_status == 143
    stopper.fit_start(types.SimpleNamespace(timestamp=types.SimpleNamespace(batch=6)), None)
    stopper.handle(signal.SIGINT)  # the first: after this batch
    assert stopper.requested == signal.SIGINT and 'stopping after this batch' in capsys.readouterr().out
    with pytest.raises(Stopped) as stopped:
        stopper.handle(signal.SIGINT)
    assert str(stopped.value) == (
        f'Ctrl-C (SIGINT): stopped at batch 6 of 9; the newest checkpoint is ep0-ba4-rank0.pt in {folder}; rerun the '
        'same command with --autoresume to continue'
    )
    assert stopped.value.exit_status == 130


def test_a_run_given_no_name_is_told_to_name_itself_and_resumes_under_the_name(tmp_path, capfd):
    folder = tmp_path / 'ckpt'
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--save_folder', str(folder)]
    settled_run = resolve_config(parse_args([*flags, '--max_duration', '2ba']))
    stopper = StopOnSignal(settled_run.outputs, settled_run.batch)
    main(settled([*flags, '--max_duration', '2ba']))
    stopper.fit_start(types.SimpleNamespace(timestamp=types.SimpleNamespace(batch=2)), None)
    with pytest.raises(Stopped, match='rerun the same command with --run_name NAME --autoresume to continue$'):
        stopper.handle(signal.SIGINT)  # one process with a --save_folder: the first signal waits for the batch
        stopper.handle(signal.SIGINT)
    capfd.readouterr()
    trainer = main(settled([*flags, '--max_duration', '3ba', '--run_name', 'named', '--autoresume']))
    assert int(trainer.state.timestamp.batch) == 3 and 'from ep0-ba2-rank0.pt (batch 2 of 3)' in capfd.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_in_one_line_with_a_checkpoint_of_the_batch_reached(tmp_path, signum, status):
    """Ctrl-C, or a preemption's SIGTERM: the batch in progress ends, its checkpoint is written and linked as the
    latest, and the run ends with one line and the signal's exit status."""
    folder = tmp_path / 'ckpt'
    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '400ba', '--save_interval', '100ba']
    command = [sys.executable, str(REPO / 'benchmark.py'), *flags, '--save_folder', str(folder), '--run_name', 'r']
    run = start_process(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in run.stdout:  # progress lines every 20 batches
        if line.startswith('batch 20 of 400'):
            break
    run.send_signal(signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == status, err[-2000:]
    checkpoint = (folder / 'latest-rank0.pt').resolve()
    reached = int(re.match(r'ep0-ba(\d+)-rank0\.pt', checkpoint.name).group(1))
    assert 20 <= reached < 400 and reached % 100  # the batch reached, not a periodic checkpoint
    name = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else 'SIGTERM'
    assert f'{name}: stopping after this batch, with a checkpoint' in out
    assert err.strip().splitlines()[-1] == (
        f'error: {name}: stopped at batch {reached} of 400; checkpoint {checkpoint.name} written in {folder}; rerun '
        'the same command with --autoresume to continue'
    )


@pytest.mark.parametrize(
    'changed, message',
    [
        (['--image_size', '32'], 'image_size 64 there, 32 here; pass its flags, or a new --save_folder'),
        (['--model_name', 'tiny-sd1.5'], "model_name 'tiny' there, 'tiny-sd1.5' here"),
        (['--run_name', 'other'], "run_name 'r' there, 'other' here"),
        (['--batch_size', '8'], 'batch_size 16 there, 8 here'),
    ],
)
def test_autoresume_over_another_runs_checkpoints_is_refused_in_one_line(tmp_path, changed, message):
    folder = tmp_path / 'ckpt'
    main(settled([*TINY, '--max_duration', '2ba', '--save_folder', str(folder), '--run_name', 'r']))
    files = sorted(folder.iterdir())
    resumed = [*TINY, '--max_duration', '4ba', '--save_folder', str(folder), '--run_name', 'r', '--autoresume']
    with pytest.raises(ConfigError) as refused:
        main(settled([*resumed, *changed]))  # the flag given last wins
    assert str(refused.value).startswith(
        f'--autoresume: the checkpoint {(folder / "ep0-ba2-rank0.pt")} is of another run: '
    )
    assert message in str(refused.value) and '\n' not in str(refused.value)
    assert sorted(folder.iterdir()) == files


def test_autoresume_over_checkpoints_without_a_description_compares_the_unet(tmp_path, monkeypatch):
    """Checkpoints written before runs described themselves: the UNet's shapes still tell another model apart."""
    from runs import checkpoints

    folder = tmp_path / 'ckpt'
    monkeypatch.setattr(checkpoints.RunDescription, 'state_dict', lambda self: {})
    monkeypatch.setattr(checkpoints, 'run_description', lambda config: {})
    main(settled([*TINY, '--max_duration', '2ba', '--save_folder', str(folder), '--run_name', 'r']))
    flags = ['--model_name', 'tiny-sdxl-base', '--use_synth_data', '--max_duration', '4ba']
    with pytest.raises(ConfigError, match=r'unet parameter\(s\) differ, e\.g\. .* there, .* here \(another model\?\)'):
        main(settled([*flags, '--save_folder', str(folder), '--run_name', 'r', '--autoresume']))


def run_with_checkpoint_writer(tmp_path, monkeypatch, write) -> tuple:
    """benchmark.py on the tiny model for 4 batches, a checkpoint every 2, Composer's checkpoint writer replaced by
    `write`: the run must end with exit status 1; returns its save folder and flags."""
    from composer.utils import checkpoint

    import benchmark

    monkeypatch.setattr(checkpoint, '_write_checkpoint_file', write)
    folder = tmp_path / 'ckpt'
    flags = [*TINY, '--max_duration', '4ba', '--save_folder', str(folder), '--run_name', 'r', '--save_interval', '2ba']
    with pytest.raises(SystemExit) as stopped:
        benchmark.cli(flags)
    assert stopped.value.code == 1
    return folder, flags


def test_a_checkpoint_that_does_not_fit_is_one_line_set_aside_and_resumed_from_the_one_before(
    tmp_path, monkeypatch, capfd
):
    """The disk fills during the second checkpoint: torch.save's zip writer fails as on a full disk, halfway."""
    import io

    import benchmark

    calls = []

    def write_half_then_fail(state_dict, filename):
        calls.append(filename)
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getvalue()
        Path(filename).write_bytes(data if len(calls) == 1 else data[: len(data) // 2])
        if len(calls) > 1:
            raise RuntimeError(
                '[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data/12: '
                'file write failed'
            )

    folder, flags = run_with_checkpoint_writer(tmp_path, monkeypatch, write_half_then_fail)
    err = capfd.readouterr().err.strip()
    assert err.endswith(' newest complete checkpoint, ep0-ba2-rank0.pt') and err.count('error:') == 1, err
    assert f'error: --save_folder {folder}: checkpoint ep0-ba4-rank0.pt did not fit (' in err
    assert 'file write failed; ' in err and ' GB free there); set aside' in err
    assert sorted(path.name for path in folder.iterdir()) == [
        'ep0-ba2-rank0.pt',
        'ep0-ba4-rank0.pt.incomplete',
        'latest-rank0.pt',
        'run_description.json',  # the run's record, written beside the whole one
    ]
    assert (folder / 'latest-rank0.pt').readlink().name == 'ep0-ba2-rank0.pt'
    monkeypatch.undo()  # the disk has room again
    trainer = benchmark.cli([*flags, '--autoresume'])
    assert int(trainer.state.timestamp.batch) == 4
    assert (folder / 'latest-rank0.pt').readlink().name == 'ep0-ba4-rank0.pt'


def test_a_save_folder_turned_read_only_mid_run_names_the_last_whole_checkpoint(tmp_path, monkeypatch, capfd):
    """The folder refuses the second checkpoint (a filesystem remounted read-only): one line saying so, naming
    the newest whole checkpoint, and no partial file claimed; once writable, --autoresume goes on from it."""
    from composer.utils import checkpoint

    import benchmark

    write = checkpoint._write_checkpoint_file

    def refuse_after_the_first(state_dict, filename):
        if any(Path(filename).parent.glob('ep*-rank0.pt')):
            raise OSError(30, 'Read-only file system', filename)
        write(state_dict, filename)

    folder, flags = run_with_checkpoint_writer(tmp_path, monkeypatch, refuse_after_the_first)
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f'error: --save_folder {folder}: checkpoint ep0-ba4-rank0.pt could not be written (Read-only file system); '
        'nothing of it was left, and --autoresume continues from the newest complete checkpoint, ep0-ba2-rank0.pt'
    )
    assert sorted(path.name for path in folder.iterdir()) == [
        'ep0-ba2-rank0.pt',
        'latest-rank0.pt',
        'run_description.json',
    ]
    monkeypatch.undo()  # writable again
    assert int(benchmark.cli([*flags, '--autoresume']).state.timestamp.batch) == 4


@pytest.mark.slow
def test_two_jobs_starting_together_each_get_their_own_shared_memory(tmp_path, dataset, monkeypatch):
    """Two datasets built at the same moment (two jobs of a sweep): each search for a free shared-memory prefix
    waits, once done, for the other job's to begin, so that both search before either registers, as when two
    processes start together; where the search is locked (streaming_fixes), the other job waits for the lock
    instead, and the first goes on once it does. Events, not a timeout: under any load, without the lock the two
    searches overlap."""
    from streaming.base.shared import prefix

    from datapath import streaming_fixes

    find, wait_for_lock = prefix._check_and_find_retrying, streaming_fixes.wait_for_lock
    searching, waiting = set(), set()
    both = threading.Condition()

    def find_slowly(*args, **kwargs):
        with both:
            searching.add(threading.get_ident())
            both.notify_all()
        found = find(*args, **kwargs)
        with both:  # the hang guard only stops a broken test from hanging; it is never reached
            others = lambda: (searching | waiting) - {threading.get_ident()}  # noqa: E731
            assert both.wait_for(others, timeout=300), 'the other job neither searched nor waited for the lock'
        return found

    def wait_for_lock_noted(*args, **kwargs):
        with both:
            waiting.add(threading.get_ident())
            both.notify_all()
        return wait_for_lock(*args, **kwargs)

    monkeypatch.setattr(prefix, '_check_and_find_retrying', find_slowly)
    monkeypatch.setattr(streaming_fixes, 'wait_for_lock', wait_for_lock_noted)
    copies = [shutil.copytree(dataset, tmp_path / f'job{i}') for i in range(2)]
    built, errors = [None, None], []

    def build(i):
        try:
            built[i] = StreamingLAIONDataset(local=str(copies[i]), image_size=32, batch_size=4)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert built[0]._shm_prefix_int != built[1]._shm_prefix_int
    assert len(built[0]) == len(built[1]) == 24


def test_a_job_stuck_holding_the_prefix_lock_is_named_not_waited_on_forever(tmp_path):
    import fcntl

    from datapath import streaming_fixes

    path = tmp_path / 'prefix.lock'
    holder, waiter = os.open(path, os.O_RDONLY | os.O_CREAT), os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open of the file: another job, as flock sees it
        with pytest.raises(DataError, match=rf'^{re.escape(str(path))}: another job on this machine has held'):
            streaming_fixes.wait_for_lock(waiter, path, seconds=0.3)
        os.close(holder)  # that job ends: the lock is taken at once
        holder = None
        streaming_fixes.wait_for_lock(waiter, path, seconds=0.3)
        holder = os.open(path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # held now by the waiter
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(waiter)
        if holder is not None:
            os.close(holder)


@pytest.mark.parametrize('credentials', [False, True])
def test_a_bucket_read_without_credentials_says_so_and_how_to_give_them(monkeypatch, tmp_path, credentials):
    """No AWS credentials: the check falls back to unsigned requests, as Streaming does for a public bucket. Before,
    a failure said only `cannot reach the S3 server ... after 1 attempts`, not that no credentials were found."""
    for name in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_SESSION_TOKEN', 'AWS_PROFILE'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('AWS_SHARED_CREDENTIALS_FILE', str(tmp_path / 'none'))
    monkeypatch.setenv('AWS_CONFIG_FILE', str(tmp_path / 'none'))
    monkeypatch.setenv('AWS_EC2_METADATA_DISABLED', 'true')  # no instance role to ask for
    if credentials:
        monkeypatch.setenv('AWS_ACCESS_KEY_ID', 'testing')
        monkeypatch.setenv('AWS_SECRET_ACCESS_KEY', 'testing')
    monkeypatch.setenv('S3_ENDPOINT_URL', f'http://127.0.0.1:{free_port()}')  # claimed, and nothing listens there
    with pytest.raises(DataError, match='^s3://bucket/mds: cannot reach the S3 server') as error:
        dataset_checks.check_dataset('s3://bucket/mds', None, retries=0, timeout=2)
    said = str(error.value).endswith(dataset_checks.NO_CREDENTIALS)
    assert said != credentials and 'AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY' in dataset_checks.NO_CREDENTIALS


def test_an_epoch_that_drops_a_partial_batch_says_how_many_samples_it_leaves_out(tmp_path):
    """21 samples in batches of 8: an epoch is 2 batches, and 5 samples are not trained on in it; it used to pass
    without a word. An epoch of whole batches says nothing."""
    data = write_dataset(tmp_path / 'mds', good_samples(21), size_limit=1 << 14)
    run = ['--model_name', 'tiny', '--image_size', '32', '--local', data, '--max_duration', '1ep']
    dropped = settled([*run, '--batch_size', '8'])
    assert dropped.batch.num_batches == 2
    assert (
        f'--max_duration 1ep: an epoch of {data} is 2 batch(es) of 8 per device: 5 of its 21 samples per device are '
        'left out of each epoch (the loader drops a partial batch; shuffled, other samples each epoch)' in dropped.notes
    )
    whole = settled([*run, '--batch_size', '7'])
    assert whole.batch.num_batches == 3 and not any('left out of each epoch' in note for note in whole.notes)
