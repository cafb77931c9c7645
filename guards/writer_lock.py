"""One writer per output folder. Two runs started on one --save_folder (a sweep that reused a name, a job requeued
while the first still ran), or two conversions or precomputations onto one output, each wrote as if alone: the
folder ended with both writers' files interleaved, and both exited 0. A writer now holds an exclusive lock on the
folder for its life, and a second one is refused before it writes, in one line, with exit status 2.

The lock is an flock on LOCK_FILE inside the folder, which holds the holder's pid and host for the refusal to name.
The kernel drops it when the holder's process ends in any way, SIGKILL included, so a killed writer's folder is
free again at once (a requeued --autoresume takes it over): a child forked while it is held (a loader worker, which
outlives a killed parent by a second or more) closes its copy of the descriptor at once, so that only the writer
holds it; a holder that ends normally also removes the file. Only
local folders are locked: an s3:// output is not, and two writers there still mix. On a file system where flock
does not work (some Lustre and NFS mounts), a warning says the folder is not locked and the writer goes on.
"""

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path

from guards.arguments import ConfigError

LOCK_FILE = '.writer.lock'
# The scratch folders a writability check makes and removes (settings.output_paths.check_writable_folder): another
# rank's, made while this one looks, is no output.
WRITE_CHECK_PREFIX = '.write-check-'
# flock refused by the file system itself, not by another holder.
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


# The descriptors of the locks this process holds, which a child it forks closes (drop_held_locks_in_child).
held_locks: set[int] = set()


class FolderBusy(ConfigError):
    """Another process holds the folder's lock: bad input, found before any work (exit status 2)."""


def contents(folder: Path) -> list[Path]:
    """What a folder holds besides a writer's lock file and a writability check's scratch folder."""
    return [
        path for path in folder.iterdir() if path.name != LOCK_FILE and not path.name.startswith(WRITE_CHECK_PREFIX)
    ]


@contextlib.contextmanager
def one_writer(folder: str | Path, where: str, fix: str):
    """Holds `folder`'s lock while inside (making the folder where it is missing, and removing it on the way out
    where this made it and it is empty again); raises FolderBusy where another process holds it, e.g. `--save_folder
    ckpt: another process (pid 412 on node3) is writing it; wait for it to end or stop it, or pass another
    --save_folder`, `where` naming the folder as the writer's own lines do, `fix` the way out. A folder that cannot
    be made is left to the writer's own checks, unlocked."""
    folder = Path(folder)
    created = not folder.exists()
    fd = lock(folder, where, fix)
    try:
        yield
    finally:
        if fd is not None:
            unlock(folder, fd)
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # made here, and nothing was written in it


def lock(folder: Path, where: str, fix: str) -> int | None:
    """The descriptor of the lock file, locked and naming this process; None where the folder cannot be locked."""
    path = folder / LOCK_FILE
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # a file where the folder should be, a read-only disk: the writer's checks name it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors='replace').split()
            os.close(fd)
            who = f'pid {holder[0]} on {holder[1]}' if len(holder) == 2 else 'pid unknown'
            raise FolderBusy(f'{where}: another process ({who}) is writing it; {fix}')
        except OSError as error:
            os.close(fd)
            if error.errno not in UNSUPPORTED:
                raise
            line = f'warning: {where}: cannot lock it ({error.strerror}): a second writer would not be refused'
            print(line, flush=True)
            return None
        if same_file(path, fd):
            break
        os.close(fd)  # the last holder removed the file between our open and lock: lock the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()} {socket.gethostname()}\n'.encode(), 0)
    held_locks.add(fd)
    return fd


def drop_held_locks_in_child() -> None:
    """In a child just forked: its copies of the held locks' descriptors closed (the writer keeps the lock)."""
    for fd in held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    held_locks.clear()


os.register_at_fork(after_in_child=drop_held_locks_in_child)


def same_file(path: Path, fd: int) -> bool:
    try:
        on_disk, held = path.stat(), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def unlock(folder: Path, fd: int) -> None:
    """Removes the lock file while still holding it, then lets go: a process waiting on the old file finds it gone
    and locks a new one (lock's same_file), so two never hold the folder at once."""
    with contextlib.suppress(OSError):
        if same_file(folder / LOCK_FILE, fd):
            (folder / LOCK_FILE).unlink()
    held_locks.discard(fd)
    os.close(fd)


@contextlib.contextmanager
def one_writer_on_rank_zero(folder: str | Path, where: str, fix: str):
    """one_writer for a job of several ranks (Composer's launcher, torchrun): global rank 0 holds the lock, and
    every rank raises the refusal rank 0 met, so that none waits for the others at a collective. A folder on each
    node's own disk is locked on rank 0's node only; locking it on every node would refuse the job itself where the
    folder is shared. One process: one_writer."""
    from composer.utils import dist, get_device

    if dist.get_world_size() > 1:
        dist.initialize_dist(get_device(None))  # Composer's, as the run's; it is made once
    refusal, held = [None], contextlib.ExitStack()
    with held:
        if dist.get_global_rank() == 0:
            try:
                held.enter_context(one_writer(folder, where, fix))
            except FolderBusy as busy:
                refusal = [str(busy)]
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise FolderBusy(refusal[0])
        yield
