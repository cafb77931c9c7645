"""convert.py's worker processes: each converts its share of the inputs in a process of its own, forked from the
main one (which has imported Streaming already, so a worker starts at once), and hands back what it wrote.

Signals are the main process's: a worker ignores Ctrl-C and a job-wide SIGTERM (guards/stopping.py), and the main
process, stopping, ends every worker before it removes what they wrote. A worker that dies without handing back its
result (killed, out of memory) stops the others and the conversion, named in one line.
"""

import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import wait

from guards.outputs import one_line
from guards.stopping import leave_signals_to_parent

PROGRESS_EVERY_S = 0.2  # how often the main process adds up the workers' counts for its progress bar


class WorkerDied(RuntimeError):
    """A worker ended without handing back its result."""


def run_workers(work: Callable, shares: list, on_progress: Callable[[int], None]) -> list:
    """work(index, share, counts) in one process per share; counts[index] is that worker's count of samples read,
    summed for on_progress. Returns the results in share order; a worker's exception is raised here, as it was."""
    context = multiprocessing.get_context('fork')
    counts = context.Array('q', len(shares), lock=False)  # each worker writes its own slot: no lock needed
    processes, pipes = [], []
    try:
        for index, share in enumerate(shares):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=worker, args=(work, index, share, counts, send), daemon=True)
            process.start()
            send.close()
            processes.append(process)
            pipes.append(receive)
        results, pending = [None] * len(shares), set(range(len(shares)))
        while pending:
            wait(
                [pipes[index] for index in pending] + [processes[index].sentinel for index in pending], PROGRESS_EVERY_S
            )
            on_progress(sum(counts))
            for index in sorted(pending):
                if pipes[index].poll():
                    try:
                        outcome, value = pipes[index].recv()
                    except EOFError:
                        raise WorkerDied(died(index, processes))
                    if outcome == 'failed':
                        raise value
                    results[index] = value
                    pending.discard(index)
                elif not processes[index].is_alive():
                    raise WorkerDied(died(index, processes))
        on_progress(sum(counts))
        return results
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join()


def worker(work: Callable, index: int, share, counts, send) -> None:
    leave_signals_to_parent()
    try:
        outcome = ('done', work(index, share, counts))
    except BaseException as error:
        outcome = ('failed', error)
    try:
        send.send(outcome)
    except Exception:  # an exception that does not pickle: its line
        send.send(('failed', RuntimeError(one_line(outcome[1]))))
    send.close()


def died(index: int, processes: list) -> str:
    process = processes[index]
    process.join()
    code = process.exitcode
    how = f'was killed by {signal.Signals(-code).name}' if code and code < 0 else f'ended with exit status {code}'
    return f'conversion worker {index + 1} of {len(processes)} (pid {process.pid}) {how} before it was done'
