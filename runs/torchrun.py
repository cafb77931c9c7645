"""torchrun, ended by a signal or a failed rank without a traceback: `python -m runs.torchrun` takes torchrun's flags
and runs PyTorch's own torchrun with them.

On SIGTERM or Ctrl-C, torchrun stops its ranks (each ends in its own line, docs/faults.md) and then raises its
SignalException out of its main: a traceback, and exit status 1 for the job where Slurm and Kubernetes look for the
signal's 143 or 130. A failed rank likewise ends it in a ChildFailedError traceback under the rank's own line. Here
the job exits with the signal's status, or with the first failed rank's, after one line naming that rank.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as stopped:
        return 128 + int(stopped.sigval)  # the ranks were stopped by torchrun, and said so
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 128 + signal.Signals(-failure.exitcode)
        print(f'torchrun: rank {rank} exited with status {status} (its output above says why)', file=sys.stderr)
        return status
    return 0


if __name__ == '__main__':
    sys.exit(main())
