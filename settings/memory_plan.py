"""The microbatch a GPU's memory holds, planned before anything is built: the training state from the parameter
counts, the activations from what the step keeps for its backward, and a margin calibrated against the peak memory
measured on an H100. Facts and arithmetic only (no torch), read by config.py when a run on a GPU leaves
--device_train_microbatch_size unset.

Per GPU, in bytes:

    state       = trained parameters x (4 weights + 4 gradients + 8 AdamW + 4 EMA with --use_ema)
                  (--fsdp shard_grad_op shares all but the weights over the GPUs, full_shard all of it)
                + frozen encoders online x 4 (2 with --encoders_bf16)
    activations = microbatch x what one image's step keeps (benchmarks/activation_memory.py, bf16, fused attention;
                  with --activation_checkpointing, the blocks' inputs and one block's recomputation)
    margin      = trained parameters x 2 (autocast's bf16 copies of the weights; one block's under full_shard)
                + OVERHEAD (cuBLAS workspaces, the loss, fp32 norm inputs, the allocator's rounding)

The plan takes the largest microbatch that divides the device batch and keeps state + activations + margin within
USABLE_FRACTION of the GPU's memory (the rest: the CUDA context, which the allocator does not count, and
fragmentation). OVERHEAD is what the measured peaks leave over the rest of the sum: SD2 base at 512px, microbatch 4,
bf16, EMA, eager, on one H100 80GB HBM3 (benchmarks/results.md, 2026-11-25): 24.3 GB allocated from precomputed
latents, 26.0 GB with the encoders online; the sum above gives 23.18 and 24.88 GB, leaving 1.12 GB each.
"""

from dataclasses import dataclass

GB = 1e9
STATE_BYTES = {'weights': 4, 'gradients': 4, 'adamw': 8, 'ema': 4}  # fp32, per trained parameter
AUTOCAST_COPY_BYTES = 2  # a bf16 or fp16 copy of each weight, made by autocast in the forward
OVERHEAD = 1.12 * GB  # calibrated: see the module docstring
USABLE_FRACTION = 0.9

# Exact parameter counts of the built-in models' parts (tests/test_memory_plan.py recounts them on the meta device):
# the UNet or transformer that trains, and the frozen VAE and text encoders.
PARAMETERS = {
    'sd2-base': (865_910_724, 83_653_863 + 340_387_840),
    'sd1.5': (859_520_964, 83_653_863 + 123_060_480),
    'sd2-768-v': (865_910_724, 83_653_863 + 340_387_840),
    'sdxl-base': (2_567_463_684, 83_653_863 + 123_060_480 + 694_659_840),
    'flux-schnell': (11_891_178_560, 83_819_683 + 123_060_480 + 4_762_310_656),
    'sd3.5-medium': (2_243_171_520, 83_819_683 + 123_650_304 + 694_659_840 + 4_762_310_656),
    'pixart-sigma': (610_856_096, 83_653_863 + 4_762_310_656),
}
# Bytes one image's training step keeps for its backward, by image size, as benchmarks/activation_memory.py counts
# them (the test recounts them). Between and beyond two counted sizes the count is taken as linear in the pixels
# (a UNet's activations grow with them; a transformer's with its image tokens beside a fixed number of text
# tokens); with one size, proportional to them.
ACTIVATIONS = {
    'sd2-base': ((256, 264_920_768), (512, 1_032_795_392)),
    'sd1.5': ((512, 1_031_674_112),),
    'sd2-768-v': ((768, 2_312_586_432),),
    'sdxl-base': ((1024, 7_764_086_656),),
    'flux-schnell': ((256, 4_525_732_866), (512, 11_315_544_066)),
    'sd3.5-medium': ((512, 3_238_888_974), (1024, 10_995_529_230)),
    'pixart-sigma': ((512, 1_874_396_930), (1024, 7_253_014_274)),
}
# The same with --activation_checkpointing (Diffusers' gradient checkpointing of the denoiser's blocks): what is
# saved outside the blocks, each block's inputs, and the most one block keeps while the backward recomputes it.
ACTIVATIONS_CHECKPOINTED = {
    'sd2-base': ((256, 60_239_104), (512, 239_201_536)),
    'sd1.5': ((512, 239_132_416),),
    'sd2-768-v': ((768, 537_472_256),),
    'sdxl-base': ((1024, 756_747_648),),
    'flux-schnell': ((256, 271_870_978), (512, 683_589_634)),
    'sd3.5-medium': ((512, 266_480_570), (1024, 900_873_146)),
    'pixart-sigma': ((512, 144_346_370), (1024, 555_392_258)),
}


@dataclass(frozen=True)
class Run:
    """What a run's memory depends on."""

    model_name: str
    image_size: int
    device_batch_size: int
    world_size: int = 1
    use_ema: bool = False
    ema_offload: bool = False
    precomputed_latents: bool = False
    encoders_bf16: bool = False
    fsdp: str = 'none'
    mixed_precision: bool = True
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class Plan:
    microbatch: int | None  # None: not even one image fits
    state: float
    activations_per_image: float
    margin: float
    capacity: float  # the GPU's memory, bytes

    @property
    def total(self) -> float:
        return self.state + (self.microbatch or 1) * self.activations_per_image + self.margin

    def describe(self) -> str:
        """The arithmetic, e.g. 'microbatch 32 (planned): 13.9 GB state + 32 x 1.03 GB activations + 2.9 GB margin
        = 49.8 GB of 85.0 GB (90% usable)'."""
        head = f'microbatch {self.microbatch} (planned)' if self.microbatch else 'no microbatch fits (planned)'
        return f'{head}: {self.sum()}'

    def sum(self) -> str:
        """'13.9 GB state + 32 x 1.03 GB activations + 2.9 GB margin = 49.8 GB of 85.0 GB (90% usable)'."""
        return (
            f'{self.state / GB:.1f} GB state + {self.microbatch or 1} x {self.activations_per_image / GB:.2f} GB '
            f'activations + {self.margin / GB:.1f} GB margin = {self.total / GB:.1f} GB of {self.capacity / GB:.1f} GB '
            f'({USABLE_FRACTION:.0%} usable)'
        )


def plans_for(model_name: str) -> bool:
    return model_name in PARAMETERS


def activation_bytes(model_name: str, image_size: int, activation_checkpointing: bool = False) -> float:
    """One image's activations at `image_size`, from the counted sizes (see ACTIVATIONS)."""
    counted = (ACTIVATIONS_CHECKPOINTED if activation_checkpointing else ACTIVATIONS)[model_name]
    if len(counted) == 1:
        ((size, count),) = counted
        return count * (image_size / size) ** 2
    (size_a, count_a), (size_b, count_b) = counted[:2]
    per_pixel = (count_b - count_a) / (size_b**2 - size_a**2)
    return count_a + per_pixel * (image_size**2 - size_a**2)


def state_bytes(run: Run) -> float:
    trained, frozen = PARAMETERS[run.model_name]
    shards = run.world_size if run.fsdp != 'none' else 1
    ema = STATE_BYTES['ema'] if run.use_ema and not run.ema_offload else 0
    sharded = STATE_BYTES['gradients'] + STATE_BYTES['adamw'] + ema
    weights = STATE_BYTES['weights'] / (shards if run.fsdp == 'full_shard' else 1)
    encoders = 0 if run.precomputed_latents else frozen * (2 if run.encoders_bf16 else 4)
    return trained * (weights + sharded / shards) + encoders


def margin_bytes(run: Run) -> float:
    trained, _ = PARAMETERS[run.model_name]
    copies = trained * AUTOCAST_COPY_BYTES if run.mixed_precision and run.fsdp != 'full_shard' else 0
    return copies + OVERHEAD


def plan(run: Run, capacity: float) -> Plan:
    """The largest microbatch dividing the device batch whose memory fits USABLE_FRACTION of `capacity` bytes."""
    state, margin = state_bytes(run), margin_bytes(run)
    per_image = activation_bytes(run.model_name, run.image_size, run.activation_checkpointing)
    room = capacity * USABLE_FRACTION - state - margin
    fits = [m for m in range(1, run.device_batch_size + 1) if run.device_batch_size % m == 0 and m * per_image <= room]
    return Plan(max(fits) if fits else None, state, per_image, margin, capacity)
