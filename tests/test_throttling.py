"""A bucket that throttles (503 SlowDown) or blips (500, a reset) slows a run, and loses nothing: shard reads and
checkpoint uploads retry with backoff and jitter, bounded in attempts and time; an error that persists, or one that
is not transient, is not retried."""

import os
import subprocess
import sys

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError
from conftest import REPO, good_samples, s3_client, write_dataset
from throttling_proxy import ThrottlingProxy

from datapath.streaming_fixes import THROTTLED_ATTEMPTS, THROTTLED_MAX_SLEEP, retry_throttled


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
        run = subprocess.run(
            [sys.executable, str(REPO / 'benchmark.py'), *flags],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
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
