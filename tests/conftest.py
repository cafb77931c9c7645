"""Settings and helpers shared by the test suite.

Tests run offline: no hub, no W&B account. Tiers are pytest markers: `slow` (several processes, a local S3
server, long runs), `gpu` (CUDA only), and the rest, the fast tier. CUDA is hidden from a session whose marker
expression leaves out the gpu tests (make test, make test-fast), so that the CPU defaults and checks under test are
the ones that apply. A session of gpu tests alone on a machine without CUDA (`pytest -m gpu`, make test-gpu) fails
in one line rather than pass by skipping them; in a session that also selects CPU tests they are skipped.
"""

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from forkserver import ForkServer, subprocess_with
from PIL import Image
from streaming import MDSWriter

from settings.config import RunConfig, resolve_config
from settings.flags import parse_args
from settings.model_folder import CONFIGS_DIR, ModelFolder, read_model_folder

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

REPO = Path(__file__).resolve().parent.parent
# benchmark.py on the tiny model and random tensors: the base of most runs here.
TINY = ['--model_name', 'tiny', '--use_synth_data']
LAUNCHER = str(Path(sys.executable).parent / 'composer')  # Composer's launcher, from this environment


TIER_MARKERS = ('slow', 'stack')  # the markers a gpu test may carry besides gpu


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether `-m markexpr` selects a test marked gpu (with or without the other tiers' markers)."""
    import itertools

    from _pytest.mark.expression import Expression

    if not markexpr.strip():
        return True
    expression = Expression.compile(markexpr)
    others = [set(combination) for n in range(3) for combination in itertools.combinations(TIER_MARKERS, n)]
    return any(expression.evaluate(lambda name, marks=marks: name in marks | {'gpu'}) for marks in others)


def pytest_configure(config):
    # Before any test module imports torch, which reads CUDA_VISIBLE_DEVICES when CUDA first initializes.
    if not selects_gpu_tests(config.option.markexpr):
        os.environ['CUDA_VISIBLE_DEVICES'] = ''
    # Streaming leaves its lock files (000105_barrier_filelock, ...) in the temporary folder, hundreds over the
    # suite: every test and the processes it starts use a folder of this session's, removed at its end.
    config.session_tmp = tempfile.mkdtemp(prefix='sd2-tests-')
    os.environ['TMPDIR'] = tempfile.tempdir = config.session_tmp


def pytest_unconfigure(config):
    FORK_SERVER.close()
    shutil.rmtree(getattr(config, 'session_tmp', ''), ignore_errors=True)


def skip_unless_ci(reason: str) -> None:
    """Skips a test this machine lacks a privilege or a tool for (a tmpfs mount, a mount namespace); in CI
    (CI=true), where each is there, fails instead, so that coverage cannot shrink without a red run."""
    if os.environ.get('CI') == 'true':
        pytest.fail(f'{reason}: CI must run this test', pytrace=False)
    pytest.skip(reason)


def need_mount_namespaces() -> None:
    """Skips a test that makes mount namespaces (unshare --mount) where this machine cannot; fails in CI."""
    try:
        allowed = subprocess.run(['unshare', '--mount', 'true'], capture_output=True, text=True)
    except FileNotFoundError as missing:
        skip_unless_ci(f'no unshare here: {missing}')
    if allowed.returncode:
        skip_unless_ci(f'cannot make a mount namespace here: {allowed.stderr.strip()}')


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """The gpu tier is decided by the tests selected, by their marker (not a keyword, which a parametrize id `gpu`
    also is): a selection of gpu tests with CPU tests is refused, and so is one of gpu tests on a machine without
    CUDA; neither passes by skipping them. CPU tests see no CUDA, however they were selected."""
    import torch  # here: conftest is imported before pytest_configure hides CUDA

    gpu = [item for item in items if item.get_closest_marker('gpu')]
    if config.option.collectonly:
        return
    if not gpu:
        # pytest_configure hid CUDA where the -m expression left the gpu tier out; a selection by path or -k is
        # known only now, before any test has run (CUDA reads the variable when it first initializes).
        os.environ['CUDA_VISIBLE_DEVICES'] = ''
        if torch.cuda.is_available():
            raise pytest.UsageError(
                'CUDA was initialized while the tests were collected, and CPU tests would see it: select them with '
                "-m 'not gpu'"
            )
        return
    if len(gpu) < len(items):
        raise pytest.UsageError(
            f'the selection holds {len(gpu)} test(s) of the gpu tier and {len(items) - len(gpu)} CPU test(s): CPU '
            "tests must see no CUDA and gpu tests need it; run them apart (-m gpu, -m 'not gpu')"
        )
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f'no CUDA device: the {len(items)} selected test(s) of the gpu tier need one (run them on a GPU machine)'
        )


# A lane's skips that are expected where it runs, by the start of their reasons, ';' between: a skip in CI (CI=true),
# or in a lane that names its expected skips, fails the test unless named there (the image lane: no wandb; the gpu
# tier: no xFormers build, no float8 before compute capability 8.9). Coverage cannot shrink without a red run.
EXPECTED_SKIPS = 'SD2_EXPECTED_SKIPS'


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    checked = os.environ.get('CI') == 'true' or EXPECTED_SKIPS in os.environ
    if not (report.skipped and checked) or hasattr(report, 'wasxfail'):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix('Skipped: ')
    expected = [start.strip() for start in os.environ.get(EXPECTED_SKIPS, '').split(';') if start.strip()]
    if not any(reason.startswith(start) for start in expected):
        report.outcome = 'failed'
        report.longrepr = f"skipped where skips are checked, and not among this lane's {EXPECTED_SKIPS}: {reason}"


# ------------------------------------------------------------------------------------- datasets

COLUMNS = {'jpg': 'bytes', 'caption': 'str'}  # convert.py's columns


@pytest.fixture(autouse=True)
def session_signal_handlers():
    """Each test starts with the session's Ctrl-C and SIGTERM handlers: a run ended in this process
    (guards.arguments.stop) leaves those of its exit installed, which a process ending anyway needs."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def jpeg(seed=0, size=(80, 64), mode='RGB', exif=None, **save) -> bytes:
    """A JPEG of smooth random color blobs (noise would make large, slow files)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize(size, Image.BICUBIC).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, 'JPEG', quality=90, **({'exif': exif} if exif else {}), **save)
    return buffer.getvalue()


def write_dataset(folder, samples, columns=COLUMNS, size_limit=1 << 26) -> str:
    with MDSWriter(out=str(folder), columns=columns, size_limit=size_limit) as writer:
        for sample in samples:
            writer.write(sample)
    return str(folder)


def good_samples(n, size=(80, 64)):
    return [{'jpg': jpeg(i, size), 'caption': f'photo number {i}'} for i in range(n)]


def final_weights(trainer) -> dict:
    """The UNet's weights and, with --use_ema, its average, as the run ended (name -> tensor)."""
    from ema import EMA  # here, not at the top: conftest runs before CUDA is hidden

    model = trainer.state.model
    weights = {f'unet.{name}': value.clone() for name, value in model.unet.state_dict().items()}
    for algorithm in trainer.state.algorithms:
        if isinstance(algorithm, EMA):
            with algorithm.ema_weights():
                weights.update({f'ema.{name}': value.clone() for name, value in model.unet.state_dict().items()})
    return weights


def builtin_folder(name: str) -> ModelFolder:
    """A built-in model's folder (configs/), read."""
    return read_model_folder(CONFIGS_DIR / name)


def fixed_batch(n=4, image_size=64, model_name='tiny'):
    """n synthetic samples for `model_name` with the noise, latent noise and timesteps drawn: a deterministic step."""
    import torch
    from torch.utils.data import default_collate

    from data import SyntheticImageCaptionDataset
    from settings.model_folder import caption_inputs

    dataset = SyntheticImageCaptionDataset(image_size, inputs=caption_inputs(builtin_folder(model_name)))
    batch = default_collate([dataset[i] for i in range(n)])
    generator = torch.Generator().manual_seed(1)
    latent_shape = (n, 4, image_size // 8, image_size // 8)
    return {
        **batch,
        'noise': torch.randn(latent_shape, generator=generator),
        'latent_noise': torch.randn(latent_shape, generator=generator),
        'timesteps': torch.randint(0, 1000, (n,), generator=generator),
    }


def write_t5_tokenizer(folder) -> str:
    """A small tokenizer folder that gives ids as T5's does (a SentencePiece unigram model: <pad> 0, </s> 1 appended
    to every caption, <unk> 2, words below T5's vocabulary), for tests of --tokenizer with the T5 models: T5's own
    vocabulary ships in no package here."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = 'a photo of the cat dog on red blue green small large'.split()
    pieces = [('<pad>', 0.0), ('</s>', 0.0), ('<unk>', 0.0)]
    pieces += [(f'\u2581{word}', -float(i)) for i, word in enumerate(words)]  # '\u2581' starts a word
    pieces += [(letter, -20.0) for letter in 'abcdefghijklmnopqrstuvwxyz'] + [('\u2581', -25.0)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2))
    tokenizer.normalizer = normalizers.Replace(Regex(' {2,}'), ' ')  # as T5's own tokenizer.json
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single='$A </s>', special_tokens=[('</s>', 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token='<pad>', eos_token='</s>', unk_token='<unk>'
    )
    wrapped.save_pretrained(folder)
    return str(folder)


# ------------------------------------------------------------------------------------- a faked GPU


def fake_gpu(monkeypatch, gpu) -> None:
    """Settles a run's flags as on a machine with `gpu` (a hardware.Gpu, or None for none). That machine's shared
    memory is not this one's: its check (device_checks.check_shared_memory) is left out."""
    from settings import device_checks, hardware

    monkeypatch.setattr(hardware, 'gpu', lambda: gpu)
    monkeypatch.setattr(device_checks, 'SHARED_MEMORY', '/nonexistent/shm')


# ------------------------------------------------------------------------------------- processes


def settled(argv: list[str]) -> RunConfig:
    """benchmark.py's flags settled into a run's configuration, as benchmark.cli hands it to runs.run."""
    return resolve_config(parse_args(argv))


# This process's parent of the Python commands that import Composer as they start (tests/forkserver.py), started
# on first use: a command forked from it skips the seconds of imports a new interpreter spends.
FORK_SERVER = ForkServer()


# CI's lane of the tests whose subject is a process (make test-processes) runs every command as a new interpreter:
# a forked child skips the interpreter's start and its end (os._exit after the atexit callbacks), and shares the
# fork server's hash seed.
PLAIN_PROCESSES = os.environ.get('SD2_PLAIN_PROCESSES') == '1'


def start_process(command: list, fork: bool = True, **popen) -> subprocess.Popen:
    """subprocess.Popen(command, **popen); forked from the fork server where it is one of its commands, unless the
    test is about the interpreter's own start (fork=False) or the session runs plain processes only."""
    if fork and not PLAIN_PROCESSES:
        return FORK_SERVER.popen(command, **popen)
    return subprocess.Popen(command, **popen)


def run_process(command: list, timeout: float, check: bool = False, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, ...) of start_process."""
    return run_forked(command, capture_output=True, text=True, timeout=timeout, check=check, **popen)


def run_forked(command, input=None, capture_output=False, timeout=None, check=False, **popen):
    """subprocess.run, of start_process: a command of the fork server's is forked from it."""
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with start_process(command, **popen) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:  # carries the output so far, as subprocess.run's
            process.kill()
            process.wait()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, stdout, stderr)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture
def forked_rows(monkeypatch):
    """For a script under test that runs benchmark.py once per row (benchmarks/speed_sweep.py, gpu_campaign.py):
    `forked_rows(module)` has its subprocess.run fork the row from the fork server, each row still a process of its
    own. The tests are about the rows, not an interpreter's start."""
    if PLAIN_PROCESSES:
        return lambda module: None
    return lambda module: monkeypatch.setattr(module, 'subprocess', subprocess_with(run=run_forked))


def start_job(command: list[str], cwd, fork: bool = True, env: dict | None = None) -> subprocess.Popen:
    """A command in a session and process group of its own, as a job is (os.killpg then signals all its processes),
    offline, one thread, with `env` added, its output piped."""
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', 'OMP_NUM_THREADS': '1', **(env or {})}
    piped = {'stdout': subprocess.PIPE, 'stderr': subprocess.PIPE, 'text': True}
    return start_process(command, fork=fork, cwd=cwd, env=env, start_new_session=True, **piped)


def has_ended(process: subprocess.Popen) -> bool:
    """Whether a child has ended, leaving it unreaped: until it is waited for, its pid and its process group's id name
    no other process, so that signalling its group after it ended (to end what it left running) signals nothing
    else. Once reaped, the kernel may give the pid to any new process or thread of the machine."""
    if process.returncode is not None:  # reaped already (Popen.poll, wait)
        return True
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def kill_if_unreaped(pid: int) -> None:
    """SIGKILL to a child of this process (a loader worker) unless it has been reaped: a freed pid may be another
    process's or thread's by now (kill(2) of a thread's id ends its whole process)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped, or never this process's child
        return
    os.kill(pid, signal.SIGKILL)


def loader_workers() -> set[int]:
    """The pids of this process's children that PyTorch names as its loader workers. A test picks the workers of
    the loader it started as those not alive before: an earlier test's may still be ending, and pids wrap around."""
    import psutil

    return {child.pid for child in psutil.Process().children() if child.name() == 'pt_data_worker'}


def wait_until(condition, timeout: float, what: str) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds (a hang guard)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f'not within {timeout} s: {what}')
        time.sleep(0.02)


# Ports for child processes to listen on (master ports, servers that must not answer), below the ephemeral ports the
# OS hands out (bind to port 0, a client's connect). A port is claimed with a lock held until this process ends, in a
# folder every test process of the machine uses (pytest-xdist's workers, and CI's lanes that run side by side): no
# other test process is given it between the check here and the child's bind.
PORTS = range(20000, 30000)
PORT_LOCKS = Path('/tmp/sd2-test-ports')
_port_locks = []  # open, so locked, until this process ends
_next_port = 0


def free_port() -> int:
    import fcntl

    global _next_port
    PORT_LOCKS.mkdir(exist_ok=True)
    while _next_port < len(PORTS):
        port = PORTS[_next_port]
        _next_port += 1
        lock = open(PORT_LOCKS / str(port), 'w')
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another test process's
            lock.close()
            continue
        with socket.socket() as sock:
            try:
                sock.bind(('127.0.0.1', port))
            except OSError:  # in use by something else on the machine, or still closing
                lock.close()
                continue
        _port_locks.append(lock)
        return port
    raise RuntimeError(f'no free port in {PORTS.start}-{PORTS.stop - 1}')


S3_CREDENTIALS = {'AWS_ACCESS_KEY_ID': 'testing', 'AWS_SECRET_ACCESS_KEY': 'testing', 'AWS_DEFAULT_REGION': 'us-east-1'}


def s3_client(endpoint: str):
    """A boto3 client of the test server, with its test credentials."""
    import boto3

    return boto3.client(
        's3',
        endpoint_url=endpoint,
        region_name=S3_CREDENTIALS['AWS_DEFAULT_REGION'],
        aws_access_key_id=S3_CREDENTIALS['AWS_ACCESS_KEY_ID'],
        aws_secret_access_key=S3_CREDENTIALS['AWS_SECRET_ACCESS_KEY'],
    )


def start_s3_server() -> tuple[subprocess.Popen, str]:
    """A real S3-compatible server (moto) on 127.0.0.1 with a bucket 'bucket': its process and endpoint. The server
    binds a port the OS assigns (port 0) and holds it, and says which on its log, read from a file (its request log
    would fill a pipe nobody reads): no port picked here that another process could take first."""
    import re

    log = Path(tempfile.mkstemp(prefix='moto-', suffix='.log')[1])
    with open(log, 'wb') as output:
        server = subprocess.Popen(
            [sys.executable, '-u', '-m', 'moto.server', '-H', '127.0.0.1', '-p', '0'],
            stdout=output,
            stderr=output,
        )
    deadline = time.monotonic() + 120
    while (listening := re.search(rb'Running on http://127\.0\.0\.1:(\d+)', log.read_bytes())) is None:
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise RuntimeError(f'the moto S3 server did not start: {log.read_text()[-500:]}')
        time.sleep(0.05)
    endpoint = f'http://127.0.0.1:{int(listening.group(1))}'
    s3_client(endpoint).create_bucket(Bucket='bucket')
    return server, endpoint


@pytest.fixture(scope='module')
def s3():
    """The S3 server for the module that asks; the environment points boto3 and Streaming at it. Yields its
    endpoint."""
    server, endpoint = start_s3_server()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {'S3_ENDPOINT_URL': endpoint, **S3_CREDENTIALS}.items():
            patch.setenv(key, value)
        yield endpoint
    server.terminate()
    server.wait(timeout=30)


def run_cli(*args, launcher=('composer',), env=None, timeout=600) -> subprocess.CompletedProcess:
    """benchmark.py with these flags under a launcher ('composer', or 'python' for one process) from this
    environment, offline, in the repo, its output captured."""
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline', **(env or {})}
    executable = Path(sys.executable).parent / launcher[0]
    command = [str(executable), *launcher[1:], str(REPO / 'benchmark.py'), *args]
    if launcher[0] == 'python':
        command[0] = sys.executable  # the same interpreter, which the fork server recognizes
    return run_process(command, timeout=timeout, cwd=REPO, env=env)
