"""Streaming 0.13, made to fail loudly and to share a machine. Its faults, each seen, and what is done here:

- A download that fails in Streaming's background threads only ends the epoch early, and a run exits 0 with a
  throughput: `CheckedStreamingDataset` ends the iteration with DataError, stops the node's other workers and
  ranks at once, and wakes the threads that waited forever for a shard whose download failed.
- s3transfer and botocore retry inside each of Streaming's retries, nothing retries a bucket that throttles, and
  loader workers forked after the index's download shared its connection: `S3DownloaderOneTransferAttempt`.
- Two jobs starting at the same moment picked the same shared-memory prefix: `get_shm_prefix_one_job_at_a_time`.
- Its default cache folder refuses to start after a killed run (`default_cache_dir`), and its cleaner removes a
  live job's shared memory (`clean_stale_shared_memory`).
- Each of its shared-memory blocks stays mapped, with its descriptors, until the process exits (an atexit handler
  holds every block), and each new dataset attaches to every other dataset's block to pick its prefix: a process
  building dataset after dataset kept 216 more descriptors for each new one, and the test suite in two processes
  ran out (`OSError: [Errno 24] Too many open files` at 20,000). The prefix check's attachments are closed once
  read (`close_prefix_check_attachments`), and each block's own descriptor once it is mapped
  (`close_descriptor_once_mapped`).
- A dataset's index names the files Streaming writes into its cache, as they are: `check_index_before_use`.

The patches are installed when this module is imported (data.py imports it), where Streaming looks them up, each
through guards/library_patches.py (`install`, `replaced`): a Streaming whose names changed stops the program in one
line.
Private names of Streaming used here (`_ShardState`, `_get_path`, `_check_and_find`, the thread methods) are
those of the pinned 0.13.0; `Stream.get_shards` is public.
"""

import atexit
import contextlib
import fcntl
import functools
import hashlib
import itertools
import os
import random
import shutil
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError, ConnectionClosedError
from composer.utils import dist
from streaming import StreamingDataset
from streaming.base import dataset as streaming_dataset
from streaming.base import util as streaming_util
from streaming.base.dataset import _ShardState
from streaming.base.shared import prefix as streaming_prefix
from streaming.base.shared.memory import SharedMemory as StreamingSharedMemory
from streaming.base.shared.prefix import _get_path, get_shm_prefix
from streaming.base.storage import download as streaming_download
from streaming.base.storage.download import S3Downloader
from streaming.base.stream import Stream

from guards.library_patches import install, replaced
from guards.outputs import DISK_FULL
from settings.dataset_checks import (
    RETRIES,
    DataError,
    check_columns,
    check_dataset,
    is_remote,
    read_index,
    read_timeout,
    shard_hash_mismatch,
)

# What an object store answers when it is busy or briefly failing: botocore's error codes of throttling and the
# status codes of a server's transient errors. Real buckets throttle this way under load (503 SlowDown).
THROTTLING_CODES = {'SlowDown', 'Throttling', 'ThrottlingException', 'RequestLimitExceeded', 'TooManyRequests'}
TRANSIENT_STATUS = {429, 500, 502, 503, 504}
THROTTLED_ATTEMPTS, THROTTLED_BACKOFF, THROTTLED_MAX_SLEEP = 8, 0.25, 4.0


def is_throttled(error: BaseException) -> bool:
    if isinstance(error, ConnectionClosedError):  # a connection reset by the server mid-request
        return True
    if not isinstance(error, ClientError):
        return False
    code = error.response.get('Error', {}).get('Code')
    return (
        code in THROTTLING_CODES or error.response.get('ResponseMetadata', {}).get('HTTPStatusCode') in TRANSIENT_STATUS
    )


def retry_throttled(call, attempts: int = THROTTLED_ATTEMPTS, sleep=time.sleep):
    """call(), again after each throttling or transient error (is_throttled), at most `attempts` times, waiting a
    random time below an exponentially growing cap between tries (full jitter, under 16 s in all). Not botocore's
    retry modes: they also retry a read that timed out, which would multiply the time a hung server takes to be
    reported (Streaming's own tries bound that)."""
    for attempt in range(attempts):
        try:
            return call()
        except (ClientError, ConnectionClosedError) as error:
            if not is_throttled(error) or attempt == attempts - 1:
                raise
        sleep(random.uniform(0, min(THROTTLED_MAX_SLEEP, THROTTLED_BACKOFF * 2**attempt)))


class S3DownloaderOneTransferAttempt(S3Downloader):
    """Streaming's S3 downloader, less the retries it inherits from boto3, plus retries of throttling, with a client
    of each process's own. s3transfer retries a GET whose body stops arriving 5 times (TransferConfig's default,
    kept by Streaming), inside each of Streaming's tries, and botocore retries each request (3 attempts by
    default): a server that hung in the middle of a download was reported after up to 15 reads of 20 s (seen:
    122 s, not the 55 s of a hang between downloads). One attempt in each leaves Streaming's download_retry the
    only retries of a hang or an error; retry_throttled retries what a busy bucket answers, inside each of them."""

    _client_pid: int | None = None

    def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
        # The dataset downloads its index in the main process, and loader workers are forked with that client and
        # its open keep-alive connection: two workers sending on one socket each read the other's answer, and a
        # shard was cached with another shard's bytes. Streaming made a new client only after a failed try, which
        # retry_throttled now saves it from; each process makes its own here.
        if self._client_pid != os.getpid():
            self._s3_client = None
        super()._download_file_impl(remote, local, timeout)

    def _create_s3_client(self, unsigned: bool = False, timeout: float | None = None) -> None:
        from boto3.session import Session
        from botocore import UNSIGNED
        from botocore.config import Config

        # Streaming's own client less botocore's retries: this client's alone, where AWS_MAX_ATTEMPTS set for the
        # process would also take them from Composer's checkpoint uploads.
        config = Config(
            read_timeout=read_timeout() if timeout is None else timeout,
            retries={'mode': 'standard', 'total_max_attempts': 1},
        )
        if unsigned:
            config = config.merge(Config(signature_version=UNSIGNED))
        self._s3_client = Session().client('s3', config=config, endpoint_url=os.environ.get('S3_ENDPOINT_URL'))
        self._client_pid = os.getpid()
        download_file = self._s3_client.download_file

        def download_file_once(*args, Config=None, **kwargs):  # noqa: N803 (boto3's name)
            Config = Config or TransferConfig()  # noqa: N806
            Config.num_download_attempts = 1
            return retry_throttled(lambda: download_file(*args, Config=Config, **kwargs))

        self._s3_client.download_file = download_file_once


replaced(streaming_download, 'DOWNLOADER_MAPPINGS', (), 'S3 downloads retried once per attempt, a client per process')
streaming_download.DOWNLOADER_MAPPINGS[S3Downloader._client_identifier()] = S3DownloaderOneTransferAttempt


def check_index_before_use(get_shards):
    """Streaming's Stream.get_shards (which downloads the index and makes a reader of each shard it lists), then the
    index checked as untrusted input (dataset_checks.read_index) before anything reads or writes a file it names:
    Streaming joins the names to the cache folder as they are, and a shard named `../x` was written outside it."""

    @functools.wraps(get_shards)
    def get_checked_shards(self, world, allow_unsafe_types):
        shards = get_shards(self, world, allow_unsafe_types)
        folder = os.path.join(self.local, self.split or '')
        remote = os.path.join(self.remote, self.split or '') if self.remote and not is_remote(self.remote) else None
        read_index(self.remote or self.local, folder, tuple(f for f in (folder, remote) if f))
        return shards

    return get_checked_shards


install(
    Stream,
    'get_shards',
    ('world', 'allow_unsafe_types'),
    'its index checked as untrusted input',
    check_index_before_use,
)


class NodeStopEvent(threading.Event):
    """Streaming's stop event for the threads of one loader worker, which also reads as set once a failure is
    recorded at `failure_path` by any worker or rank on the node (see CheckedStreamingDataset._record_failure).
    Streaming's threads and yield loop poll is_set, so they stop within a tick."""

    def __init__(self, failure_path: str):
        super().__init__()
        self.failure_path = failure_path

    def is_set(self) -> bool:
        return super().is_set() or os.path.exists(self.failure_path)


def get_shm_prefix_one_job_at_a_time(streams_local, streams_remote, world, *args, **kwargs):
    """Streaming's get_shm_prefix, with a machine-wide lock held by each job's local leader. Streaming picks the
    first shared-memory prefix no other dataset uses, then creates its `_locals` entry: two jobs starting at the
    same moment could pick the same one, and the second then stopped with `FileExistsError: '/000105_locals'`.
    Under the lock the second job sees the first's entry and picks the next prefix. The other ranks of a job only
    look up their leader's entry, so they take no lock (and cannot block a barrier their leader waits at)."""
    if not world.is_local_leader:
        return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
    with prefix_lock():
        return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)


@contextlib.contextmanager
def prefix_lock():
    """The machine-wide lock under which a job picks and registers its shared-memory prefix, and under which
    clean_stale_shared_memory looks for segments no process maps (so that it never sees one mid-registration)."""
    # Beside the segments it guards, which are the machine's: in TMPDIR, two jobs given different ones (two test
    # processes, say) each took a lock of their own and picked the same prefix (FileExistsError). Opened
    # read-only, which flock needs no more than: another user's jobs share the file (made 0o666 less umask).
    shm = Path('/dev/shm')
    path = (shm if shm.is_dir() else Path(tempfile.gettempdir())) / 'sd2-streaming-prefix.lock'
    lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        wait_for_lock(lock, path)  # released when the file closes
        yield
    finally:
        os.close(lock)


# The holder keeps the lock while its own ranks reach Streaming's barrier in get_shm_prefix: seconds, or as long as
# its slowest rank takes to build its dataset. A holder stuck for longer is stuck for good, and waiting on it would
# hang this job without a word.
PREFIX_LOCK_WAIT_SECONDS = 600


def wait_for_lock(lock: int, path: Path, seconds: float = PREFIX_LOCK_WAIT_SECONDS) -> None:
    """Takes the exclusive flock on `lock`, or raises DataError naming the lock after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DataError(
                    f'{path}: another job on this machine has held the Streaming prefix lock for {seconds:.0f} s '
                    f'(a job stuck while building its dataset): end that job (lsof {path} names its process)'
                ) from None
            time.sleep(0.05)


install(  # in streaming.base.dataset, where StreamingDataset looks it up
    streaming_dataset,
    'get_shm_prefix',
    ('streams_local', 'streams_remote', 'world'),
    'one job at a time picks a prefix',
    lambda original: get_shm_prefix_one_job_at_a_time,
)


def close_descriptor_once_mapped(init):
    """Streaming's SharedMemory.__init__, then the block's file descriptor closed: the mapping stays valid without
    it (POSIX), and Python's own close() skips a descriptor already closed (-1)."""

    @functools.wraps(init)
    def init_and_close(self, *args, **kwargs):
        init(self, *args, **kwargs)
        block = self.shm
        if getattr(block, '_fd', -1) >= 0:
            os.close(block._fd)
            block._fd = -1

    return init_and_close


install(
    StreamingSharedMemory,
    '__init__',
    ('name', 'create', 'size'),
    "each block's descriptor closed once mapped",
    close_descriptor_once_mapped,
)


def close_prefix_check_attachments(check):
    """Streaming's prefix check (`_check_and_find`), with the blocks it attaches to only to read them (every other
    dataset's `_locals`) closed when it returns, rather than kept mapped until the process exits."""

    @functools.wraps(check)
    def check_and_close(*args, **kwargs):
        attached, attach = [], streaming_prefix.SharedMemory

        def attach_for_the_check(name, create=None, size=0, auto_cleanup=True):
            block = attach(name, create, size, auto_cleanup=False)
            attached.append(block)
            return block

        streaming_prefix.SharedMemory = attach_for_the_check
        try:
            return check(*args, **kwargs)
        finally:
            streaming_prefix.SharedMemory = attach
            for block in attached:
                block.cleanup()  # attached, not created: closed, not unlinked

    return check_and_close


install(
    streaming_prefix,
    '_check_and_find',
    ('streams_local', 'streams_remote', 'shm_name'),
    "the prefix check's attachments closed",
    close_prefix_check_attachments,
)


for thread_method in ('_prepare_thread', '_ready_thread'):  # overridden below, to keep a download's failure
    replaced(StreamingDataset, thread_method, ('it',), 'a failed download ends the epoch with an error')


class CheckedStreamingDataset(StreamingDataset):
    """Streaming's dataset over a checked location (see resolve_location), whose shards must hold the columns
    the subclass reads; and a download that fails in its background threads (a remote that died, a shard
    gone from the cache) ends the iteration with DataError. Streaming 0.13 only stops yielding samples then, as
    at the end of an epoch, and Composer counts the epoch done: a run would end early, exit 0, and report a
    throughput. A failed download also no longer leaves its shard waited for forever (see prepare_shard). The
    thread methods and shard states used here are Streaming's own (private in the pinned version)."""

    precomputed = False  # which columns the shards must hold (check_columns)
    _background_error: BaseException | None = None

    def __init__(
        self,
        *,
        remote: str | None = None,
        local: str | None = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 17,
        download_retry: int = RETRIES,
        download_timeout: float | None = None,
        **streaming_kwargs,
    ):
        download_timeout = read_timeout() if download_timeout is None else download_timeout
        remote, local = resolve_location(remote, local, download_retry, download_timeout)
        self.location, self.cache = remote or local, local  # the cache: where a remote's shards are copied
        super().__init__(
            remote=remote,
            local=local,
            batch_size=batch_size,
            shuffle=shuffle,
            shuffle_seed=seed,
            download_retry=download_retry,
            download_timeout=download_timeout,
            **streaming_kwargs,
        )
        for shard in self.shards:
            columns, encodings = getattr(shard, 'column_names', None), getattr(shard, 'column_encodings', None)
            check_columns(self.location, shard.raw_data.basename, columns, self.precomputed, encodings)
        self._hashed_shards = set()  # the shards whose hash this process has checked (_check_shard_hash)
        self._failure_path = os.path.join(self._filelock_root, _get_path(self._shm_prefix_int, 'read_failure'))
        if self._unique_rank_world.is_local_leader:  # one left by a run killed before it could remove it
            Path(self._failure_path).unlink(missing_ok=True)
            atexit.register(Path(self._failure_path).unlink, missing_ok=True)

    def _prepare_thread(self, it) -> None:
        self._keep_failure(super()._prepare_thread, it)

    def _ready_thread(self, it) -> None:
        self._keep_failure(super()._ready_thread, it)

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        if (failure := self._failure_elsewhere()) is not None:  # not one more download of a dead remote
            raise failure
        try:
            super().prepare_shard(shard_id, blocking)
        except BaseException as error:
            failure = None
            if isinstance(error, Exception):  # not Ctrl-C
                if self.streams[self.stream_per_shard[shard_id]].remote is None:  # nowhere to fetch it from
                    name = self.shards[shard_id].raw_data.basename
                    failure = DataError(
                        f'{self.location}: shard {name} is gone or unreadable; it was whole at start (deleted, '
                        'moved or cut short while the run read it?)'
                    )
                else:
                    failure = self._reading_failed(error)
                self._record_failure(failure)  # before the shard state changes, which wakes the waiting workers
            # Streaming leaves a shard whose download failed in its PREPARING state, and every thread or loader
            # worker that needs the shard waits for it forever, idle, after a server dies.
            # Marked remote again, they wake, find the failure recorded, and stop with it.
            if self._shard_states[shard_id] == _ShardState.PREPARING:
                self._shard_states[shard_id] = _ShardState.REMOTE
            if failure is None:
                raise
            raise failure from error

    def _keep_failure(self, thread, it) -> None:
        try:
            thread(it)
        except Exception as error:  # kept for __iter__, which names it; no thread traceback on the console
            self._background_error = error
            self._record_failure(self._reading_failed(error))
            self._event.set()  # as Streaming does on a thread's failure: the other threads and the yield loop stop
            # A thread that raises never reports its exit, and the iterator's exit() waited for it forever when
            # the yield loop ended first: loader workers hung, idle, after a server died.
            it.on_exit()

    def __iter__(self):
        if (failure := self._failure_elsewhere()) is not None:
            raise failure
        if not hasattr(self, '_event'):  # made here, in the loader worker, as Streaming makes its own
            self._event = NodeStopEvent(self._failure_path)
        yield from super().__iter__()
        # Streaming's yield loop ends quietly, as at the end of the epoch, when its event is set.
        if self._background_error is not None:
            raise self._reading_failed(self._background_error)
        if (failure := self._failure_elsewhere()) is not None:
            raise failure

    def get_item(self, sample_id: int, retry: int = 7):
        try:
            shard_id = self.spanner[sample_id][0]
            if shard_id not in self._hashed_shards:  # its bytes checked before Streaming's reader reads them
                if not self._shard_is_cached(shard_id):
                    self.prepare_shard(shard_id)  # what Streaming's get_item does on finding no file
                self._check_shard_hash(shard_id)
            return super().get_item(sample_id, retry)
        except DataError:
            raise
        except Exception as error:  # a shard deleted or cut short since the checks at start, a failed download
            if self._background_error is not None:  # Streaming's get_item only says a thread failed
                failure = self._reading_failed(self._background_error)
            else:
                failure = self._failure_elsewhere() or self._reading_failed(error, sample_id)
            self._record_failure(failure)
            raise failure from error

    def _check_shard_hash(self, shard_id: int) -> None:
        """A shard's bytes against the hash index.json records, the first time this process reads from it.
        Streaming's validate_hash checks only what it downloads, never a local dataset's shards, and not a cached
        shard damaged after its download; a damaged shard trained on silently, its samples decoding to other
        pixels. Each loader worker hashes the shards it reads once per process (xxh64: about 11 GB/s)."""
        if shard_id in self._hashed_shards:
            return
        stream = self.streams[self.stream_per_shard[shard_id]]
        for raw, _ in self.shards[shard_id].file_pairs:
            path = Path(stream.local, stream.split or '', raw.basename)
            if not path.is_file():  # evicted or deleted: Streaming's get_item fetches it, or says it is gone
                return
            if (failure := shard_hash_mismatch(self.location, path, raw.hashes)) is not None:
                self._record_failure(failure)
                raise failure
        self._hashed_shards.add(shard_id)

    def _shard_is_cached(self, shard_id: int) -> bool:
        stream = self.streams[self.stream_per_shard[shard_id]]
        folder = Path(stream.local, stream.split or '')
        return all((folder / raw.basename).is_file() for raw, _ in self.shards[shard_id].file_pairs)

    # A read that fails in one loader worker or rank must stop the others on the node at once. The loader hands
    # batches over in worker order, so the run waits on the next worker's batch, not on the one that failed; and
    # that worker, woken by the shard marked remote again, fetched it itself: against a hung server, a second
    # round of timeouts before the run ended. The first failure is kept in a file
    # beside Streaming's locks, named with its shared-memory prefix, so one per dataset per node.

    def _record_failure(self, failure: DataError) -> None:
        """Keep the first failure on the node; written whole, then linked, so no reader sees half a line."""
        partial = f'{self._failure_path}.{os.getpid()}.{threading.get_ident()}'
        try:
            Path(partial).write_text(str(failure))
            os.link(partial, self._failure_path)
        except FileExistsError:
            pass
        except OSError:  # the temporary folder is full too (the failure may be that): each process meets its own
            pass
        finally:
            with contextlib.suppress(OSError):
                os.remove(partial)

    def _failure_elsewhere(self) -> DataError | None:
        # Checked for every sample (prepare_shard): a stat while there is no failure, not an open that raises.
        if not os.path.exists(self._failure_path):
            return None
        try:
            return DataError(Path(self._failure_path).read_text())
        except FileNotFoundError:  # removed at exit in between
            return None

    def _reading_failed(self, error: BaseException, sample_id: int | None = None) -> DataError:
        if isinstance(error, DataError):
            return error
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ''
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return DataError(
                f'{self.location}: caching shards in {self.cache} failed: {error.strerror}; free space there, or '
                'pass --local a folder on a disk with room (without --local the cache is in TMPDIR)'
            )
        if sample_id is None:
            return DataError(f'{self.location}: reading shards failed: {type(error).__name__}: {reason}')
        shard_id, row = self.spanner[sample_id]
        shard = self.shards[shard_id].raw_data.basename
        return DataError(f'{self.location}: reading shard {shard} (row {row}) failed: {type(error).__name__}: {reason}')

    def where(self, sample_id: int) -> str:
        shard_id, row = self.spanner[sample_id]
        return f'{sample_id} (shard {self.shards[shard_id].raw_data.basename}, row {row}, of {self.location})'


def resolve_location(remote: str | None, local: str | None, retries: int, timeout: float) -> tuple[str | None, str]:
    """(remote, local) for Streaming, checked: a bare folder is read in place rather than copied to a cache,
    and a remote without a local folder gets a fresh cache folder of its own."""
    if remote is not None and not urllib.parse.urlparse(remote).scheme and local is None:
        remote, local = None, remote
    if remote is None and local is None:
        raise DataError('no dataset: pass a remote (s3://bucket/path) and/or a local folder')
    if remote is not None and local is None:
        local = default_cache_dir(remote)
    check_dataset(remote, local, retries=retries, timeout=timeout)
    return remote, local


_instances = itertools.count()


def default_cache_dir(remote: str) -> str:
    """A fresh cache folder for a remote, one per job and dataset instance, removed at exit.

    Streaming's own default (tempdir/hash(remote)) refuses to start when that folder exists, as after a
    killed run. The ranks of a node must agree on the folder: they share the launcher (composer,
    torchrun) as parent, so its pid names the job. Folders of jobs no longer alive are removed here.
    """
    job = os.getppid() if int(os.environ.get('LOCAL_WORLD_SIZE', '1')) > 1 else os.getpid()
    root = Path(tempfile.gettempdir()) / 'sd2-streaming'
    folder = root / f'{job}-{next(_instances)}-{hashlib.blake2s(remote.encode(), digest_size=6).hexdigest()}'
    if int(os.environ.get('LOCAL_RANK', '0')) == 0:
        for old in root.glob('*-*-*'):
            if old.name.split('-')[0].isdigit() and not pid_alive(int(old.name.split('-')[0])):
                shutil.rmtree(old, ignore_errors=True)
        atexit.register(shutil.rmtree, folder, True)
    return str(folder)


def clean_stale_shared_memory() -> None:
    """Removes the shared memory of Streaming datasets whose processes died (a killed run's would block the next),
    and nothing else. Streaming's own clean_stale_shared_memory removes every dataset's on the machine, a live
    job's too: a second job starting beside a running one crashed (FileNotFoundError) or made it fail. On Linux
    a segment is stale when no process of ours maps it; elsewhere Streaming's cleaner runs. Local rank 0 cleans
    while the node's other ranks wait."""
    shm = Path('/dev/shm')
    if not (shm.is_dir() and Path('/proc/self/maps').is_file()):
        streaming_util.clean_stale_shared_memory()
        return
    if dist.get_local_rank() == 0:
        with prefix_lock():
            for path in stale_segments(shm):
                path.unlink(missing_ok=True)
    dist.barrier()


def stale_segments(shm: Path) -> list[Path]:
    """This user's Streaming segments (`000105_locals`, `000105_barrier`, ...) of prefixes no process maps any
    segment of. By prefix, not by segment: a live dataset creates its other segments after registering its
    `_locals` (which it maps at once, under prefix_lock), and one of them seen between its creation and its mapping
    was removed from under it (seen: FileExistsError in a dataset built beside a starting job)."""
    segments = [path for path in shm.glob('[0-9]' * 6 + '_*') if owned(path)]
    mapped = set()  # /proc/PID/maps lines end with the mapped file: ... /dev/shm/000000_locals
    for maps in Path('/proc').glob('[0-9]*/maps'):
        try:
            lines = [line for line in maps.read_text().splitlines() if '/dev/shm/' in line]
        except OSError:  # a process that ended, or another user's
            continue
        mapped.update(line.rsplit('/dev/shm/', 1)[1].split()[0] for line in lines)
    live = {name[:6] for name in mapped}
    return [path for path in segments if path.name[:6] not in live]


def owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:  # removed by its job meanwhile
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
