"""Composer's launcher, stopped by a signal without a traceback: `python -m runs.launcher` takes the flags of
`composer` and runs Composer's own launcher with them. The launch files (launch/) and the Makefile start runs with it.

Composer's launcher imports composer.core.engine, which turns SIGTERM and SIGINT into sys.exit(128 + signal) in
whatever process imports it, the launcher's own included; the launcher's catch-all around its monitoring loop then
prints that SystemExit as a traceback before it stops its ranks (Composer 0.32.1). Here either signal becomes the
KeyboardInterrupt that loop handles: the ranks are stopped as before (SIGTERM, then SIGKILL after 30 s), and the
launcher exits with the status of the first rank that failed, 143 or 130 after a signal, with no traceback. A
scancel, a deleted pod or Ctrl-C then ends a job in the ranks' own lines (docs/faults.md).
"""

import signal
import sys

from composer.cli import launcher


def stop_monitoring(signum: int, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_monitoring)  # after the import above, which set Composer's handlers
    return launcher.main()


if __name__ == '__main__':
    sys.exit(main())
