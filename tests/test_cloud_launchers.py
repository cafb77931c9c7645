"""launch/kubernetes.yaml and launch/skypilot.yaml: each checked against its platform's own fields, and its launch
line run as the platform runs it on two nodes, simulated on this machine: two processes, one per node, each with
the environment the platform gives that node, each starting Composer's launcher with one CPU rank, meeting at the
master address and training as one world of 2. The files are read with PyYAML and run as they are, but for what
S3 and GPUs would give: random tensors instead of the S3 dataset, a checkpoint folder in tmp_path, the tiny model's
flags added after the file's own (the last of a flag wins), 127.0.0.1 and a free port as the master, one process
per node; and benchmark.py replaced by tests/two_rank_probe.py, which runs it and records what each rank trained."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import REPO, free_port, has_ended, need_mount_namespaces, s3_client, wait_until

from settings.flags import parse_args

LAUNCH = REPO / 'launch'
PROBE = str(REPO / 'tests' / 'two_rank_probe.py')
# This environment's composer and python stand for the image's (Kubernetes) and the node's .venv (SkyPilot).
BIN = Path(sys.executable).parent
# The oldest Kubernetes with every Job field the file uses as GA (backoffLimitPerIndex, successPolicy), and the
# newest that kubernetes-validate ships.
KUBERNETES_VERSIONS = ['1.33.0', kubernetes_validate.latest_version()]
# Two nodes on this machine's cores: one CPU rank each, small images, a batch of 8 (4 per rank).
# Random tensors rather than an MDS dataset: Streaming's shared memory is per machine, and two nodes on one
# machine would share it.
SMALL_RUN = ['--use_synth_data', '--model_name', 'tiny', '--image_size', '32', '--batch_size', '8']
CHECKPOINT = re.compile(r'ep\d+-ba(\d+)-rank0\.pt')


# ------------------------------------------------------------------------------------------ Kubernetes


def kubernetes_objects() -> dict[str, dict]:
    return {obj['kind']: obj for obj in yaml.safe_load_all((LAUNCH / 'kubernetes.yaml').read_text())}


def container_of(job: dict) -> dict:
    (container,) = job['spec']['template']['spec']['containers']
    return container


def literal_env(container: dict) -> dict[str, str]:
    """The container's environment variables that have a value in the file (not those from a Secret)."""
    return {var['name']: var['value'] for var in container['env'] if 'value' in var}


def kubernetes_expand(text: str, env: dict[str, str]) -> str:
    """What Kubernetes does to a container's command and args before it runs them: $(NAME) of a variable the
    container defines becomes its value, $$ becomes $; anything else is left as written."""
    return re.sub(
        r'\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)',
        lambda match: '$' if match.group(0) == '$$' else env.get(match.group(1), match.group(0)),
        text,
    )


def with_values(args: list[str], values: dict[str, str | None]) -> list[str]:
    """benchmark.py's flags with the values of some flags replaced (None: the flag left out); each must be there,
    with a value."""
    args = list(args)
    for flag, value in values.items():
        at = args.index(flag)
        args[at : at + 2] = [flag, value] if value is not None else []
    return args


def start_pods(tmp_path, name, flags, env=None, values=None) -> list[subprocess.Popen]:
    """The Job's two pods, as Kubernetes starts them, on this machine: the container's command with its args,
    the benchmark's flags then `flags`, the pod's environment with its completion index; rank 0's Service name
    is this machine. Each in a session of its own, as each pod has its own processes."""
    job = kubernetes_objects()['Job']
    container = container_of(job)
    args = with_values(container['args'], values or {}) + flags
    pods = []
    for index in range(job['spec']['completions']):
        pod_env = {
            **literal_env(container),
            'JOB_COMPLETION_INDEX': str(index),  # set by Kubernetes in an Indexed Job's pods
            'MASTER_ADDR': '127.0.0.1',  # sd2-benchmark-0.sd2-benchmark, rank 0's pod
            'GPUS_PER_NODE': '1',  # one CPU rank per node
            **(env or {}),
        }
        command = [kubernetes_expand(part, pod_env) for part in container['command'] + args]
        assert command[2].count('benchmark.py') == 1
        command[2] = command[2].replace('benchmark.py', PROBE)
        pods.append(start_node(command, tmp_path / f'{name}-{index}', pod_env))
    return pods


def start_node(command: list[str], node_dir: Path, node_env: dict[str, str]) -> subprocess.Popen:
    """A node's launch command, with a disk of its own: node_dir mounted at the same path on every node, its
    working folder (in a mount namespace of its own). Composer stages there the checkpoints it uploads and, under
    --autoresume, a file that each node writes and removes at the path rank 0 gives: nodes sharing a disk would
    remove each other's. Its output goes to files in node_dir, and its probe records there too."""
    node_dir.mkdir()
    disk = node_dir.parent / 'node-disk'
    disk.mkdir(exist_ok=True)
    env = {
        **os.environ,
        'PATH': f'{BIN}:{os.environ["PATH"]}',
        'OMP_NUM_THREADS': '1',
        'HF_HUB_OFFLINE': '1',
        'WANDB_MODE': 'offline',
        'PROBE_DIR': str(node_dir),
        'PROBE_SYMLINK_WAIT': '1',  # the local S3 server has each checkpoint at once: no 30 s waits
        **node_env,
    }
    # unshare and sh exec what follows: the command's first process keeps the pid that a signal is sent to.
    own_disk = ['unshare', '--mount', '--propagation', 'private', 'sh', '-c', MOUNT_AND_RUN, 'sh', node_dir, disk]
    with open(node_dir / 'stdout', 'w') as out, open(node_dir / 'stderr', 'w') as err:  # files: no pipe fills up
        node = subprocess.Popen(
            [*map(str, own_disk), *command], env=env, stdout=out, stderr=err, start_new_session=True
        )
    node.output = node_dir
    return node


MOUNT_AND_RUN = 'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"'


@pytest.fixture(autouse=True)
def mount_namespaces(request):
    """The two-node tests give each node its own disk in a mount namespace: root only, skipped elsewhere."""
    if 'slow' not in request.keywords:
        return
    need_mount_namespaces()


def finish(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Each node's exit status, stdout and stderr; every process of a node left running is killed, its group
    signalled before its first process is reaped (has_ended), so that the group's id names no other job's."""
    deadline = time.monotonic() + timeout
    try:
        for node in nodes:
            wait_until(partial(has_ended, node), max(1, deadline - time.monotonic()), f'{node.output.name} ended')
    finally:
        for node in nodes:
            if node.returncode is None:  # not reaped: the group's id is still its own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    return [
        (node.returncode, (node.output / 'stdout').read_text(), (node.output / 'stderr').read_text()) for node in nodes
    ]


def statuses(ends) -> list[int]:
    return [status for status, _, _ in ends]


def ranks(tmp_path, name) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob(f'{name}-*/rank*.json'))]


def assert_one_world(records: list[dict], batches: int, first_batch: int = 0) -> None:
    """Both ranks in one world of 2 trained the same batches to the same weights."""
    assert [record['world_size'] for record in records] == [2, 2]
    assert records[0]['unet'] == records[1]['unet']  # DDP: one model
    assert {record['first_batch'] for record in records} == {first_batch}
    assert {record['samples'] for record in records} == {batches * 8}
    halves = [set(digest for batch in record['batches'] for digest in batch) for record in records]
    assert not halves[0] & halves[1]  # each rank trained its own half of every batch


def test_kubernetes_objects_validate_strictly_against_the_kubernetes_schemas():
    """kubernetes-validate's strict mode: Kubernetes' own OpenAPI schemas, every field known, every type right."""
    objects = kubernetes_objects()
    assert sorted(objects) == ['Job', 'Service']
    for version in KUBERNETES_VERSIONS:
        for obj in objects.values():
            kubernetes_validate.validate(obj, version, strict=True)
    misspelled = kubernetes_objects()['Job']
    misspelled['spec']['template']['spec']['terminationGracePeriod'] = 120
    with pytest.raises(kubernetes_validate.ValidationError, match="'terminationGracePeriod' was unexpected"):
        kubernetes_validate.validate(misspelled, KUBERNETES_VERSIONS[0], strict=True)


def test_kubernetes_job_is_one_indexed_pod_per_node_with_gpus_shared_memory_and_a_restart_policy():
    objects = kubernetes_objects()
    job, service = objects['Job'], objects['Service']
    spec, pod = job['spec'], job['spec']['template']['spec']
    container = container_of(job)
    env = literal_env(container)
    # One pod per node, its completion index its node rank; the launcher's world from the same numbers.
    assert spec['completionMode'] == 'Indexed'
    assert spec['completions'] == spec['parallelism'] == int(env['NUM_NODES']) >= 2
    assert container['resources']['limits']['nvidia.com/gpu'] == int(env['GPUS_PER_NODE'])
    script = ' '.join(container['command'][2].replace('\\\n', ' ').split())
    assert (
        'exec python -m runs.launcher -n "$GPUS_PER_NODE" --world_size "$((NUM_NODES * GPUS_PER_NODE))" --node_rank '
        '"$JOB_COMPLETION_INDEX" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" benchmark.py "$@"'
    ) in script
    # Rank 0's stable name: the pod's hostname <job>-0 in the headless Service's subdomain.
    assert service['spec']['clusterIP'] == 'None' and service['spec']['publishNotReadyAddresses'] is True
    assert service['spec']['selector'] == {'batch.kubernetes.io/job-name': job['metadata']['name']}
    assert pod['subdomain'] == service['metadata']['name']
    assert env['MASTER_ADDR'] == f'{job["metadata"]["name"]}-0.{service["metadata"]["name"]}'
    # /dev/shm in memory, larger than a container's 64 MB.
    (shm,) = [volume for volume in pod['volumes'] if volume['name'] == 'shm']
    assert shm['emptyDir']['medium'] == 'Memory'
    assert {'name': 'shm', 'mountPath': '/dev/shm'} in container['volumeMounts']
    # Restarts: preemptions not counted, a refused configuration not retried, every index bounded.
    assert pod['restartPolicy'] == 'Never'
    rules = {rule['action']: rule for rule in spec['podFailurePolicy']['rules']}
    assert rules['Ignore']['onPodConditions'] == [{'type': 'DisruptionTarget', 'status': 'True'}]
    assert rules['FailJob']['onExitCodes'] == {'containerName': container['name'], 'operator': 'In', 'values': [2]}
    assert spec['backoffLimitPerIndex'] >= 1 and spec['maxFailedIndexes'] == 0
    assert spec['podReplacementPolicy'] == 'Failed'
    assert pod['terminationGracePeriodSeconds'] >= 60  # the launcher's 30 s for its ranks, and the pod's own end
    # S3 credentials from a Secret; data and checkpoints on S3; a replacement pod resumes.
    secrets = {var['name']: var['valueFrom']['secretKeyRef'] for var in container['env'] if 'valueFrom' in var}
    assert sorted(secrets) == ['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY']
    assert all(ref['key'] == name for name, ref in secrets.items())
    flags = parse_args(container['args'])  # benchmark.py's own parser: exits on a flag it does not know
    assert flags.remote.startswith('s3://') and flags.save_folder.startswith('s3://')
    assert flags.autoresume and flags.run_name


def checkpoints_in(endpoint: str, prefix: str) -> dict[int, str]:
    """The checkpoints a run uploaded under s3://bucket/prefix: batch -> name."""
    listed = s3_client(endpoint).list_objects_v2(Bucket='bucket', Prefix=f'{prefix}/').get('Contents', [])
    names = [key['Key'].rsplit('/', 1)[1] for key in listed]
    return {int(match.group(1)): name for name in names if (match := CHECKPOINT.fullmatch(name))}


@pytest.mark.slow
def test_kubernetes_job_on_two_pods_trains_one_model(s3, tmp_path):
    """Both pods of the Job, completion indexes 0 and 1: two launchers meet at rank 0's address and train one
    model, each rank its half of every batch, end with the same weights, and upload its checkpoint to S3."""
    values = {'--remote': None, '--save_folder': f's3://bucket/{tmp_path.name}'}
    flags = [*SMALL_RUN, '--max_duration', '3ba']
    pods = start_pods(tmp_path, 'pod', flags, {'MASTER_PORT': str(free_port())}, values)
    ends = finish(pods, timeout=240)
    assert statuses(ends) == [0, 0], '\n'.join(out[-2000:] + err[-3000:] for _, out, err in ends)
    assert_one_world(ranks(tmp_path, 'pod'), batches=3)
    assert 3 in checkpoints_in(s3, tmp_path.name)


def latest_link(endpoint: str, prefix: str) -> int:
    """The batch of the checkpoint that Composer's latest link on S3 names (0: no link yet)."""
    try:
        body = s3_client(endpoint).get_object(Bucket='bucket', Key=f'{prefix}/latest-rank0.pt.symlink')['Body']
    except s3_client(endpoint).exceptions.NoSuchKey:
        return 0
    return int(CHECKPOINT.fullmatch(body.read().decode().strip().rsplit('/', 1)[1]).group(1))


@pytest.mark.slow
def test_kubernetes_preempted_pod_ends_its_job_and_the_replacements_resume(s3, tmp_path):
    """Kubernetes preempts node 1: SIGTERM to its pod's first process, the launcher. Its rank stops at once, exit
    status 143 (not counted: DisruptionTarget); rank 0, its peer gone, fails (counted), so both indexes are
    replaced, and the new pods, on fresh disks with the same --autoresume, continue as one world from the
    newest checkpoint on S3, which the latest link names (or is pointed at first, where it lags). Composer uploads
    that link once it sees the checkpoint's upload, checking every 2 s here (30 s by its default): the signal comes
    once there is one. The resumed run ends 2
    batches after it, where the first run wrote no checkpoint (Composer does not write over an object that
    exists)."""
    folder = f's3://bucket/{tmp_path.name}'
    values = {'--remote': None, '--save_folder': folder}
    flags = [*SMALL_RUN, '--max_duration', '400ba', '--save_interval', '4ba']
    pods = start_pods(tmp_path, 'first', flags, {'MASTER_PORT': str(free_port())}, values)
    try:
        deadline = time.monotonic() + 180
        while not latest_link(s3, tmp_path.name):
            assert time.monotonic() < deadline and not any(map(has_ended, pods)), 'no latest link on S3'
            time.sleep(0.5)
        pods[1].send_signal(signal.SIGTERM)  # to the container's first process: the launcher, after exec
    finally:
        ends = finish(pods, timeout=120)
    (status0, out0, err0), (status1, out1, err1) = ends
    assert status1 == 143, err1[-3000:]
    assert re.search(
        rf'error: SIGTERM: stopped at batch \d+ of 400; its checkpoints are in {folder}; '
        'rerun the same command with --autoresume to continue',
        err1,
    ), err1[-3000:]
    assert status0 not in (0, 143), err0[-3000:]  # rank 0 lost its peer: a failure, which ends the pod
    reached = max(checkpoints_in(s3, tmp_path.name))  # --autoresume points the link at it if it lags behind
    assert reached >= latest_link(s3, tmp_path.name) >= 4 and reached % 4 == 0

    flags = [*SMALL_RUN, '--max_duration', f'{reached + 2}ba', '--save_interval', '4ba']
    pods = start_pods(tmp_path, 'replaced', flags, {'MASTER_PORT': str(free_port())}, values)
    ends = finish(pods, timeout=240)
    assert statuses(ends) == [0, 0], '\n'.join(out[-2000:] + err[-3000:] for _, out, err in ends)
    assert f"resumed run 'sd2-benchmark' from the latest in {folder} (batch {reached} of {reached + 2})" in ends[0][1]
    assert_one_world(ranks(tmp_path, 'replaced'), batches=reached + 2, first_batch=reached)


# ------------------------------------------------------------------------------------------ SkyPilot

# SkyPilot's task and resources fields, as its own schema lists them (sky/utils/schemas.py, get_task_schema and
# get_resources_schema, SkyPilot 0.14.1): its schema allows no other. The skypilot package is not installed here:
# `pip install --dry-run skypilot==0.14.1` adds about 50 packages to the pinned stack (its API server's FastAPI,
# uvicorn, SQLAlchemy, alembic, pydantic, pandas 3, ...) and moves click back to 8.1.8. launch/skypilot.yaml was
# checked with SkyPilot 0.14.1 itself (its schema and sky.Task.from_yaml) in a separate environment; this test
# checks the fields the launch needs.
SKYPILOT_TASK_FIELDS = {
    'name', 'workdir', 'event_callback', 'num_nodes', 'resources', 'file_mounts', 'setup', 'run', 'envs', 'secrets',
    'service', 'pool', 'inputs', 'outputs', 'config', 'volumes', 'volume_mounts', 'managed_secrets',
    'file_mounts_mapping', 'api_server_access', '_metadata',
}  # fmt: skip
SKYPILOT_RESOURCES_FIELDS = {
    'cloud', 'infra', 'region', 'zone', 'cpus', 'memory', 'accelerators', 'instance_type', 'use_spot',
    'job_recovery', 'disk_size', 'disk_tier', 'network_tier', 'ports', 'labels', 'accelerator_args', 'image_id',
    'any_of', 'ordered', 'autostop', 'priority', 'priority_class', 'local_disk', 'ephemeral_storage',
    'max_hourly_cost', 'volumes',
}  # fmt: skip


def skypilot_task() -> dict:
    return yaml.safe_load((LAUNCH / 'skypilot.yaml').read_text())


def test_skypilot_task_asks_for_several_gpu_nodes_installs_the_repo_and_launches_from_skypilots_variables():
    task = skypilot_task()
    assert set(task) <= SKYPILOT_TASK_FIELDS
    assert set(task['resources']) <= SKYPILOT_RESOURCES_FIELDS
    assert task['num_nodes'] >= 2
    assert re.fullmatch(r'H100:8', task['resources']['accelerators'])
    assert task['workdir'] == '.'
    assert '.venv/bin/pip install --disable-pip-version-check -r requirements.txt' in task['setup']
    assert '.venv/bin/pip install --disable-pip-version-check --no-deps -e .' in task['setup']
    run = ' '.join(task['run'].replace('\\\n', ' ').split())
    assert 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)' in run  # the first node's address
    assert (
        'exec python -m runs.launcher -n "$SKYPILOT_NUM_GPUS_PER_NODE" --world_size "$((SKYPILOT_NUM_NODES * '
        'SKYPILOT_NUM_GPUS_PER_NODE))" --node_rank "$SKYPILOT_NODE_RANK" --master_addr "$MASTER_ADDR" '
        '--master_port "$MASTER_PORT" benchmark.py '
    ) in run
    envs = task['envs']
    assert envs['DATA'].startswith('s3://') and envs['CHECKPOINTS'].startswith('s3://')
    assert all(isinstance(value, str) for value in envs.values())  # SkyPilot exports each as it is
    launch = task['run'].strip().splitlines()[-1]
    assert launch.strip().startswith('benchmark.py ') and '--autoresume' in launch
    flags = parse_args(['--remote', envs['DATA'], '--save_folder', envs['CHECKPOINTS'], *envs['FLAGS'].split()])
    assert flags.max_duration and flags.save_interval


def start_skypilot_nodes(tmp_path, name, env) -> list[subprocess.Popen]:
    """The run script on each of two nodes, as SkyPilot runs it: bash in the workdir (this repo), with the task's
    envs (`env` as --env overrides) and SkyPilot's variables for that node. The node's .venv is this environment."""
    task = skypilot_task()
    script = task['run']
    for part in ('source .venv/bin/activate', 'benchmark.py', '--remote "$DATA" '):
        assert script.count(part) == 1, part
    script = script.replace('source .venv/bin/activate', f"source '{BIN / 'activate'}'")
    script = script.replace('benchmark.py', PROBE).replace('--remote "$DATA" ', '')  # SMALL_RUN's random tensors
    ips = '\n'.join(['127.0.0.1'] * 2)
    nodes = []
    for rank in range(2):
        node_env = {
            **task['envs'],
            **env,
            'SKYPILOT_NODE_RANK': str(rank),
            'SKYPILOT_NODE_IPS': ips,
            'SKYPILOT_NUM_NODES': '2',
            'SKYPILOT_NUM_GPUS_PER_NODE': '1',  # one CPU rank per node
        }
        nodes.append(start_node(['bash', '-c', script], tmp_path / f'{name}-{rank}', node_env))
    return nodes


@pytest.mark.slow
def test_skypilot_run_on_two_nodes_trains_one_model(s3, tmp_path):
    task = skypilot_task()
    env = {
        'CHECKPOINTS': f's3://bucket/{tmp_path.name}',
        'MASTER_PORT': str(free_port()),
        'FLAGS': ' '.join([task['envs']['FLAGS'], *SMALL_RUN, '--max_duration', '3ba']),
    }
    nodes = start_skypilot_nodes(tmp_path, 'node', env)
    ends = finish(nodes, timeout=240)
    assert statuses(ends) == [0, 0], '\n'.join(out[-2000:] + err[-3000:] for _, out, err in ends)
    assert_one_world(ranks(tmp_path, 'node'), batches=3)
    assert 3 in checkpoints_in(s3, tmp_path.name)
