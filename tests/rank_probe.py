"""The rank probe of two_rank_probe.py (its docstring says what it records and which variables steer it), a module
of its own so that a process multiprocessing spawns for the run loads none of it."""

import argparse
import dataclasses
import glob
import hashlib
import io
import itertools
import json
import os
import signal
from pathlib import Path

import composer.core.state as composer_state
import torch
from composer.core import Callback
from composer.distributed import dist_strategy
from composer.utils import dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel

import benchmark
from ema import EMA


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


def this_process() -> dict:
    """The rank's process: its parent, session and group, how its interpreter was started, and the process-wide
    state a run leaves as it found it (logging, signal handlers, exit callbacks)."""
    import atexit
    import logging
    import sys
    import weakref

    return {
        'parent': os.getppid(),
        'session': os.getsid(0),
        'group': os.getpgid(0),
        'started_as': Path(sys.orig_argv[1]).name if len(sys.orig_argv) > 1 else '',
        'string_hash': hash('a string: its hash is salted by the interpreter that started the process'),
        'root_logger': [logging.getLevelName(logging.root.level), *(type(h).__name__ for h in logging.root.handlers)],
        'signal_handlers': [getattr(signal.getsignal(n), '__qualname__', str(signal.getsignal(n))) for n in (2, 15)],
        'exit_callbacks': atexit._ncallbacks(),
        'finalizers': sorted(
            getattr(info[1], '__qualname__', '?') for f in list(weakref.finalize._registry) if (info := f.peek())
        ),
    }


def main() -> None:
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
        'process': this_process(),
    }
    Path(os.environ['PROBE_DIR'], f'rank{rank}.json').write_text(json.dumps(record))
    torch.save(weights, Path(os.environ['PROBE_DIR'], f'rank{rank}.pt'))
