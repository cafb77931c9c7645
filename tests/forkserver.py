"""A parent process for the tests' Python commands: torch, Composer, Diffusers, Streaming and this repo's entry points
imported once, then a child forked per command (`python script.py ...`, `python -m module ...`) that runs it as a
new interpreter would after those imports. A new interpreter spends about 6 CPU-seconds importing
them, before the few seconds most of these commands then run.

The child gets the command's standard streams, folder, environment and session, the signal handlers those imports
install (Composer's), fresh stdio objects and temporary folder; it exits as `python` does (SystemExit's code, 1 on
an exception, killed by SIGINT on an uncaught Ctrl-C), after non-daemon threads and atexit callbacks. Commands that
are about the interpreter's own start (what a first import installs, what loads before torch) run as plain
processes (conftest.start_process's `fork=False`).

    python tests/forkserver.py SOCKET   # the parent: serves until its own parent (the pytest process) ends
"""

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ('runs.run', 'runs.precomputing', 'runs.generation', 'runs.launcher', 'composer.cli.launcher', 'benchmark')
PRELOAD += ('precompute', 'generate')
LENGTH = struct.Struct('!I')  # a request's size, before it
STATUS = struct.Struct('!i')  # a pid when forked, then os.waitpid's status when the child ends


# ------------------------------------------------------------------------------------- the parent


def serve(address: str) -> None:
    sys.path[0] = str(REPO)  # as for `python benchmark.py`: this repo's modules, not tests/'
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    count_once_for_every_child()
    global AT_START
    AT_START = process_state()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + '.part')
    listener.listen(64)
    os.rename(address + '.part', address)  # ready: the client connects once this name exists
    wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears a child end
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_read, selectors.EVENT_READ)
    # A child's connection: while it runs, then, once it has ended, until the test has its status and closes it;
    # only then is the child reaped. Until then its pid (and its group's id) can name no other process, as for a
    # plain subprocess, which stays a zombie until waited for: a test signalling a job that has just ended signals
    # nothing, not whatever process the kernel gave the freed pid to next.
    children: dict[int, socket.socket] = {}
    ended: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                try:
                    request, fds = receive_request(connection)
                except (OSError, ValueError):  # the test that asked is gone: nothing to start
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        for open_socket in (listener, *children.values(), *ended.values(), connection):
                            open_socket.close()
                        selector.close()
                        os.close(wakeup_read)
                        os.close(wakeup_write)
                        run_child(request, fds, handlers)  # ends the process
                    finally:
                        os._exit(127)  # the command could not be started (its folder gone, say)
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                with contextlib.suppress(OSError):  # a test gone meanwhile: the child runs on, reaped below
                    connection.sendall(STATUS.pack(pid))
            elif key.fileobj == wakeup_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wakeup_read, 512):
                        pass
            else:  # an ended child's test has closed its end (or is gone): the child is reaped
                selector.unregister(key.fileobj)
                reap(key.data, ended)
        report_ended(children, ended, selector)


def count_once_for_every_child() -> None:
    """What most of the tests' runs compute the same as they start, computed here for every child (as a new
    interpreter's run would compute it, once per process: models.parts.FORWARD_FLOPS, settings.tokenizer): the built-in
    tokenizer, and the tiny model's FLOPs at the tests' two image sizes, online and from precomputed latents. On the
    meta device: no computation, so no thread pool started before a fork."""
    from models.stable_diffusion import build_model
    from settings.model_folder import CONFIGS_DIR
    from settings.tokenizer import CaptionTokenizer

    CaptionTokenizer().ids('a photo')
    for precomputed in (False, True):
        model = build_model(CONFIGS_DIR / 'tiny', precomputed=precomputed, init_device='meta')
        for size in (32, 64):
            model.forward_flops(size, size)


def report_ended(children: dict[int, socket.socket], ended: dict[int, socket.socket], selector) -> None:
    """Sends each ended child's exit status to its test, leaving the child unreaped until the test closes."""
    for pid in list(children):
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            continue
        ended[pid] = connection = children.pop(pid)
        try:
            connection.sendall(STATUS.pack(wait_status(info)))
            selector.register(connection, selectors.EVENT_READ, pid)
        except OSError:  # the test that started it is gone
            reap(pid, ended)


def wait_status(info: os.waitid_result) -> int:
    """os.waitpid's status word of what os.waitid reported."""
    if info.si_code == os.CLD_EXITED:
        return (info.si_status & 0xFF) << 8
    return info.si_status | (0x80 if info.si_code == os.CLD_DUMPED else 0)


def reap(pid: int, ended: dict[int, socket.socket]) -> None:
    os.waitpid(pid, 0)
    ended.pop(pid).close()


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, LENGTH.size, 3)
    (size,) = LENGTH.unpack(header)
    return json.loads(receive_exactly(connection, size)), fds


def receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b''
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError('the fork server closed the connection')
        data += chunk
    return data


# ------------------------------------------------------------------------------------- the child


def run_child(request: dict, fds: list[int], handlers: dict) -> None:
    import atexit
    import io
    import tempfile
    import threading
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request['new_session']:
        os.setsid()
    signal.set_wakeup_fd(-1)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    tempfile.tempdir = None  # read again from this command's TMPDIR
    if (request['kind'], request['target']) in LAUNCHERS:
        fork_ranks_from_here(handlers)
    unbuffered = '-u' in request['options'] or bool(os.environ.get('PYTHONUNBUFFERED'))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, 'r', closefd=False)), encoding='utf-8')
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, 'w', closefd=False) if unbuffered else io.BufferedWriter(io.FileIO(1, 'w', closefd=False)),
        encoding='utf-8',
        line_buffering=os.isatty(1),
        write_through=unbuffered,
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, 'w', closefd=False), encoding='utf-8', errors='backslashreplace', line_buffering=True
    )
    status, interrupted = 0, False
    try:
        run_command(request)
    except SystemExit as exit:
        status = exit_status(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()  # as at an interpreter's end: non-daemon threads, then atexit callbacks
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def run_command(request: dict) -> None:
    import runpy

    kind, target, arguments = request['kind'], request['target'], request['arguments']
    if kind == 'script':
        sys.argv = [target, *arguments]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name='__main__')
    elif kind == 'module':
        sys.argv = [target, *arguments]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name='__main__', alter_sys=True)
    else:  # a console script: its entry point called, as the script does
        import importlib

        sys.argv = arguments
        sys.path[0] = os.path.dirname(arguments[0])
        module, function = target.split(':')
        sys.exit(getattr(importlib.import_module(module), function)())


# ------------------------------------------------------------------------------------- a launcher's ranks

# Composer's launcher, run by a child, forks its ranks from itself (it has imported everything they import) rather
# than starting new interpreters. Each rank is still the launcher's child, in its session and process group, with the
# streams, folder and environment Composer gives it; it begins as the server's children do, with what the launcher
# changed in the process (its logging, its temporary folder's cleanup) undone.
LAUNCHERS = {('entry', 'composer.cli.launcher:main'), ('module', 'runs.launcher')}
AT_START: dict = {}  # process_state() of the server, once it has imported and counted


def process_state() -> dict:
    import logging
    import weakref

    loggers = logging.Logger.manager.loggerDict.items()
    return {
        'root': (list(logging.root.handlers), logging.root.level),
        'levels': {name: logger.level for name, logger in loggers if isinstance(logger, logging.Logger)},
        'finalizers': set(weakref.finalize._registry),
    }


def as_at_start() -> None:
    """The server's logging back; what the launcher registered for its exit (its temporary folder's cleanup) left."""
    import logging
    import weakref

    logging.root.handlers[:], level = AT_START['root']
    logging.root.setLevel(level)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            logger.setLevel(AT_START['levels'].get(name, logging.NOTSET))
    for finalizer in list(weakref.finalize._registry):
        if finalizer not in AT_START['finalizers']:
            finalizer.detach()


def fork_ranks_from_here(handlers: dict) -> None:
    from composer.cli import launcher

    RankPopen.handlers = handlers
    launcher.subprocess = subprocess_with(Popen=RankPopen)


class RankPopen(subprocess.Popen):
    """subprocess.Popen of a rank: forked from this process where the rank's command is one the server forks."""

    handlers: dict = {}

    def __init__(self, args, **kwargs):
        self._request = parse_command(list(args), kwargs.get('cwd'))
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):  # fmt: skip
        if self._request is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)  # fmt: skip
        # rest: restore_signals, gid, gids, uid, umask, start_new_session, process_group
        request = child_request(self._request, cwd, env, start_new_session=rest[-2])
        for stream in (sys.stdout, sys.stderr):  # else the rank would write what the launcher has not yet
            stream.flush()
        pid = os.fork()
        if pid == 0:
            try:
                standard = (p2cread, c2pwrite, errwrite)
                fds = [os.dup(fd if fd != -1 else number) for number, fd in enumerate(standard)]
                as_at_start()
                run_child(request, fds, self.handlers)  # ends the process
            finally:
                os._exit(127)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------- the tests' side


# The commands forked: those whose process imports Composer as it starts (benchmark.py once its flags are settled),
# so that a child with Composer's signal handlers is the process the command would be. Others run as new processes.
FORKED_SCRIPTS = {REPO / name for name in ('benchmark.py', 'precompute.py', 'generate.py', 'tests/two_rank_probe.py')}
FORKED_MODULES = {'runs.launcher'}
# Console scripts of this environment, as their entry points: Composer's launcher.
ENTRY_POINTS = {str(Path(sys.executable).parent / 'composer'): 'composer.cli.launcher:main'}


def parse_command(args: list[str], cwd) -> dict | None:
    """`python [-u] script|-m module args...` as a request, or None for anything else: another program, other
    interpreter options, a command not above (a script outside this repo would find this repo's modules loaded)."""
    if args and os.fspath(args[0]) in ENTRY_POINTS:
        target = ENTRY_POINTS[os.fspath(args[0])]
        return {'options': [], 'kind': 'entry', 'target': target, 'arguments': [os.fspath(args[0]), *args[1:]]}
    if not args or os.fspath(args[0]) != sys.executable:
        return None
    options, rest = [], [os.fspath(arg) for arg in args[1:]]
    while rest and rest[0] == '-u':
        options.append(rest.pop(0))
    if len(rest) >= 2 and rest[0] == '-m' and rest[1] in FORKED_MODULES:
        return {'options': options, 'kind': 'module', 'target': rest[1], 'arguments': rest[2:]}
    if rest and (Path(cwd or os.getcwd()) / rest[0]).resolve() in FORKED_SCRIPTS:
        return {'options': options, 'kind': 'script', 'target': rest[0], 'arguments': rest[1:]}
    return None


def child_request(command: dict, cwd, env, start_new_session) -> dict:
    """A parsed command (parse_command) with what Popen was given for it: its folder, environment and session."""
    environment = os.environ if env is None else env
    return {
        **command,
        'cwd': os.fspath(cwd) if cwd is not None else os.getcwd(),
        'env': {os.fsdecode(key): os.fsdecode(value) for key, value in environment.items()},
        'new_session': bool(start_new_session),
    }


def subprocess_with(**replaced):
    """A copy of the subprocess module with these names replaced, for one module to use in place of it."""
    copy = type(subprocess)('subprocess')
    copy.__dict__.update({name: value for name, value in vars(subprocess).items() if not name.startswith('__')})
    copy.__dict__.update(replaced)
    return copy


class ForkedPopen(subprocess.Popen):
    """subprocess.Popen of a command the fork server's child runs: pipes, communicate, wait, poll and signals as for
    any child; its exit status comes from the server, the process being the server's child."""

    def __init__(self, address: str, request: dict, args, **kwargs):
        self._address, self._request, self._status_bytes = address, request, b''
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):  # fmt: skip
        start_new_session = rest[-2]  # restore_signals, gid, gids, uid, umask, start_new_session, process_group
        streams = [p2cread, c2pwrite, errwrite]
        fds = [fd if fd != -1 else standard for standard, fd in enumerate(streams)]
        request = child_request(self._request, cwd, env, start_new_session)
        payload = json.dumps(request).encode()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self._address)
            socket.send_fds(connection, [LENGTH.pack(len(payload))], fds)
            connection.sendall(payload)
            (self.pid,) = STATUS.unpack(receive_exactly(connection, STATUS.size))
        except BaseException:
            connection.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._connection = connection
        self._child_created = True

    def _try_wait(self, wait_flags):
        self._connection.setblocking(not wait_flags & os.WNOHANG)
        try:
            while len(self._status_bytes) < STATUS.size:
                chunk = self._connection.recv(STATUS.size - len(self._status_bytes))
                if not chunk:
                    raise ChildProcessError(f'the fork server ended before its child {self.pid}')
                self._status_bytes += chunk
        except BlockingIOError:
            return 0, 0
        self._connection.close()
        return self.pid, STATUS.unpack(self._status_bytes)[0]

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except (OSError, ValueError):  # the connection is closed: as for a child already reaped
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


class ForkServer:
    """The parent process, started on first use (its imports take seconds), ended with the process that started
    it."""

    def __init__(self):
        self.address = self.process = None

    def popen(self, args, **kwargs) -> subprocess.Popen:
        plain = kwargs.get('pass_fds') or kwargs.get('shell') or kwargs.get('preexec_fn')
        request = None if plain else parse_command(list(args), kwargs.get('cwd'))
        if request is None:
            return subprocess.Popen(args, **kwargs)
        if self.process is None:
            self.start()
        return ForkedPopen(self.address, request, args, **kwargs)

    def start(self) -> None:
        import tempfile

        self.address = os.path.join(tempfile.mkdtemp(prefix='forkserver-'), 'socket')
        env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
        self.process = subprocess.Popen([sys.executable, __file__, self.address], cwd=REPO, env=env)
        deadline = time.monotonic() + 600  # a hang guard: the imports take seconds
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'the fork server did not start (exit status {self.process.poll()})')
            time.sleep(0.05)

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=60)


if __name__ == '__main__':
    serve(sys.argv[1])
