"""A page's commands run as a user pastes them: in the page's order, in a copy of the repo (on a CPU, the tiny
model by default), on the files a user would have (a folder of photos with captions, one with a metadata.jsonl),
each ending with exit status 0. Left out: a block whose marker line (`<!-- needs: ... -->` above it) says it needs
what this machine lacks (a GPU, a cluster, results of GPU runs, a measurement's minutes, a Python of its own to
install into: CI's lanes install those), a command naming S3 or a GPU's or a cluster's tools, and the measurement
scripts of benchmarks/, which take as long as they measure (the loader's: 75 s here); test_docs_commands parses
those."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, jpeg
from test_docs_commands import PAGES, shell_blocks
from test_gpu_campaign import files_that_travel

# What a command needs that no CPU machine here has: it is not run.
ELSEWHERE = (
    's3://',
    '/nvme/',
    '--fsdp',
    'sbatch',
    'kubectl',
    'sky ',
    'mcli ',
    'docker ',
    'python benchmarks/',
    'bash benchmarks/',
)


def commands_run_here(page: Path) -> list[str]:
    """The page's commands this module runs: those of blocks without a marker, but for what ELSEWHERE names."""
    blocks = shell_blocks(page)
    return [command for needs, block in blocks if not needs for command in block if not elsewhere(command)]


def elsewhere(command: str) -> bool:
    return any(word in command for word in ELSEWHERE)


# The pages whose commands the tests below run.
JOURNEYS = {
    *('README.md', 'data.md', 'precomputed-latents.md', 'ema.md', 'quality.md', 'report.md', 'models.md'),
    *('scaling-out.md', 'speed.md'),
}


def test_every_page_with_commands_a_cpu_runs_is_run_below():
    """A command added to a page runs in its page's test, or its block's marker says what it needs."""
    assert {page.name for page in PAGES if commands_run_here(page)} == JOURNEYS


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
    for name in ('MAKEFLAGS', 'MAKELEVEL', 'MFLAGS'):  # set where `make test` runs this: a user's shell has none
        env.pop(name, None)
    # Composer's launcher takes its master port from the environment: one claimed for this test (free_port).
    env.update({'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'MASTER_PORT': str(free_port())})
    runs = []
    for command in commands_run_here(REPO / page):
        if command.startswith('make '):  # its prerequisite is the shared .venv, which it must not reinstall
            fresh = subprocess.run(['make', '-q', '.venv/.installed'], cwd=tree, env=env, capture_output=True)
            assert fresh.returncode == 0, '.venv is older than the requirements or pyproject.toml: run make install'
        run = subprocess.run(['bash', '-c', command], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f'{command}\n{run.stdout[-2000:]}{run.stderr[-3000:]}'
        runs.append(run)
    return runs


def repo_copy(tmp_path) -> Path:
    """The repo's files in a folder of their own, with this environment as its .venv (as `make install` left it),
    each file as old as its original (so that make sees the .venv as installed from them)."""
    tree = tmp_path / 'repo'
    files_that_travel(tree)
    for copy in tree.rglob('*'):
        original = (REPO / copy.relative_to(tree)).stat()
        os.utime(copy, ns=(original.st_atime_ns, original.st_mtime_ns))
    (tree / '.venv').symlink_to(Path(sys.executable).parent.parent)
    return tree


@pytest.mark.slow
def test_the_data_pages_commands_run_in_order_on_a_users_folders(tmp_path):
    tree = repo_copy(tmp_path)
    user_files(tree)
    runs = run_page('docs/data.md', tree)
    assert len(runs) == 4  # three conversions, then a training run on what they wrote
    assert (tree / 'data' / 'my-mds' / 'validation' / 'index.json').is_file()  # the last conversion's split
    assert 'local data/my-mds' in runs[-1].stdout and 'throughput: ' in runs[-1].stdout, runs[-1].stdout[-2000:]


@pytest.mark.slow
def test_the_precomputed_latents_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('docs/precomputed-latents.md', tree)
    assert len(runs) == 3  # precompute the sample dataset, train on it, train on random latents
    assert (tree / 'data' / 'sample-latents' / 'index.json').is_file()
    assert 'local data/sample-latents' in runs[1].stdout and 'throughput: ' in runs[1].stdout, runs[1].stdout[-2000:]


@pytest.mark.slow
def test_the_ema_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('docs/ema.md', tree)
    assert len(runs) == 2  # as published, then offloaded with the average exported
    assert (tree / 'results' / 'ema-unet' / 'config.json').is_file()


@pytest.mark.slow
def test_the_quality_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('docs/quality.md', tree)
    assert len(runs) == 4  # a short run with its checkpoints and pipeline, a prompts file, a drawing from each
    assert len(list((tree / 'out' / 'pipeline').glob('*.png'))) >= 2, runs[2].stdout
    assert len(list((tree / 'out' / 'ema').glob('*.png'))) >= 2, runs[3].stdout


@pytest.mark.slow
def test_the_report_pages_commands_print_the_tables_the_page_shows(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('docs/report.md', tree)
    assert len(runs) == 2  # the published table, then its prediction from the 8-GPU row
    page = (REPO / 'docs' / 'report.md').read_text()
    for run, figure in zip(runs, ('published_table.png', 'predicted_table.png')):
        tables = re.findall(r'^\|.*\|\n(?:\|.*\|\n)+', run.stdout, re.MULTILINE)
        assert any(table in page for table in tables), run.stdout  # the page shows a table as the command prints it
        assert (tree / 'docs' / figure).stat().st_size > 0


@pytest.mark.slow
def test_the_models_pages_commands_run_in_order_on_a_users_photos(tmp_path):
    tree = repo_copy(tmp_path)
    user_files(tree)
    runs = run_page('docs/models.md', tree)
    assert len(runs) == 3  # the T5 smoke tokenizer, a conversion, a diffusion transformer's run on it
    assert runs[0].stdout.splitlines()[-1].endswith('/repo/data/t5-smoke-tokenizer'), runs[0].stdout
    assert (tree / 'data' / 't5-smoke-tokenizer').is_dir()
    assert 'throughput: ' in runs[2].stdout, runs[2].stdout[-2000:]


@pytest.mark.slow
def test_the_scaling_out_and_speed_pages_commands_run_in_order(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('docs/scaling-out.md', tree)
    assert len(runs) == 2  # one node's launcher, the platform file checked offline
    assert 'throughput: ' in runs[0].stdout, runs[0].stdout[-2000:]
    runs = run_page('docs/speed.md', tree)
    assert len(runs) == 2  # a GPU loan's plan printed here, and a profile of a few batches
    assert any((tree / 'results' / 'profile').iterdir())
    assert any('loan kernels on NVIDIA H200 torch 2.11.0: ' in run.stdout for run in runs)


@pytest.mark.slow
def test_the_readmes_commands_run_and_print_its_cluster_prediction(tmp_path):
    tree = repo_copy(tmp_path)
    runs = run_page('README.md', tree)
    assert len(runs) == 2  # the published command on one node, the H100 cluster prediction from a measured run
    assert 'throughput: ' in runs[0].stdout, runs[0].stdout[-2000:]
    readme = (REPO / 'README.md').read_text()
    predicted = re.findall(r'^\| [\d,]+ \| ([\d,.]+)', readme.split('| H100s | predicted img/s |')[1], re.MULTILINE)
    assert len(predicted) == 5 and all(f'| {img_s} |' in runs[1].stdout for img_s in predicted), runs[1].stdout
