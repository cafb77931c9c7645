"""Settings and helpers shared by the test suite.

Tests run offline: no hub, no W&B account. Tiers are pytest markers: `slow` (several processes, a local S3
server, long runs), `gpu` (CUDA only), and the rest, the fast tier. CUDA is hidden from every session but a gpu
one (`pytest -m gpu`, make test-gpu), so that the CPU defaults and checks under test are the ones that apply;
gpu tests are skipped where no GPU is visible.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

REPO = Path(__file__).resolve().parent.parent
# benchmark.py on the tiny model and random tensors: the base of most runs here.
TINY = ['--model_name', 'tiny', '--use_synth_data']
LAUNCHER = str(Path(sys.executable).parent / 'composer')  # Composer's launcher, from this environment


def pytest_configure(config):
    # Before any test module imports torch, which reads CUDA_VISIBLE_DEVICES when CUDA first initializes.
    if config.option.markexpr.strip() != 'gpu':
        os.environ['CUDA_VISIBLE_DEVICES'] = ''


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs a CUDA GPU: run make test-gpu on a machine with one')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@pytest.fixture(scope='module')
def s3():
    """A real S3-compatible server (moto) on 127.0.0.1 for the module that asks, with a bucket 'bucket'; the
    environment points boto3 and Streaming at it. Yields its endpoint."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p', str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f'http://127.0.0.1:{port}'
    env = {
        'S3_ENDPOINT_URL': endpoint,
        'AWS_ACCESS_KEY_ID': 'testing',
        'AWS_SECRET_ACCESS_KEY': 'testing',
        'AWS_DEFAULT_REGION': 'us-east-1',
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        deadline = time.monotonic() + 60
        while True:
            try:
                import boto3

                boto3.client('s3', endpoint_url=endpoint).create_bucket(Bucket='bucket')
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    server.kill()
                    raise RuntimeError('the moto S3 server did not start')
                time.sleep(0.3)
        yield endpoint
    server.terminate()
    server.wait(timeout=30)
