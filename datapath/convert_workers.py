"""convert.py --workers N: each worker converts its share of the pieces of the inputs into a part of the output,
and one index is merged over the parts.

The worker processes: each converts its share of the inputs in a process of its own, forked from the
main one (which has imported Streaming already, so a worker starts at once), and hands back what it wrote.

Signals are the main process's: a worker ignores Ctrl-C and a job-wide SIGTERM (guards/stopping.py), and the main
process, stopping, ends every worker before it removes what they wrote. A worker that dies without handing back its
result (killed, out of memory) stops the others and the conversion, named in one line.
"""

import logging
import multiprocessing
import signal
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import wait

from tqdm import tqdm

from datapath.convert_inputs import Piece, Reading, piece_samples, shares_of
from datapath.mds_output import SKIPPED_NAMED, VALIDATION_SPLIT, staged, write_mds, write_part
from guards.outputs import one_line
from guards.stopping import leave_signals_to_parent
from settings.dataset_checks import is_remote

PROGRESS_EVERY_S = 0.2  # how often the main process adds up the workers' counts for its progress bar
TERMINATE_WAIT_S = 10  # how long a worker terminated (stopping) has to end before it is killed


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
            process.join(TERMINATE_WAIT_S)
            if process.exitcode is None:  # SIGTERM blocked, and its thread that ends on it not yet started
                process.kill()
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


def write_pieces(pieces, reading, out, overwrite=False, size_limit=1 << 26, progress=True, validation=False, workers=1):
    """The pieces of the inputs as one MDS dataset (and its split), by `workers` processes, or by this one where
    there is one share: its shards then lie in `out` itself."""
    rows = [piece.rows for piece in pieces]
    total = None if None in rows else sum(rows)
    shares = shares_of(pieces, workers)
    if len(shares) > 1:
        import streaming  # noqa: F401  imported once here, before the workers fork: none imports it again

        return write_in_workers(shares, reading, out, overwrite, size_limit, total, progress, validation)
    samples = (sample for piece in pieces for sample in piece_samples(piece, reading))
    return write_mds(samples, out, overwrite, size_limit, total, progress, validation=validation)


def write_in_workers(shares, reading: Reading, out, overwrite, size_limit, total, progress, validation) -> dict:
    """Each share of the pieces converted by a worker of its own into `part-NNNNN` of the output (and of its split),
    then one index over the parts, merged by Streaming's merge_index, in share order: the samples one process would
    write, in its order, in more shards."""

    def write(target: str, before_first_sample) -> dict:
        first_sample = once_across_workers(before_first_sample)

        def convert_share(index, share, counts):
            part = f'part-{index:05}'
            samples = counted(share, reading, counts, index)
            split = f'{target}/{VALIDATION_SPLIT}/{part}'
            return write_part(
                samples, f'{target}/{part}', split, size_limit, None, False, validation, first_sample, False
            )

        with tqdm(total=total, unit='img', disable=not progress, desc=f'converting ({len(shares)} workers)') as bar:
            parts = run_workers(convert_share, shares, lambda done: bar.update(done - bar.n))
        stats = merged_counts(parts)
        if stats['written']:
            if stats['held_out']:
                held_out = [index for index, part in enumerate(parts) if part['held_out']]
                merge_parts(f'{target}/{VALIDATION_SPLIT}', held_out)
            merge_parts(target, [index for index, part in enumerate(parts) if part['written']])
        return stats

    try:
        return staged(out, overwrite, write)
    except WorkerDied as error:
        left = f'{out} has no index.json of it' if is_remote(out) else f'{out} is left as it was'
        raise ConversionStopped(f'{error}: conversion stopped; {left}') from None


class ConversionStopped(RuntimeError):
    """A worker died (killed, out of memory): one line, exit status 1."""


def counted(share: list[Piece], reading: Reading, counts, index: int):
    """A share's samples, each counted in counts[index] as it is read (the main process's progress bar)."""
    for piece in share:
        for sample in piece_samples(piece, reading):
            yield sample
            counts[index] += 1


def once_across_workers(action):
    """`action` run once, by the first worker to call it (None stays None)."""
    if action is None:
        return None
    context = multiprocessing.get_context('fork')
    lock, done = context.Lock(), context.Value('b', 0, lock=False)

    def run_once():
        with lock:
            if not done.value:
                action()
                done.value = 1

    return run_once


def merged_counts(parts: list[dict]) -> dict:
    """The workers' counts as one conversion's: the first SKIPPED_NAMED skipped in input order (the shares follow
    one another)."""
    skipped, named = Counter(), []
    for part in parts:
        skipped.update(part['skipped'])
        named += part['skipped_named']
    return {
        'written': sum(part['written'] for part in parts),
        'held_out': sum(part['held_out'] for part in parts),
        'skipped': dict(skipped),
        'skipped_named': named[:SKIPPED_NAMED],
        'shards': sum(part['shards'] for part in parts),
    }


def merge_parts(target: str, indexes: list[int]) -> None:
    """One index.json in `target` over its parts' (Streaming's merge_index; on a remote, downloaded, merged and
    uploaded). Parts that hold no sample wrote no index and are left out."""
    from streaming.base.util import merge_index  # here: Streaming loads torch

    remote = is_remote(target)
    logging.disable(logging.WARNING)  # merge_index warns of its temporary folder, every time
    try:
        index_files = [f'{target}/part-{index:05}/index.json' for index in indexes]
        merge_index(index_files, target, keep_local=not remote)
    finally:
        logging.disable(logging.NOTSET)
