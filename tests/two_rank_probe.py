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

import argparse
import dataclasses
import glob
import hashlib
import io
import itertools
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import composer.core.state as composer_state  # noqa: E402
import torch  # noqa: E402
from composer.core import Callback  # noqa: E402
from composer.distributed import dist_strategy  # noqa: E402
from composer.utils import dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: E402

import benchmark  # noqa: E402
from ema import EMA  # noqa: E402


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class Probe(Callback):
    def __init__(self):
        self.first_batch = None
        self.batches = []

    def after_dataloader(self, state, logger):
        if self.first_batch is None:
            self.first_batch = int(state.timestamp.batch)
        if dist.get_global_rank() == 0 and not self.batches:
            if os.environ.get('PROBE_KILL_PID'):
                os.kill(int(os.environ['PROBE_KILL_PID']), getattr(signal, os.environ.get('PROBE_SIGNAL', 'SIGKILL')))
            for path in glob.glob(os.environ.get('PROBE_DELETE', '')):
                os.unlink(path)
            for path in glob.glob(os.environ.get('PROBE_TRUNCATE', '')):
                os.truncate(path, os.path.getsize(path) // 2)
        fail_after = int(os.environ.get('PROBE_FAIL_AFTER', '1'))
        if os.environ.get('PROBE_FAIL_RANK') == str(dist.get_global_rank()) and len(self.batches) == fail_after:
            raise RuntimeError('probe: simulated failure on this rank')
        self.batches.append([digest(image) for image in state.batch['image']])


def cpu_fsdp() -> None:
    """Composer's FSDP runs on CPU (gloo) but for two settings made for GPUs: it places each unit on the current
    CUDA device, and it gathers state dicts with cpu_offload, with which PyTorch segfaults when the weights are
    already on the CPU. Pass the CPU as the device and gather without offload, and let --fsdp past benchmark.py's
    GPU check, so that everything else (Composer's wrapping of the model, sharded training, EMA on shards,
    checkpoints) runs as on GPUs."""

    class FullyShardedOnCPU(FullyShardedDataParallel):
        def __init__(self, *args, device_id=None, **kwargs):
            super().__init__(*args, device_id=torch.device('cpu'), **kwargs)

    dist_strategy.FullyShardedDataParallel = FullyShardedOnCPU
    torch.cuda.current_device = lambda: 0  # the argument's value, computed before the call

    def without_offload(**options):
        return StateDictOptions(**{**options, 'cpu_offload': False})

    composer_state.StateDictOptions = without_offload
    resolve_config = benchmark.resolve_config  # benchmark.py settles the flags before the run starts

    def resolve_on_cpu(args):
        config = resolve_config(argparse.Namespace(**{**vars(args), 'fsdp': 'none', 'fsdp_state_dict_type': 'full'}))
        batch = dataclasses.replace(config.batch, fsdp=args.fsdp, fsdp_state_dict_type=args.fsdp_state_dict_type)
        return dataclasses.replace(config, batch=batch)

    benchmark.resolve_config = resolve_on_cpu


def kill_while_writing_checkpoint(number: int) -> None:
    """Composer's checkpoint writer, made to SIGKILL its own process halfway through writing checkpoint `number`:
    the folder as a kill at that moment leaves it (the file cut short, no link moved, no cleanup)."""
    from composer.utils import checkpoint

    write, calls = checkpoint._write_checkpoint_file, itertools.count(1)

    def write_then_die(state_dict, filename):
        if next(calls) < number:
            return write(state_dict, filename)
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        with open(filename, 'wb') as file:
            file.write(buffer.getbuffer()[: buffer.tell() // 2])
            file.flush()
            os.fsync(file.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._write_checkpoint_file = write_then_die


def check_remote_checkpoints_every(seconds: float) -> None:
    from composer.callbacks import checkpoint_saver

    init = checkpoint_saver.CheckpointSaver.__init__

    def init_then_wait_less(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._symlink_upload_wait_before_next_try_in_seconds = seconds  # Composer's own hook for tests

    checkpoint_saver.CheckpointSaver.__init__ = init_then_wait_less


def full_weights(denoiser) -> dict[str, torch.Tensor]:
    """The denoiser's full weights on every rank (gathered under FSDP: a collective, so every rank calls it)."""
    state = get_model_state_dict(denoiser, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().cpu().clone() for name, tensor in sorted(state.items())}


if __name__ == '__main__':
    if os.environ.get('PROBE_CPU_FSDP'):
        cpu_fsdp()
    if os.environ.get('PROBE_KILL_IN_CHECKPOINT'):
        kill_while_writing_checkpoint(int(os.environ['PROBE_KILL_IN_CHECKPOINT']))
    if os.environ.get('PROBE_SYMLINK_WAIT'):
        check_remote_checkpoints_every(float(os.environ['PROBE_SYMLINK_WAIT']))
    probe = Probe()
    trainer = benchmark.cli(callbacks=(probe,))
    model = trainer.state.model.module if hasattr(trainer.state.model, 'module') else trainer.state.model
    weights = {'unet': full_weights(model.denoiser)}  # the UNet, or a diffusion transformer's transformer
    ema = next((algorithm for algorithm in trainer.state.algorithms if isinstance(algorithm, EMA)), None)
    if ema is not None:
        with ema.ema_weights():
            weights['ema'] = full_weights(model.denoiser)
    unet_digest = hashlib.sha256()
    for name, tensor in weights['unet'].items():
        unet_digest.update(name.encode() + tensor.numpy().tobytes())
    rank = dist.get_global_rank()
    record = {
        'first_batch': probe.first_batch,
        'batches': probe.batches,
        'samples': int(trainer.state.timestamp.sample),
        'unet': unet_digest.hexdigest(),
        'world_size': dist.get_world_size(),
        'fsdp_units': [
            name for name, module in trainer.state.model.named_modules() if isinstance(module, FullyShardedDataParallel)
        ],
    }
    Path(os.environ['PROBE_DIR'], f'rank{rank}.json').write_text(json.dumps(record))
    torch.save(weights, Path(os.environ['PROBE_DIR'], f'rank{rank}.pt'))
