"""Command-line parsing shared by the scripts: argparse, with its errors as one line, and ConfigError, the bad input
every script reports in one line with exit status 2; and the run's verdict, kept for the Makefile to print last.

argparse answers a bad flag (`--batch_size abc`, a misspelled name) with its whole usage, 27 lines for
benchmark.py, above the one that says what is wrong. Every other bad input here is one `error:` line and exit
status 2, so argparse's are too, pointing to --help for the usage.
"""

import argparse
import atexit
import difflib
import os
import signal
import sys
import threading
from pathlib import Path

# Under Composer's launcher (several GPUs) the launcher's own lines follow the run's last one: a crashed rank's exit
# status and output, "Waiting up to 30 seconds for all training processes to terminate". The Makefile names a file
# in this variable and prints the line rank 0 left there once the launcher is done, so that the run's verdict (its
# throughput, or its one-line error) is what a user reads last.
VERDICT_FILE = 'BENCHMARK_VERDICT_FILE'


class ConfigError(ValueError):
    """A bad flag, model folder or dataset found before anything is built: one line naming the problem, exit 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors; an abbreviated flag is refused (the published flags are long, and
    `--model_nam` must not quietly mean `--model_name`), and an unknown flag is named before a missing one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault('allow_abbrev', False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        if self._subparsers is None:  # a command's own flags are its subparser's to check
            known = self._option_string_actions
            unknown = [arg for arg in argv if arg.startswith('--') and arg.split('=')[0] not in known]
            if unknown:
                self.error(f'unrecognized arguments: {" ".join(unknown)}{did_you_mean(unknown[0], known)}')
        return super().parse_args(argv, namespace)

    def error(self, message: str):
        stop(2, f'{message} (see {self.prog} --help)')


def did_you_mean(given: str, known) -> str:
    """'; did you mean --model_name?' for a flag close to a known one (a typo, or - for _), else ''."""
    flag = given.split('=')[0]
    close = difflib.get_close_matches(flag.replace('-', '_'), [name.replace('-', '_') for name in known], n=1)
    if not close:
        return ''
    match = next(name for name in known if name.replace('-', '_') == close[0])
    return f'; did you mean {match}?'


def stop(status: int, message: str):
    """Ends the process with `error: message` as its one line on stderr, and exit status `status`."""
    line = f'error: {message}'
    # Now, for the interpreter's exit before the atexit work (threading's shutdown runs its own exit callbacks first,
    # with Composer's SIGTERM handler still installed), and again first of the atexit work (last registered, first
    # run), after anything on the way out installed another.
    if threading.current_thread() is threading.main_thread():
        end_quietly_on_signals(status)
    atexit.unregister(end_quietly_on_signals)
    atexit.register(end_quietly_on_signals, status)
    # One write: print writes the newline apart where PYTHONUNBUFFERED is set (as in many container images), and
    # the ranks of a job sharing one stderr (torchrun) would interleave their lines.
    sys.stderr.write(f'{line}\n')
    sys.stderr.flush()
    leave_verdict(line)
    sys.exit(status)


def end_quietly_on_signals(status: int) -> None:
    """For a process that has printed its last line and is exiting with `status`: a signal during the exit (the
    interpreter's atexit work, Composer's closing of its trainer among it) ends nothing with a traceback. A
    SIGTERM then is ignored: the launcher or scheduler repeats the one that stopped the run, and follows it with
    SIGKILL after its grace period; Composer's handler would raise SystemExit inside an atexit callback, printed as
    a traceback under the line. A Ctrl-C then is a person's second: the process ends at once with `status`."""

    def end_now(signum, frame):
        os._exit(status)

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, end_now)


def leave_verdict(line: str) -> None:
    """Keeps the run's last line for the Makefile to print again after Composer's launcher (see VERDICT_FILE)."""
    path = os.environ.get(VERDICT_FILE)
    if path and os.environ.get('RANK', '0') == '0':  # the launcher's global rank; one process: rank 0
        try:
            Path(path).write_text(line + '\n')
        except OSError:  # a full disk: the line was printed anyway, above the launcher's
            pass
