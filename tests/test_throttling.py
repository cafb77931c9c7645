"""A bucket that throttles (503 SlowDown) or blips (500, a reset) slows a run, and loses nothing: shard reads and
checkpoint uploads retry with backoff and jitter, bounded in attempts and time, and every retried read caches the
shard's own bytes; an error that persists, or one that is not transient, is not retried."""

import os
import subprocess
import sys

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError
from conftest import COLUMNS, REPO, good_samples, run_process, s3_client, write_dataset
from streaming import MDSWriter
from throttling_proxy import ThrottlingProxy
from torch.utils.data import DataLoader

from datapath.streaming_fixes import (
    THROTTLED_ATTEMPTS,
    THROTTLED_MAX_SLEEP,
    CheckedStreamingDataset,
    clean_stale_shared_memory,
    retry_throttled,
)
from settings.dataset_checks import SHARD_HASH


def client_error(status: int, code: str) -> ClientError:
    return ClientError({'Error': {'Code': code}, 'ResponseMetadata': {'HTTPStatusCode': status}}, 'GetObject')


def answers(*outcomes):
    """A call that raises or returns each outcome in turn, and the list of its calls."""
    calls, pending = [], list(outcomes)

    def call():
        calls.append(1)
        outcome = pending.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return call, calls


def test_throttling_and_transient_errors_are_retried_with_growing_random_waits():
    call, calls = answers(
        client_error(503, 'SlowDown'),
        client_error(500, 'InternalError'),
        ConnectionClosedError(endpoint_url='http://bucket'),
        client_error(429, 'TooManyRequests'),
        'shard',
    )
    waits = []
    assert retry_throttled(call, sleep=waits.append) == 'shard'
    assert len(calls) == 5 and len(waits) == 4
    assert all(0 <= wait <= min(THROTTLED_MAX_SLEEP, 0.25 * 2**attempt) for attempt, wait in enumerate(waits))
    assert len(set(waits)) == 4  # jittered: no two waits alike


def test_an_error_that_is_not_transient_is_raised_at_once():
    call, calls = answers(client_error(404, 'NoSuchKey'), 'never')
    with pytest.raises(ClientError, match='NoSuchKey'):
        retry_throttled(call, sleep=lambda _: pytest.fail('waited before a missing object'))
    assert len(calls) == 1


def test_throttling_that_persists_ends_after_bounded_attempts_and_time():
    call, calls = answers(*[client_error(503, 'SlowDown')] * (THROTTLED_ATTEMPTS + 1))
    waits = []
    with pytest.raises(ClientError, match='SlowDown'):
        retry_throttled(call, sleep=waits.append)
    assert len(calls) == THROTTLED_ATTEMPTS and sum(waits) < 16


@pytest.mark.parametrize(
    'throttling', [{'methods': ('GET',)}, {'every': 5}], ids=['each-first-get', 'every-fifth-request']
)
def test_two_loader_workers_through_a_slow_throttling_bucket_read_each_shards_own_bytes(s3, tmp_path, throttling):
    """A bucket answering 0.1 s late and throttling each object's first GET (or every fifth request), one epoch read
    by two loader workers. Before: the workers, forked after the index was downloaded, sent their requests on the
    main process's one connection and read each other's answers; a retried read no longer made a new client, and a
    shard was cached with another shard's bytes (`IndexError: Relative sample index 0 is not present`)."""
    samples = good_samples(48, size=(96, 64))
    with MDSWriter(out=str(tmp_path / 'mds'), columns=COLUMNS, size_limit=1 << 14, hashes=[SHARD_HASH]) as writer:
        for sample in samples:
            writer.write(sample)
    client = s3_client(s3)
    client.create_bucket(Bucket='slow')
    for path in (tmp_path / 'mds').iterdir():
        client.upload_file(str(path), 'slow', f'mds/{path.name}')
    proxy = ThrottlingProxy(s3, delay=0.1, **throttling)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        clean_stale_shared_memory()
        try:
            dataset = CheckedStreamingDataset(remote='s3://slow/mds', local=str(tmp_path / 'cache'), batch_size=4)
            read = list(DataLoader(dataset, batch_size=None, num_workers=2))
        finally:
            proxy.close()
    shards = len(list((tmp_path / 'mds').glob('*.mds')))
    index_connections = {port for port, method, path in proxy.requests if path.endswith('/index.json')}
    shard_connections = {port for port, method, path in proxy.requests if path.endswith('.mds')}
    assert index_connections and shard_connections and not index_connections & shard_connections
    assert proxy.throttled >= (shards if 'methods' in throttling else 2 * shards // 5)
    assert sorted((sample['caption'], sample['jpg']) for sample in read) == sorted(
        (sample['caption'], sample['jpg']) for sample in samples
    )
    for path in (tmp_path / 'mds').glob('*.mds'):
        assert (tmp_path / 'cache' / path.name).read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_a_run_through_a_throttling_bucket_reads_every_shard_and_uploads_every_checkpoint(s3, tmp_path):
    """Streaming's shards and Composer's checkpoint uploads through a proxy that answers the first try of every
    request with 503 SlowDown. Before: the process set AWS_MAX_ATTEMPTS=1 for Streaming's reads, which also took
    botocore's retries from Composer's uploads: no checkpoint reached the bucket."""
    folder = write_dataset(tmp_path / 'mds', good_samples(24), size_limit=1 << 14)
    client = s3_client(s3)
    for name in os.listdir(folder):
        client.upload_file(os.path.join(folder, name), 'bucket', f'throttled-mds/{name}')
    proxy = ThrottlingProxy(s3)
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--max_duration', '4ba']
    flags += ['--remote', 's3://bucket/throttled-mds', '--local', str(tmp_path / 'cache')]
    flags += ['--save_folder', 's3://bucket/throttled-ckpt', '--save_interval', '2ba', '--run_name', 't']
    env = {**os.environ, 'S3_ENDPOINT_URL': proxy.endpoint, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    try:
        run = run_process(
            [sys.executable, str(REPO / 'benchmark.py'), *flags],
            cwd=tmp_path,
            env=env,
            timeout=600,
        )
    finally:
        proxy.close()
    assert run.returncode == 0, run.stderr[-3000:]
    assert proxy.throttled > 10  # the index, every shard, every checkpoint part and the link were throttled once
    names = {item['Key'] for item in client.list_objects_v2(Bucket='bucket', Prefix='throttled-ckpt/')['Contents']}
    assert {'throttled-ckpt/ep0-ba2-rank0.pt', 'throttled-ckpt/ep0-ba4-rank0.pt'} <= names
    link = client.get_object(Bucket='bucket', Key='throttled-ckpt/latest-rank0.pt.symlink')['Body'].read().decode()
    assert link.strip() == 'throttled-ckpt/ep0-ba4-rank0.pt'


@pytest.mark.slow
def test_a_bucket_that_refuses_checkpoints_for_good_ends_in_one_line_and_loses_none(s3, tmp_path):
    """Every upload to the save folder answered 503 SlowDown, every retry too: the run ends in one line naming the
    file and the answer, keeps every checkpoint it could not upload (and the batch reached) on local disk, and once
    they are copied to the bucket --autoresume continues from the newest. Before: the worker's traceback, and the
    checkpoints deleted with Composer's staging folder."""
    proxy = ThrottlingProxy(s3, refuse='refused-ckpt')
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--use_synth_data', '--run_name', 'r']
    flags += ['--save_folder', 's3://bucket/refused-ckpt', '--save_interval', '2ba']
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}

    def run(endpoint: str, *more: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(REPO / 'benchmark.py'), *flags, *more]
        env['S3_ENDPOINT_URL'] = endpoint
        return run_process(command, cwd=tmp_path, env=env, timeout=600)

    env['AWS_MAX_ATTEMPTS'] = '2'  # fewer of botocore's retries (the proxy throttles every first try): quicker
    try:
        refused = run(proxy.endpoint, '--max_duration', '5ba')
    finally:
        proxy.close()
    assert refused.returncode == 1, refused.stderr[-3000:]
    kept = tmp_path / 'results' / 'not-uploaded' / 'r' / 'refused-ckpt'
    errors = [line for line in refused.stderr.splitlines() if line.startswith('error:')]
    assert errors == [refused.stderr.strip().splitlines()[-1]] and 'Traceback' not in refused.stderr, refused.stderr
    assert errors[0].startswith(
        'error: --save_folder s3://bucket/refused-ckpt: uploading refused-ckpt/ep0-ba2-rank0.pt failed after its '
        'retries (SlowDown: Please reduce your request rate.)'
    ) and errors[0].endswith(
        f'batch 5 is checkpointed in {kept}: copy its files to s3://bucket/refused-ckpt once it answers, then rerun '
        'the same command with --autoresume to continue'
    )
    assert sorted(path.name for path in kept.glob('ep*.pt')) == [f'ep0-ba{n}-rank0.pt' for n in (2, 4, 5)]
    client = s3_client(s3)
    assert 'Contents' not in client.list_objects_v2(Bucket='bucket', Prefix='refused-ckpt/')
    for path in kept.glob('ep*.pt'):
        client.upload_file(str(path), 'bucket', f'refused-ckpt/{path.name}')
    del env['AWS_MAX_ATTEMPTS']
    resumed = run(s3, '--max_duration', '6ba', '--autoresume')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed run 'r' from the latest in s3://bucket/refused-ckpt (batch 5 of 6)" in resumed.stdout
