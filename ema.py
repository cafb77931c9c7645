"""Exponential moving average (EMA) of the trained weights, as a Composer Algorithm (`--use_ema`).

Same options, defaults and numerics as `composer.algorithms.EMA` (0.32.1), which is slow where it matters:
it clones every trainable parameter *and every buffer of the whole model* (the frozen text encoder's
`position_ids` included), updates tensor by tensor through three temporaries each (`ema.copy_(ema * s + p * (1 - s))`:
10.4 GB of fresh allocations per update for the SD2 UNet), and under FSDP summons the full parameters on every rank
for every update. Its smoothing-only form (`half_life=None, smoothing=...`) raises AttributeError in 0.32.1.
Here instead:

- the state is one fp32 buffer holding exactly the trainable parameters (the UNet), nothing of the frozen VAE or
  text encoder, updated in place by one fused multi-tensor `torch._foreach_lerp_` (no temporaries);
- under FSDP each rank averages its own shards in place: nothing is gathered to update or to swap;
- with `offload=True` the average lives in ordinary host memory and costs no accelerator memory: after the
  optimizer step the parameters stream to the host through two small pinned buffers on a side CUDA stream and
  a background thread averages them while the GPU runs the next forward and backward;
- checkpoints hold the training weights in the model and the average in this algorithm's state (Composer's EMA
  swaps the average into the model for checkpoints), so a resumed run continues bitwise.

EMA weights are swapped in for evaluation (EVAL_START .. EVAL_END), for `ema_weights()` and for
`export_ema_unet()`, and the training weights are put back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from guards.outputs import staged_folder
from settings import durations

log = logging.getLogger(__name__)

__all__ = ['EMA', 'EMAWeights', 'export_ema_unet', 'full_unet']

# Wrappers that add a component to parameter names (FSDP1, activation checkpointing, torch.compile): names are
# kept without them, the way torch's distributed state dicts write them, so checkpoints move between setups.
_WRAPPER_PREFIXES = ('_fsdp_wrapped_module.', '_checkpoint_wrapped_module.', '_orig_mod.')
# Offload streams parameters through two pinned host buffers of this many fp32 elements (64 MiB each), or of the
# largest parameter if bigger: one copies while the host averages the other.
STAGING_NUMEL = 16 * 2**20


def _parse_time(name: str, value: str | Time, units: tuple[TimeUnit, ...]) -> Time:
    examples = {TimeUnit.BATCH: "'1000ba'", TimeUnit.EPOCH: "'1ep'", TimeUnit.DURATION: "'0.5dur'"}
    allowed = ', '.join(examples[unit] for unit in units)
    if isinstance(value, Time):  # a Time given: only its unit and value are checked
        time = value
    else:
        try:
            time = Time.from_timestring(str(value))
        except (TypeError, ValueError):
            raise ValueError(f'EMA {name}={value!r}: not a Composer time string (use e.g. {allowed})') from None
    if time.unit not in units:
        raise ValueError(f'EMA {name}={value!r}: unit {time.unit.value!r} is not supported here (use e.g. {allowed})')
    if time.unit != TimeUnit.DURATION and (time.value != int(time.value) or time.value < 0):
        raise ValueError(f'EMA {name}={value!r}: must be a whole number of {time.unit.value}')
    return time


def parse_half_life(half_life: str | Time) -> Time:
    """A half life as the EMA takes it: a positive whole number of batches or epochs, by the one rule config.py
    checks --ema_half_life by (durations.parse_half_life)."""
    parsed = durations.parse_half_life(half_life.to_timestring() if isinstance(half_life, Time) else str(half_life))
    return Time(parsed.value, parsed.unit)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor (same storage), else itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules()) or any(
        isinstance(param, DTensor) for param in model.parameters()
    )


class EMAWeights:
    """fp32 moving average of a model's trainable parameters (this rank's shards under FSDP), updated in place."""

    def __init__(self, model: torch.nn.Module, offload: bool = False):
        self.offload = offload
        self.attach(model)
        total = sum(shape.numel() for shape in self._shapes)
        self.flat = torch.empty(total, dtype=torch.float32, device='cpu' if offload else self._device)
        self.tensors = self._views(self.flat, 0, len(self._shapes))
        self._staging: Optional[list[torch.Tensor]] = None
        self._stream = None
        self._worker: Optional[threading.Thread] = None
        self._reads_done = threading.Event()
        self._reads_event = None
        self._error: Optional[BaseException] = None

    def attach(self, model: torch.nn.Module) -> None:
        """(Re)collect the trainable parameters, e.g. after the model was wrapped or moved to another device."""
        named = [(name, param) for name, param in _unwrap(model).named_parameters() if param.requires_grad]
        if not named:
            raise ValueError('EMA: the model has no trainable parameters')
        if any(name.endswith('_flat_param') for name, _ in named):
            raise ValueError("EMA under FSDP needs use_orig_params=True (Composer's default) to name parameters")
        names = []
        for name, _ in named:
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, '')
            names.append(name)
        shapes = [_local(param).shape for _, param in named]
        if hasattr(self, 'names') and (names != self.names or shapes != self._shapes):
            raise ValueError('EMA: the trainable parameters changed since the average was created')
        self.names, self._shapes, self._params = names, shapes, [param for _, param in named]
        self.sharded = _is_sharded(_unwrap(model))
        self._device = _local(self._params[0]).device
        if hasattr(self, 'flat') and not self.offload and self.flat.device != self._device:
            self.join()
            self.flat = self.flat.to(self._device)
            self.tensors = self._views(self.flat, 0, len(self._shapes))
        # Offload: consecutive parameters grouped into chunks that fit one staging buffer.
        self._staging_numel = max(STAGING_NUMEL, max(shape.numel() for shape in shapes))
        self._chunks, start, filled = [], 0, 0
        for index, shape in enumerate(shapes):
            if filled + shape.numel() > self._staging_numel:
                self._chunks.append((start, index))
                start, filled = index, 0
            filled += shape.numel()
        self._chunks.append((start, len(shapes)))

    def _views(self, buffer: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in self._shapes[lo:hi]:
            views.append(buffer.narrow(0, offset, shape.numel()).view(shape))
            offset += shape.numel()
        return views

    @property
    def num_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average from the current weights."""
        self._combine_from_params(None)

    @torch.no_grad()
    def update(self, weight: float) -> None:
        """ema <- ema + weight * (param - ema), i.e. smoothing * ema + (1 - smoothing) * param."""
        self._combine_from_params(weight)

    def _combine_from_params(self, weight: Optional[float]) -> None:
        self.join()
        # Snapshot this rank's tensors now: FSDP re-points param.data to unsharded views during the next forward.
        sources = [_local(param).detach() for param in self._params]
        if not self.offload:
            self._combine(self.tensors, sources, weight)
            return
        ready = None
        if self._device.type == 'cuda':
            if self._stream is None:
                self._stream = torch.cuda.Stream(self._device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))  # after the optimizer step's kernels
        if self._staging is None:
            pin = self._device.type == 'cuda'
            self._staging = [torch.empty(self._staging_numel, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._reads_done.clear()
        self._reads_event, self._error = None, None
        self._worker = threading.Thread(
            target=self._offloaded, args=(sources, weight, ready), name='ema-offload', daemon=True
        )
        self._worker.start()

    @staticmethod
    def _combine(ema: list[torch.Tensor], sources: list[torch.Tensor], weight: Optional[float]) -> None:
        if weight is None:
            torch._foreach_copy_(ema, sources)
        else:  # one fused multi-tensor kernel on GPU, one in-place pass per tensor on CPU; never a temporary
            sources = [s if s.dtype == torch.float32 else s.float() for s in sources]  # low-precision params only
            torch._foreach_lerp_(ema, sources, weight)

    @torch.no_grad()  # grad mode is per thread
    def _offloaded(self, sources: list[torch.Tensor], weight: Optional[float], ready) -> None:
        """Background thread: stream chunk i to the host while averaging chunk i - 1."""
        try:
            cuda = ready is not None
            with contextlib.ExitStack() as context:
                if cuda:  # a new thread starts on device 0 and the default stream
                    context.enter_context(torch.cuda.device(self._device))
                    context.enter_context(torch.cuda.stream(self._stream))
                    self._stream.wait_event(ready)
                pending = None
                for index, (lo, hi) in enumerate(self._chunks):
                    staged = self._views(self._staging[index % 2], lo, hi)
                    torch._foreach_copy_(staged, sources[lo:hi], non_blocking=cuda)
                    copied = torch.cuda.Event() if cuda else None
                    if cuda:
                        copied.record(self._stream)
                    if pending is not None:  # frees the buffer the next chunk will be copied into
                        self._finish(*pending, weight)
                    pending = (lo, hi, staged, copied)
                if cuda:
                    self._reads_event = torch.cuda.Event()
                    self._reads_event.record(self._stream)
                self._reads_done.set()
                self._finish(*pending, weight)
        except BaseException as error:  # re-raised in the training thread by wait_for_reads() or join()
            self._error = error
        finally:
            self._reads_done.set()

    def _finish(self, lo, hi, staged, copied, weight) -> None:
        if copied is not None:
            copied.synchronize()
        self._combine(self.tensors[lo:hi], staged, weight)

    def wait_for_reads(self) -> None:
        """Call before the optimizer changes the parameters: an offloaded update must have read them first.

        The GPU waits on the copy stream (the host does not wait on the GPU); the host blocks only while the
        background thread has not yet issued all its copies, i.e. when averaging is slower than forward+backward.
        """
        if self._worker is None:
            return
        self._reads_done.wait()
        self._raise_worker_error()
        if self._reads_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._reads_event)

    def join(self) -> None:
        """Wait for an offloaded update to finish."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
            self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError('EMA: the offloaded update failed') from error

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the model's (local) parameters with the average, one tensor at a time through a scratch buffer."""
        self.join()
        if self.offload:
            scratch = self._staging[0] if self._staging is not None else torch.empty(self._staging_numel)
        else:
            scratch = torch.empty(max(shape.numel() for shape in self._shapes), device=self._device)
        for param, ema in zip(self._params, self.tensors):
            local = _local(param)
            held = scratch.narrow(0, 0, local.numel()).view(local.shape)
            held.copy_(local)
            local.copy_(ema)
            ema.copy_(held)

    @contextlib.contextmanager
    def swapped(self):
        self.swap()
        try:
            yield
        finally:
            self.swap()

    def state_dict(self, model: torch.nn.Module, mode: Optional[str] = None) -> dict[str, torch.Tensor]:
        """{name: average}. Under FSDP, full tensors, gathered here only, at checkpoint time: for 'full'
        checkpoints to rank 0's host memory on GPUs, as Composer gathers the model; for 'sharded' ones to every
        rank. Composer stores an algorithm's state as one pickled object, of which torch.distributed.checkpoint
        writes a single rank's copy: shards in it would lose every other rank's part."""
        self.join()
        if not self.sharded:
            return dict(zip(self.names, self.tensors))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload also means rank 0 only. On CPU, PyTorch crashes gathering FSDP weights with it.
        rank0_only = mode != 'sharded' and self._device.type == 'cuda'
        with self.swapped():  # the model's shards hold the average while torch gathers them
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
        return {name: state[name].cpu() for name in self.names if name in state}

    def load_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]):
        self.join()
        missing, unexpected = set(self.names) - set(state), set(state) - set(self.names)
        if missing or unexpected:
            raise ValueError(
                f'EMA checkpoint does not match the trainable parameters: missing {sorted(missing)[:3]}'
                f'{"..." if len(missing) > 3 else ""}, unexpected {sorted(unexpected)[:3]}'
                f'{"..." if len(unexpected) > 3 else ""}'
            )
        if not self.sharded:
            with torch.no_grad():
                torch._foreach_copy_(self.tensors, [state[name] for name in self.names])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with self.swapped():  # each rank loads its shards of the full tensors, which then swap into the average
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


class EMA(Algorithm):
    """Moving average of the trainable weights, with the options of `composer.algorithms.EMA`.

    Args:
        half_life: time string ('ba' or 'ep'): an update's weight halves after this long. Default '1000ba':
            Composer's default, and what the published run used (its ema.py was constructed as `EMA()`).
        smoothing: weight of the old average at each update, in (0, 1); instead of half_life, not with it.
        ema_start: time string ('dur', 'ba' or 'ep'): averaging starts from the weights at the first update
            event at or after this. Default '0.0dur' (the first batch).
        update_interval: time string: average every this many batches or epochs. Default: 1 in half_life's unit
            ('1ba' with smoothing). Must be in half_life's unit. smoothing = 2 ** -(update_interval / half_life).
        offload: keep the average in host memory and update it off the training thread (see the module doc).
        trained_labels: the labels of evaluators that keep the trained weights; every other one runs on the
            averaged weights, as with Composer's EMA (evaluation.py evaluates both: 'val' and 'val_ema').
    """

    def __init__(
        self,
        half_life: Optional[str | Time] = '1000ba',
        smoothing: Optional[float] = None,
        ema_start: str = '0.0dur',
        update_interval: Optional[str] = None,
        offload: bool = False,
        trained_labels: tuple[str, ...] = (),
    ):
        if half_life is not None and smoothing is not None:
            raise ValueError(f'EMA: pass half_life ({half_life!r}) or smoothing ({smoothing!r}), not both')
        if half_life is None and smoothing is None:
            raise ValueError("EMA: pass half_life (e.g. '1000ba') or smoothing (e.g. 0.999)")
        self.half_life = None if half_life is None else parse_half_life(half_life)
        self.ema_start = _parse_time('ema_start', ema_start, (TimeUnit.DURATION, TimeUnit.BATCH, TimeUnit.EPOCH))
        if update_interval is None:
            self.update_interval = Time(1, self.half_life.unit if self.half_life is not None else TimeUnit.BATCH)
        else:
            self.update_interval = _parse_time('update_interval', update_interval, (TimeUnit.BATCH, TimeUnit.EPOCH))
            if self.update_interval.value == 0:
                raise ValueError(f'EMA update_interval={update_interval!r}: must be positive')
        if self.half_life is not None and self.half_life.unit != self.update_interval.unit:
            raise ValueError(
                f'EMA: half_life {half_life!r} and update_interval {update_interval!r} must use the same unit'
            )
        if smoothing is not None and not 0 < smoothing < 1:
            raise ValueError(f'EMA smoothing={smoothing!r}: must be strictly between 0 and 1')
        # Composer's conversion, per update: the weight of the old average after one half life is 1/2.
        self.smoothing = (
            float(smoothing) if smoothing is not None else 2 ** -(self.update_interval.value / self.half_life.value)
        )
        self.offload = offload
        self.trained_labels = trained_labels
        self.update_event = Event.BATCH_END if self.update_interval.unit == TimeUnit.BATCH else Event.EPOCH_END
        self.weights: Optional[EMAWeights] = None  # allocated when averaging starts (or a checkpoint is loaded)
        self.started = False
        self.num_updates = 0
        self._ema_active = False
        self._state: Optional[State] = None
        given_half_life = half_life.to_timestring() if isinstance(half_life, Time) else half_life
        self._options = (given_half_life, smoothing, ema_start, update_interval, offload)

    def __repr__(self) -> str:
        names = ('half_life', 'smoothing', 'ema_start', 'update_interval', 'offload')
        return f'EMA({", ".join(f"{n}={v!r}" for n, v in zip(names, self._options))})'

    def match(self, event: Event, state: State) -> bool:
        return event in (
            Event.INIT,
            Event.FIT_START,
            Event.BATCH_START,
            Event.AFTER_TRAIN_BATCH,
            self.update_event,
            Event.EVAL_START,
            Event.EVAL_END,
            Event.FIT_END,
        )

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._state = state  # checkpoints are loaded after INIT and need the model
        elif event == Event.FIT_START and self.weights is not None:
            self.weights.attach(state.model)  # wrapped (DDP/FSDP) or moved since a checkpoint was loaded
        elif event == Event.BATCH_START:
            self._use_training_weights()  # in case an evaluation was cut short
        elif event == Event.AFTER_TRAIN_BATCH and self.weights is not None:
            self.weights.wait_for_reads()  # fires just before the optimizer step, with or without closures
        elif event == self.update_event:
            self._update(state)
        elif event == Event.EVAL_START and state.dataloader_label not in self.trained_labels:
            self._use_ema_weights()
        elif event == Event.EVAL_END:
            self._use_training_weights()
        elif event == Event.FIT_END and self.weights is not None:
            self.weights.join()

    def _should_start(self, state: State) -> bool:
        if self.ema_start.unit == TimeUnit.DURATION:
            elapsed = state.get_elapsed_duration()
            return elapsed is not None and self.ema_start <= elapsed
        return self.ema_start.value <= state.timestamp.get(self.ema_start.unit).value

    def _update(self, state: State) -> None:
        # As Composer: start from the current weights at the first update event at or after ema_start (its update
        # at that same event averages the weights with themselves), then update every update_interval.
        if not self.started:
            if self._should_start(state):
                if self.weights is None:
                    self.weights = EMAWeights(state.model, self.offload)
                    log.info(
                        f'EMA: averaging {len(self.weights.names)} tensors, {self.weights.num_bytes / 1e9:.2f} GB'
                        f' on {"the host" if self.offload else self.weights.flat.device}'
                    )
                self.weights.reset()
                self.started = True
        elif state.timestamp.get(self.update_interval.unit).value % self.update_interval.value == 0:
            self.weights.update(1 - self.smoothing)
            self.num_updates += 1

    def _use_ema_weights(self) -> None:
        if self.weights is not None and self.started and not self._ema_active:
            self.weights.swap()
            self._ema_active = True

    def _use_training_weights(self) -> None:
        if self._ema_active:
            self.weights.swap()
            self._ema_active = False

    @contextlib.contextmanager
    def ema_weights(self):
        """Within this block the model holds the averaged weights; the training weights come back after."""
        if not self.started:
            raise RuntimeError('EMA has not started yet (see ema_start): there is no average to swap in')
        self._use_ema_weights()
        try:
            yield
        finally:
            self._use_training_weights()

    def _model_and_mode(self) -> tuple[torch.nn.Module, Optional[str]]:
        if self._state is None:
            raise RuntimeError('EMA: state_dict/load_state_dict need the Trainer to have run Event.INIT first')
        return self._state.model, self._state.fsdp_state_dict_type

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(started=self.started, num_updates=self.num_updates, ema=None)
        if self.weights is not None:
            if self._ema_active:
                raise RuntimeError('EMA: cannot checkpoint while the averaged weights are swapped in')
            state['ema'] = self.weights.state_dict(*self._model_and_mode())
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        if 'ema_model' in state:
            raise ValueError('this checkpoint holds composer.algorithms.EMA state; load it with that algorithm')
        self.started, self.num_updates = state['started'], state['num_updates']
        if state.get('ema') is not None:
            model, _ = self._model_and_mode()
            if self.weights is None:
                self.weights = EMAWeights(model, self.offload)
            self.weights.load_state_dict(model, state['ema'])


def export_ema_unet(trainer, out_dir: str | Path, again: str = 'run again') -> Path:
    """Save the averaged UNet with Diffusers' save_pretrained (loads back with UNet2DConditionModel.from_pretrained),
    whole or not at all: a failed write raises outputs.WriteFailed, whose fix ends in `again`."""
    ema = next((a for a in trainer.state.algorithms if isinstance(a, EMA)), None)
    if ema is None:
        raise ValueError('export_ema_unet: the trainer has no EMA algorithm (run with --use_ema)')
    out_dir = Path(out_dir)
    with ema.ema_weights():
        unet = full_unet(_unwrap(trainer.state.model).unet)
        if unet is not None:
            with staged_folder(out_dir, f'--export_ema_unet {out_dir}', again) as partial:
                unet.save_pretrained(partial)
    dist.barrier()
    return out_dir


def full_unet(unet: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The whole UNet with its current weights on rank 0 (None on the others): under FSDP a full copy, gathered
    here only (a collective: every rank calls it), to the host on GPUs; otherwise the module itself."""
    if not _is_sharded(unet):
        return unet if dist.get_global_rank() == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    on_gpu = next(unet.parameters()).device.type == 'cuda'
    state = get_model_state_dict(unet, options=StateDictOptions(full_state_dict=True, cpu_offload=on_gpu))
    if dist.get_global_rank() != 0:
        return None
    inner = unet.module if isinstance(unet, FullyShardedDataParallel) else unet
    whole = type(inner).from_config(inner.config)
    whole.load_state_dict(state)
    return whole
