"""Two ranks on CPU through Composer's launcher (gloo): DDP sync, batch split, throughput, checkpoints,
failures, and the mcloud.yaml check."""

import json
import os
import sys

import pytest
import torch
from conftest import LAUNCHER, REPO, TINY, fake_gpu, free_port, good_samples, run_process, write_dataset

import mcloud
from guards.arguments import ConfigError
from settings.config import resolve_config
from settings.flags import parse_args

# Two ranks share this machine's cores: small images, a batch of 8 (4 per rank).
SMALL_RUN = [*TINY, '--image_size', '32', '--batch_size', '8']


def launch(
    tmp_path, name, *flags, fail_rank=None, fail_after=1, cpu_fsdp=False, base=SMALL_RUN, timeout=300, launcher_flags=()
):
    probe_dir = tmp_path / name
    probe_dir.mkdir()
    # One thread per rank: two ranks share this machine's cores.
    env = {
        **os.environ,
        'PROBE_DIR': str(probe_dir),
        'OMP_NUM_THREADS': '1',
        'HF_HUB_OFFLINE': '1',
        'WANDB_MODE': 'offline',
    }
    if fail_rank is not None:
        env['PROBE_FAIL_RANK'], env['PROBE_FAIL_AFTER'] = str(fail_rank), str(fail_after)
    if cpu_fsdp:
        env['PROBE_CPU_FSDP'] = '1'
    run = run_process(
        [LAUNCHER, '-n', '2', *launcher_flags, str(REPO / 'tests' / 'two_rank_probe.py'), *base, *flags],
        cwd=tmp_path,
        env=env,
        timeout=timeout,
    )
    ranks = [json.loads(path.read_text()) for path in sorted(probe_dir.glob('rank*.json'))]
    return run, ranks


@pytest.mark.slow
def test_two_ranks_train_one_model_on_disjoint_halves_and_resume(tmp_path):
    results = tmp_path / 'results.json'
    checkpoints = tmp_path / 'checkpoints'
    run, ranks = launch(
        tmp_path,
        'first',
        '--max_duration',
        '3ba',
        '--save_folder',
        str(checkpoints),
        '--save_interval',
        '3ba',
        '--run_name',
        'two-ranks',
        '--results_json',
        str(results),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(ranks) == 2 and ranks[0]['world_size'] == 2
    # DDP keeps the replicas identical.
    assert ranks[0]['unet'] == ranks[1]['unet']
    # Global batch 8 = 2 ranks x 4, each rank a different half of every global batch.
    for batch0, batch1 in zip(ranks[0]['batches'], ranks[1]['batches'], strict=True):
        assert len(batch0) == len(batch1) == 4
        assert not set(batch0) & set(batch1)
    assert 'global 8 = 2 devices x microbatch 4 x 1 accumulation step' in run.stdout
    # Throughput counts the samples of both ranks: the samples SpeedMonitor divides by time are the global ones.
    summary = json.loads(results.read_text())
    assert summary['world_size'] == 2
    assert [rank['samples'] for rank in ranks] == [3 * 8, 3 * 8]
    assert summary['img_per_sec'] == pytest.approx(2 * summary['img_per_sec_per_device'])
    # One checkpoint file for the save (written by rank 0 under DDP) and the run's record beside it, plus
    # Composer's 'latest' symlink.
    saved = [path for path in checkpoints.iterdir() if not path.is_symlink()]
    assert sorted(path.name for path in saved) == ['ep0-ba3-rank0.pt', 'run_description.json']

    run, resumed = launch(
        tmp_path,
        'resumed',
        '--max_duration',
        '5ba',
        '--save_folder',
        str(checkpoints),
        '--save_interval',
        '5ba',
        '--run_name',
        'two-ranks',
        '--autoresume',
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [rank['first_batch'] for rank in resumed] == [3, 3]
    run, straight = launch(tmp_path, 'straight', '--max_duration', '5ba')
    assert run.returncode == 0, run.stderr[-3000:]
    # The resumed run trains the batches the uninterrupted run trains after batch 3, to the same weights.
    for rank in range(2):
        assert resumed[rank]['batches'] == straight[rank]['batches'][3:]
    assert resumed[0]['unet'] == resumed[1]['unet'] == straight[0]['unet']


@pytest.mark.slow
def test_two_ranks_resume_mid_epoch_on_mds_data_exactly(tmp_path):
    """Crashed after the checkpoint of batch 2 of 6 and resumed: each rank trains the batches it would have, and
    ends with bitwise the weights and average of an uninterrupted two-rank run."""
    location = write_dataset(tmp_path / 'mds', good_samples(48))
    run_flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '8', '--local', location]
    run_flags += ['--max_duration', '1ep', '--use_ema']
    run, uninterrupted = launch(tmp_path, 'uninterrupted', *run_flags, base=())
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoints = ['--save_folder', str(tmp_path / 'ckpt'), '--save_interval', '2ba', '--run_name', 'mds']
    run, _ = launch(tmp_path, 'crashed', *run_flags, *checkpoints, fail_rank=1, fail_after=2, base=())
    assert run.returncode != 0
    run, resumed = launch(tmp_path, 'resumed', *run_flags, *checkpoints, '--autoresume', base=())
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert resumed[rank]['first_batch'] == 2 and len(uninterrupted[rank]['batches']) == 6
        assert resumed[rank]['batches'] == uninterrupted[rank]['batches'][2:]
        expected = torch.load(tmp_path / 'uninterrupted' / f'rank{rank}.pt')
        got = torch.load(tmp_path / 'resumed' / f'rank{rank}.pt')
        for part in ('unet', 'ema'):
            assert [name for name in expected[part] if not torch.equal(got[part][name], expected[part][name])] == []


@pytest.mark.slow
@pytest.mark.process
def test_a_failing_rank_ends_the_job_with_an_error(tmp_path):
    """Each rank's stderr in a file of its own: the launcher shows the output of the rank it finds ended first,
    which may be rank 0, ended by its peer's going."""
    flags = ('--stderr', 'rank{rank}.err')
    run, ranks = launch(tmp_path, 'failing', '--max_duration', '4ba', fail_rank=1, timeout=240, launcher_flags=flags)
    assert run.returncode != 0
    assert 'probe: simulated failure on this rank' in (tmp_path / 'rank1.err').read_text()
    assert ranks == []  # neither rank finished


def run_benchmark(command, tmp_path, env=None, timeout=300):
    """Runs a launcher command whose benchmark.py run writes tmp_path/results.json; returns that summary."""
    results = tmp_path / 'results.json'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', **(env or {})}
    run = run_process(
        [*command, *SMALL_RUN, '--max_duration', '2ba', '--results_json', str(results)],
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.mark.slow
@pytest.mark.process
def test_torchrun_launches_two_ranks_that_train_one_model_on_disjoint_halves(tmp_path):
    """Through torchrun (runs.torchrun) rather than Composer's launcher: one world of two ranks, as DDP trains it:
    each rank a different half of every global batch, the same weights on both, the global samples counted."""
    probe = tmp_path / 'probe'
    probe.mkdir()
    env = {'PROBE_DIR': str(probe)}
    command = [sys.executable, '-m', 'runs.torchrun', '--nproc_per_node', '2', '--', 'tests/two_rank_probe.py']
    summary = run_benchmark(command, tmp_path, env)
    ranks = [json.loads(path.read_text()) for path in sorted(probe.glob('rank*.json'))]
    assert summary['world_size'] == 2 and [rank['world_size'] for rank in ranks] == [2, 2]
    assert ranks[0]['unet'] == ranks[1]['unet']
    for batch0, batch1 in zip(ranks[0]['batches'], ranks[1]['batches'], strict=True):
        assert len(batch0) == len(batch1) == 4 and not set(batch0) & set(batch1)
    assert [rank['samples'] for rank in ranks] == [2 * 8, 2 * 8]


FAKE_SRUN = """#!/bin/bash
# srun on one machine: runs the task once per node of the job, each with its own SLURM_NODEID.
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
@pytest.mark.process
def test_slurm_script_starts_one_launcher_per_node(tmp_path):
    """launch/slurm.sbatch on a two-node job simulated on this machine: two Composer launchers, node ranks 0 and 1,
    one process each, meet at the master address and train as one world of 2."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'srun').write_text(FAKE_SRUN)
    (bin_dir / 'scontrol').write_text('#!/bin/bash\necho 127.0.0.1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        'PATH': f'{bin_dir}:{os.environ["PATH"]}',
        'SLURM_NNODES': '2',
        'SLURM_JOB_NODELIST': 'node[1-2]',
        'SLURM_JOB_ID': '42',
        'SLURM_SUBMIT_DIR': str(REPO),
        'GPUS_PER_NODE': '1',
        'PYTHON': sys.executable,  # whose runs.launcher each node starts
        'MASTER_PORT': str(free_port()),
    }
    summary = run_benchmark(['bash', str(REPO / 'launch' / 'slurm.sbatch')], tmp_path, env)
    assert summary['world_size'] == 2
    assert summary['img_per_sec'] == pytest.approx(2 * summary['img_per_sec_per_device'])


@pytest.mark.slow
def test_fsdp_shards_the_unet_by_block_and_trains_with_ema_as_ddp_does(tmp_path):
    """Composer's FSDP on two CPU ranks (the probe gives it the CPU where Composer passes the CUDA device): the
    UNet is sharded one unit per resolution block, the frozen encoders are left whole, and full_shard training
    with EMA ends with the weights and average that DDP gives."""
    flags = ('--max_duration', '3ba', '--use_ema', '--ema_half_life', '2ba')
    run, ddp = launch(tmp_path, 'ddp', *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    run, sharded = launch(tmp_path, 'sharded', *flags, '--fsdp', 'full_shard', cpu_fsdp=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    units = {name.replace('_fsdp_wrapped_module.', '') for name in sharded[0]['fsdp_units']}
    assert units == {
        'unet',
        'unet.mid_block',
        *(f'unet.{part}_blocks.{i}' for part in ('down', 'up') for i in range(4)),
    }
    assert ddp[0]['fsdp_units'] == []
    assert sharded[0]['unet'] == sharded[1]['unet'] and sharded[0]['samples'] == 3 * 8
    with_fsdp, with_ddp = (torch.load(tmp_path / name / 'rank0.pt') for name in ('sharded', 'ddp'))
    for kind in ('unet', 'ema'):
        assert with_fsdp[kind].keys() == with_ddp[kind].keys()
        for name, tensor in with_ddp[kind].items():
            torch.testing.assert_close(with_fsdp[kind][name], tensor, rtol=1e-4, atol=1e-6, msg=f'{kind} {name}')


@pytest.mark.slow
def test_flux_twin_full_shard_is_sharded_per_block_and_trains_as_ddp(tmp_path):
    """Flux's twin under full_shard: one unit per double- and single-stream block, the frozen CLIP and T5 left
    whole, and training with EMA ends with the weights and average that DDP gives."""
    base = ['--model_name', 'tiny-flux-schnell', '--use_synth_data', '--image_size', '32', '--batch_size', '8']
    flags = ('--max_duration', '3ba', '--use_ema', '--ema_half_life', '2ba')
    run, ddp = launch(tmp_path, 'ddp', *flags, base=base)
    assert run.returncode == 0, run.stderr[-3000:]
    run, sharded = launch(tmp_path, 'sharded', *flags, '--fsdp', 'full_shard', cpu_fsdp=True, base=base)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    units = {name.replace('_fsdp_wrapped_module.', '') for name in sharded[0]['fsdp_units']}
    assert units == {
        'transformer',
        'transformer.transformer_blocks.0',
        *(f'transformer.single_transformer_blocks.{i}' for i in range(2)),
    }
    assert sharded[0]['unet'] == sharded[1]['unet'] and sharded[0]['samples'] == 3 * 8
    with_fsdp, with_ddp = (torch.load(tmp_path / name / 'rank0.pt') for name in ('sharded', 'ddp'))
    for kind in ('unet', 'ema'):
        assert with_fsdp[kind].keys() == with_ddp[kind].keys()
        for name, tensor in with_ddp[kind].items():
            torch.testing.assert_close(with_fsdp[kind][name], tensor, rtol=1e-4, atol=1e-6, msg=f'{kind} {name}')


FSDP_EMA = ('--fsdp', 'full_shard', '--use_ema', '--ema_half_life', '2ba')


@pytest.fixture(scope='module')
def fsdp_straight_run(tmp_path_factory):
    """Five batches of full_shard training with EMA, uninterrupted."""
    tmp_path = tmp_path_factory.mktemp('fsdp')
    run, ranks = launch(tmp_path, 'straight', *FSDP_EMA, '--max_duration', '5ba', cpu_fsdp=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return ranks, [torch.load(tmp_path / 'straight' / f'rank{rank}.pt') for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    'state_dict_type, written',
    [('full', ['ep0-ba3-rank0.pt']), ('sharded', ['.metadata', '__0_0.distcp', '__1_0.distcp'])],
)
def test_fsdp_checkpoint_resumes_to_the_weights_and_average_of_an_uninterrupted_run(
    tmp_path, fsdp_straight_run, state_dict_type, written
):
    """Under full_shard, a checkpoint at batch 3 and a resumed run to batch 5 end where five batches straight
    do, EMA included: 'full' is one file from rank 0, 'sharded' a folder with one file per rank."""
    flags = (
        *FSDP_EMA,
        '--fsdp_state_dict_type',
        state_dict_type,
        '--save_folder',
        str(tmp_path / 'checkpoints'),
        '--run_name',
        'fsdp',
    )
    run, _ = launch(tmp_path, 'first', *flags, '--max_duration', '3ba', '--save_interval', '3ba', cpu_fsdp=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    saved = [path for path in (tmp_path / 'checkpoints').glob('ep*') if not path.is_symlink()]
    assert len(saved) == 1
    assert (sorted(path.name for path in saved[0].iterdir()) if saved[0].is_dir() else [saved[0].name]) == written

    run, resumed = launch(
        tmp_path,
        'resumed',
        *flags,
        '--max_duration',
        '5ba',
        '--save_interval',
        '5ba',
        '--autoresume',
        *(['--trust_checkpoint'] if state_dict_type == 'sharded' else []),  # read by unpickling: trusted on purpose
        cpu_fsdp=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    straight, straight_weights = fsdp_straight_run
    assert [rank['first_batch'] for rank in resumed] == [3, 3]
    for rank in range(2):
        assert resumed[rank]['batches'] == straight[rank]['batches'][3:]
        weights = torch.load(tmp_path / 'resumed' / f'rank{rank}.pt')
        for kind in ('unet', 'ema'):
            assert weights[kind].keys() == straight_weights[rank][kind].keys()
            for name, tensor in straight_weights[rank][kind].items():
                assert torch.equal(weights[kind][name], tensor), f'rank {rank} {kind} {name}'


def test_resuming_a_sharded_checkpoint_needs_it_trusted(monkeypatch):
    from test_memory_plan import H100

    fake_gpu(monkeypatch, H100)  # FSDP: a GPU's
    flags = [*SMALL_RUN, '--fsdp', 'full_shard', '--fsdp_state_dict_type', 'sharded', '--autoresume']
    flags += ['--save_folder', 'ckpt', '--run_name', 'r']
    with pytest.raises(ConfigError, match='unpickling its metadata, which runs any code the files name; pass --trust'):
        resolve_config(parse_args(flags))


def test_fsdp_needs_a_gpu():
    with pytest.raises(ConfigError, match='--fsdp full_shard: Composer shards with FSDP on CUDA GPUs only'):
        resolve_config(parse_args(SMALL_RUN + ['--fsdp', 'full_shard']))
    with pytest.raises(ConfigError, match='--fsdp_state_dict_type sharded: applies to --fsdp checkpoints only'):
        resolve_config(parse_args(SMALL_RUN + ['--fsdp_state_dict_type', 'sharded']))


# ------------------------------------------------------------------------------------ mcloud.yaml


def test_mcloud_yaml_is_valid_for_mcli():
    assert mcloud.check(REPO / 'mcloud.yaml') == []


@pytest.mark.parametrize(
    'original, broken, reported',
    [
        ('  gpu_type: a100_40gb', '  gpu_typ: a100_40gb', "'compute.gpu_typ' (did you mean 'gpu_type'?)"),
        ('command: |', 'comand: |', 'unknown fields comand'),
        ('  git_branch: main', '  git_brnach: main', "unknown git_repo field 'git_brnach'"),
        ('compute:', 'gpu_num: 8\ncompute:', "field 'gpu_num' is deprecated"),
        ('image: mosaicml/pytorch:2.7.0_cu128', 'image: mosaicml/pytorch:2.4.0_cu124', 'does not carry torch 2.7.0'),
        ('compute:', 'compute: [', 'cannot be parsed'),
        ('  gpus: 8', '  gpus: eight', "compute.gpus must be a positive whole number, got 'eight'"),
        ('  gpus: 8', '  gpus: -8', 'compute.gpus must be a positive whole number, got -8'),
    ],
)
def test_mcloud_check_reports_a_broken_copy(tmp_path, original, broken, reported):
    text = (REPO / 'mcloud.yaml').read_text()
    assert original in text
    copy = tmp_path / 'mcloud.yaml'
    copy.write_text(text.replace(original, broken, 1))
    problems = mcloud.check(copy)
    assert any(reported in problem for problem in problems), problems
    assert mcloud.main(['check', str(copy)]) == 1


def test_mcloud_check_names_a_folder_a_missing_file_and_a_binary(tmp_path):
    (tmp_path / 'binary.yaml').write_bytes(b'\x89PNG\r\n\x1a\n\x00')
    assert mcloud.check(tmp_path) == [f'{tmp_path}: a folder, not a run YAML: give the YAML file in it (mcloud.yaml)']
    assert mcloud.check(tmp_path / 'nowhere.yaml') == [f'{tmp_path / "nowhere.yaml"}: no such file']
    assert mcloud.check(tmp_path / 'binary.yaml')[0].startswith(f'{tmp_path / "binary.yaml"}: cannot be parsed')
    assert mcloud.main(['check', str(tmp_path)]) == 1


def test_mcloud_sweep_makes_one_run_per_gpu_count():
    configs = mcloud.sweep_configs(REPO / 'mcloud.yaml', [8, 16, 128], 'h100_80gb')
    assert [config.compute['gpus'] for config in configs] == [8, 16, 128]
    assert all(config.compute['gpu_type'] == 'h100_80gb' for config in configs)
    assert [config.name for config in configs] == [
        'sd2-benchmark-8xh100-80gb',
        'sd2-benchmark-16xh100-80gb',
        'sd2-benchmark-128xh100-80gb',
    ]


def test_submitting_without_mcli_set_up_is_one_line(tmp_path, monkeypatch, capsys):
    """`mcloud.py sweep --submit` before `mcli init` (no API key): one line naming the run, not mcli's traceback."""
    monkeypatch.setenv('HOME', str(tmp_path))  # no ~/.mosaic: no API key
    monkeypatch.delenv('MOSAICML_API_KEY', raising=False)
    with pytest.raises(SystemExit) as stopped:
        mcloud.main(['sweep', '--gpus', '8', '--submit'])
    assert stopped.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: submitting sd2-benchmark-8x') and 'API key' in err and '\n' not in err
