"""Outputs that appear whole or not at all: a file or folder is written under a hidden name beside its own, on the
same disk, and renamed into place only once complete; a write that fails (a full disk, a quota, a folder removed)
removes what it wrote and raises WriteFailed, one line naming the output, the reason, what was left and the fix.

Light on purpose (no torch): report.py and generate.py check their flags without loading it.
"""

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

# A library that writes for itself reports a failed write as its own error, the system's reason in its message:
# safetensors ("I/O error: No space left on device (os error 28)"), torch.save ("PytorchStreamWriter failed
# writing file data/3: file write failed").
OS_ERROR_NUMBER = re.compile(r'\(os error (\d+)\)')
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class WriteFailed(OSError):
    """A write that failed while running, the partial output removed: `str()` is the whole one-line message."""

    def __init__(self, output: str, reason: str, left: str, fix: str):
        super().__init__(f'{output}: {reason}; {left}: {fix}')
        self.output, self.reason = output, reason

    def __str__(self) -> str:
        return self.args[0]


def write_failure(error: BaseException) -> OSError | None:
    """The OSError behind a failed write, or None when `error` is not one: an OSError itself, or the error of a
    library that wrote for itself and names the system's reason in its message."""
    if isinstance(error, OSError):
        return error
    message = str(error)
    number = OS_ERROR_NUMBER.search(message)
    if number:
        return OSError(int(number[1]), os.strerror(int(number[1])))
    if 'file write failed' in message:  # torch.save's zip writer says no more
        return OSError(errno.EIO, 'file write failed')
    return None


def system_reason(error: OSError) -> str:
    return error.strerror or str(error) or type(error).__name__


def free_space_fix(error: OSError, again: str) -> str:
    """The fix of a failed write: room on a full disk, otherwise the reason seen to."""
    if error.errno in DISK_FULL:
        return f'free space there, then {again}'
    return f'see to that, then {again}'


def partial_name(path: Path) -> Path:
    """The hidden name `path` is written under until it is whole; it keeps the suffix, which some writers (a
    figure's) read the format from."""
    return path.with_name(f'.{path.stem}.partial{path.suffix}')


@contextlib.contextmanager
def staged_file(path: str | Path, output: str, again: str):
    """Yields the partial name to write `path` under; renamed over `path` once the block ends, removed if it raises.
    A failed write raises WriteFailed naming `output` (the flag and path, as the user gave it), the earlier file
    (or none) left as it was, and `again` (what to run once there is room)."""
    path = Path(path)
    partial = partial_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield partial
        if partial.exists():  # a writer that wrote nothing leaves the earlier file
            os.replace(partial, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        failure = write_failure(error)
        if failure is None:
            raise
        earlier = 'the earlier file is left as it was' if path.exists() else 'nothing written'
        raise WriteFailed(output, system_reason(failure), earlier, free_space_fix(failure, again)) from error


@contextlib.contextmanager
def staged_folder(folder: str | Path, output: str, again: str):
    """Yields a hidden folder beside `folder` to write its contents in; it becomes `folder` once the block ends (an
    empty `folder` given is replaced), and is removed whole if it raises. A failed write raises WriteFailed as
    staged_file does."""
    folder = Path(folder)
    partial = partial_name(folder)
    try:
        shutil.rmtree(partial, ignore_errors=True)  # left by a process killed while writing
        partial.mkdir(parents=True)
        yield partial
        if folder.is_dir():
            folder.rmdir()  # empty: the scripts refuse a folder with anything in it
        os.replace(partial, folder)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        failure = write_failure(error)
        if failure is None:
            raise
        raise WriteFailed(
            output, system_reason(failure), 'the partial output was removed', free_space_fix(failure, again)
        ) from error


def one_line(error: OSError) -> str:
    """An OSError as the one line a script ends with: WriteFailed's own, or the path and the system's reason."""
    if isinstance(error, WriteFailed):
        return str(error)
    where = f'{error.filename}: ' if error.filename else ''
    return f'{where}{system_reason(error)}'
