"""A page's commands run as a user pastes them: in the page's order, in a copy of the repo (on a CPU, the tiny
model by default), on the files a user would have (the data page: a folder of photos with captions, one with a
metadata.jsonl), each ending with exit status 0. The commands that need what this machine lacks (S3, a GPU, a
cluster) are left out, and the measurement scripts of benchmarks/, which take as long as they measure (the
loader's: 75 s here); test_docs_commands parses those. The pages whose commands read a user's own files (a
checkpoint, results files) or run make (which could reinstall the shared environment) are not run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, jpeg
from test_docs_commands import shell_commands
from test_gpu_campaign import files_that_travel

# What a command needs that no CPU machine here has: it is not run.
ELSEWHERE = ('s3://', '/nvme/', '--fsdp', 'sbatch', 'kubectl', 'sky ', 'mcli ', 'docker ', 'benchmarks/')


def user_files(tree, count: int = 40) -> None:
    """photos/ with a same-name caption file per image; my_images/ with its captions in metadata.jsonl."""
    for folder in ('photos', 'my_images'):
        (tree / folder).mkdir()
    rows = []
    for i in range(count):
        (tree / 'photos' / f'{i:04d}.jpg').write_bytes(jpeg(i))
        (tree / 'photos' / f'{i:04d}.txt').write_text(f'photo number {i}')
        (tree / 'my_images' / f'{i:04d}.jpg').write_bytes(jpeg(100 + i))
        rows.append(json.dumps({'file_name': f'{i:04d}.jpg', 'text': f'image number {i}'}))
    (tree / 'my_images' / 'metadata.jsonl').write_text('\n'.join(rows) + '\n')


def run_page(page: str, tree: Path) -> list[subprocess.CompletedProcess]:
    """The page's commands that run here, in its order, in `tree`; each must end with status 0."""
    env = {**os.environ, 'PATH': f'{tree / ".venv" / "bin"}:{os.environ["PATH"]}', 'OMP_NUM_THREADS': '1'}
    # Composer's launcher takes its master port from the environment: one of this test process's range.
    env.update({'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'MASTER_PORT': str(free_port())})
    runs = []
    for command in shell_commands(REPO / 'docs' / page):
        if any(word in command for word in ELSEWHERE):
            continue
        run = subprocess.run(['bash', '-c', command], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f'{command}\n{run.stdout[-2000:]}{run.stderr[-3000:]}'
        runs.append(run)
    return runs


def repo_copy(tmp_path) -> Path:
    """The repo's files in a folder of their own, with this environment as its .venv (as `make install` left it)."""
    tree = tmp_path / 'repo'
    files_that_travel(tree)
    (tree / '.venv').symlink_to(Path(sys.executable).parent.parent)
    return tree


@pytest.mark.slow
def test_the_data_pages_commands_run_in_order_on_a_users_folders(tmp_path):
    tree = repo_copy(tmp_path)
    user_files(tree)
    runs = run_page('data.md', tree)
    assert len(runs) == 4  # three conversions, then a training run on what they wrote
    assert (tree / 'data' / 'my-mds' / 'validation' / 'index.json').is_file()  # the last conversion's split
    assert 'local data/my-mds' in runs[-1].stdout and 'throughput: ' in runs[-1].stdout, runs[-1].stdout[-2000:]


@pytest.mark.slow
def test_the_precomputed_latents_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('precomputed-latents.md', tree)
    assert len(runs) == 3  # precompute the sample dataset, train on it, train on random latents
    assert (tree / 'data' / 'sample-latents' / 'index.json').is_file()
    assert 'local data/sample-latents' in runs[1].stdout and 'throughput: ' in runs[1].stdout, runs[1].stdout[-2000:]


@pytest.mark.slow
def test_the_ema_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('ema.md', tree)
    assert len(runs) == 2  # as published, then offloaded with the average exported
    assert (tree / 'results' / 'ema-unet' / 'config.json').is_file()
