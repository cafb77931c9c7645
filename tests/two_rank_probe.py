"""Runs benchmark.py's command line (benchmark.cli) under a launcher and records, per rank, what the distributed
tests check.

Writes $PROBE_DIR/rank{N}.json: the batches this rank trained (first batch index and, per batch, the
device batch size and a digest of each image), the samples Composer counted, a
digest of its final UNet weights, and its FSDP units; and $PROBE_DIR/rank{N}.pt: the final UNet weights
(full tensors) and, with --use_ema, the averaged ones.
$PROBE_FAIL_RANK makes that rank raise at its second batch (or the one after $PROBE_FAIL_AFTER batches), to test
that a failure ends the job or to crash it after a checkpoint.
$PROBE_CPU_FSDP runs --fsdp on CPU (see cpu_fsdp). When rank 0's first batch arrives, $PROBE_KILL_PID is killed
(SIGKILL: a server that dies mid-run; or sent $PROBE_SIGNAL) and the files $PROBE_DELETE (a glob) names are
deleted (shards gone mid-run), those $PROBE_TRUNCATE names cut to half their size. $PROBE_KILL_IN_CHECKPOINT=N
kills the process while it writes its N-th checkpoint. $PROBE_SYMLINK_WAIT=S: Composer checks every S seconds, not
30, whether the checkpoint its `latest` link names has reached a remote save folder (a local S3 server's is there
at once).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == '__main__':
    import rank_probe

    rank_probe.main()
elif __name__ == '__mp_main__':
    # A process that multiprocessing spawned for the run (Composer's checkpoint uploads to s3://) runs this script's
    # top first, under this name: as benchmark.py's, it loads nothing more and leaves a job-wide signal to the run.
    from guards.stopping import leave_signals_to_parent

    leave_signals_to_parent()
