"""Ctrl-C and SIGTERM, to one process or to every process of a job, end each script with one line and the signal's
exit status (130 for SIGINT, 143 for SIGTERM), never a traceback.

Slurm's scancel and a deleted Kubernetes pod send SIGTERM to every process of the job at once, and Ctrl-C in a
terminal sends SIGINT to every process of the foreground group: the loader workers get the signal too. PyTorch's
worker ends on a SIGTERM from anyone but its parent, and the main process then stops with `DataLoader worker
(pid ...) is killed by signal: Terminated`. Workers here (`quiet_loader_worker`, the worker_init_fn of
loaders.StoppableDataLoader) leave both signals to the main process, which handles them and shuts its workers down,
and still end on their parent's SIGTERM, which is how PyTorch and multiprocessing end workers that do not stop by
themselves.

A signal's Stopped is raised wherever the main thread is, except where stopping there would leave a mess: inside
os.fork (Python prints an exception raised in its fork hooks and goes on) and while a loader starts its workers.
There it waits (`Stops.holding`) and is raised once they are done.

Light on purpose (no torch): convert.py answers --help without loading it.
"""

import contextlib
import logging  # noqa: F401  imported first: its fork hooks must run inside ours (stops held)
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

SIGNALS = {signal.SIGINT: 'Ctrl-C (SIGINT)', signal.SIGTERM: 'SIGTERM'}


class Stopped(BaseException):
    """A run stopped by a signal; BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way
    out takes it for an error of its own."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.signum = signum
        self.exit_status = 128 + signum


class Stops:
    """This process's stops by signal. A stop is raised where the main thread is, or, while stops are held, kept
    and raised once they are not: while a DataLoader starts its workers (`holding`), and inside os.fork, where Python
    runs its fork hooks (logging's lock) and prints an exception raised there as a traceback and goes on. Signal
    handlers and fork hooks belong to the process: there is one, STOPS."""

    def __init__(self):
        self.held = 0
        self.pending: Stopped | None = None

    def stop(self, stopped: Stopped) -> None:
        """Raises `stopped` now, or where stops are held, once they are not (on leaving `holding`, or at `check`)."""
        if self.held:
            self.pending = stopped
            return
        raise stopped

    def check(self) -> None:
        """Raises the stop that came while stops were held. Called where the work can stop between two steps."""
        if self.pending is not None and not self.held:
            stopped, self.pending = self.pending, None
            raise stopped

    @contextlib.contextmanager
    def holding(self):
        """Inside, a stop waits until the end, and is raised there: for a step that must not stop halfway, as a
        DataLoader starting its workers (one stopped halfway prints a traceback as it is collected)."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
        self.check()

    @contextlib.contextmanager
    def handling(self, handle: Callable[[int], None]):
        """Inside, SIGINT and SIGTERM call handle(signum) in this process; in a child forked from it (a loader worker
        starting) they do nothing, its parent ends it. The handlers before are back after, and a stop kept from
        before or inside is forgotten."""
        owner = os.getpid()

        def on_signal(signum, frame):
            if os.getpid() == owner:
                handle(signum)

        previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
        self.pending = None
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.pending = None

    def fork_begins(self) -> None:
        self.held += 1

    def fork_ends(self) -> None:
        self.held -= 1

    def forked(self) -> None:
        self.held, self.pending = 0, None  # the child: its parent handles the stop


STOPS = Stops()
os.register_at_fork(before=STOPS.fork_begins, after_in_parent=STOPS.fork_ends, after_in_child=STOPS.forked)


@contextlib.contextmanager
def stop_on_signals(describe: Callable[[int], str]):
    """Inside, SIGINT and SIGTERM raise Stopped(signum, describe(signum)) in the main thread (or where stops are
    held, after), each time one comes: a second Ctrl-C stops the cleanup of the first, and the line is still one."""
    with STOPS.handling(lambda signum: STOPS.stop(Stopped(signum, describe(signum)))):
        yield


def quiet_loader_worker(worker_id: int) -> None:
    """A DataLoader's worker_init_fn: the worker leaves job-wide signals to its parent (leave_signals_to_parent), and
    says nothing of a parent that stopped while taking a batch from it (without_hangups_of_a_stopped_parent)."""
    leave_signals_to_parent()
    sys.excepthook = without_hangups_of_a_stopped_parent(sys.excepthook)


def without_hangups_of_a_stopped_parent(excepthook):
    """sys.excepthook for a loader worker. Multiprocessing's resource sharer hands a batch's shared memory to the
    main process over a connection; where the main process stopped (a Ctrl-C or SIGTERM) in the middle of taking
    it, the sharer's thread finds the connection gone and reports it through sys.excepthook, a traceback after the
    run's one line. That is left unsaid; any other error is reported as before."""

    def hook(kind, error, trace):
        hangup = issubclass(kind, (BrokenPipeError, ConnectionResetError))
        if hangup and any(
            frame.f_code.co_filename.endswith('resource_sharer.py') for frame, _ in traceback.walk_tb(trace)
        ):
            return
        excepthook(kind, error, trace)

    return hook


def leave_signals_to_parent() -> None:
    """This child process (a loader worker, or one Composer's checkpoint uploader spawned) ignores Ctrl-C and SIGTERM
    from anyone but its parent. SIGTERM stays blocked, and a thread of its own waits for it: only the parent's
    (multiprocessing's terminate, at the main process's exit) ends the child, quietly, as PyTorch's own handler ends a
    loader worker; a job-wide one is left to the main process, which stops its run and then its children. Called
    before the child starts threads of its own, which inherit the mask."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=end_on_parents_sigterm, name='sigterm-from-parent', daemon=True).start()


def end_on_parents_sigterm() -> None:
    """Ends this process on its parent's SIGTERM, or once its parent is gone (killed outright, say: a pool worker of
    Composer's uploader would otherwise wait on its queue for ever, SIGTERM blocked)."""
    parent = os.getppid()
    while True:
        sent = signal.sigtimedwait({signal.SIGTERM}, 1.0)
        if os.getppid() != parent or (sent is not None and sent.si_pid == parent):
            os._exit(0)
