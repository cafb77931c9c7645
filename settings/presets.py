"""The values a run takes for the flags it leaves unset: each built-in model's preset (the published SD2 run, a CPU
smoke run, the other models at their public training runs' resolution and batch), the sample dataset trained on
when no data is given, and the validation loss's and sample grid's fixed inputs. Facts only (no torch), so that
config.py settles a run's flags before anything heavy loads."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    """A built-in model's values for the flags a run leaves unset."""

    image_size: int
    batch_size: int  # global, over all devices
    device_train_microbatch_size: int | None  # None: the whole device batch in one forward/backward
    max_duration: str


# The published run: 512px and global batch 2048 (= 8 nodes x 8 A100-40GB x microbatch 4 x 8 accumulation
# steps, or any other split of the same batch), microbatch 4 per A100-40GB with xFormers attention.
SD2_BASE = Preset(image_size=512, batch_size=2048, device_train_microbatch_size=4, max_duration='10ba')
# A CPU smoke run: a few dozen small batches of a model with SD2's structure and tiny widths.
TINY = Preset(image_size=64, batch_size=16, device_train_microbatch_size=None, max_duration='40ba')
# The other models at the resolution and global batch of their public training runs: SD 1.5 and SD 2 768-v
# 2048 (their model cards: 32 x 8 x 2 x 4), SDXL 2048 (its report's pretraining batch) at its final 1024px.
# Microbatches are starting points scaled from SD2's 4 at 512px by activation size, not measured.
PRESETS = {
    'sd2-base': SD2_BASE,
    'sd1.5': SD2_BASE,
    'sd2-768-v': dataclasses.replace(SD2_BASE, image_size=768, device_train_microbatch_size=2),
    'sdxl-base': dataclasses.replace(SD2_BASE, image_size=1024, device_train_microbatch_size=1),
    'tiny': TINY,
    'tiny-sd1.5': TINY,
    'tiny-sd2-768-v': dataclasses.replace(TINY, image_size=96),
    'tiny-sdxl-base': TINY,
    # The diffusion transformers at their default training sizes: Flux.1-schnell at MLPerf flux1's 256px, SD3.5
    # medium and PixArt-Sigma at 512px (their 1024px stages take --image_size 1024). Global batch 1024 (SD3's
    # report). Microbatches from the activations benchmarks/activation_memory.py counts (Flux: 4.5 GB per 256px
    # image, beside its sharded state and T5 on 80 GB GPUs), not measured on a GPU; Flux needs --fsdp full_shard.
    'flux-schnell': Preset(image_size=256, batch_size=1024, device_train_microbatch_size=4, max_duration='10ba'),
    'sd3.5-medium': Preset(image_size=512, batch_size=1024, device_train_microbatch_size=8, max_duration='10ba'),
    'pixart-sigma': Preset(image_size=512, batch_size=1024, device_train_microbatch_size=16, max_duration='10ba'),
    'tiny-flux-schnell': TINY,
    'tiny-sd3.5-medium': TINY,
    'tiny-pixart-sigma': TINY,
}

# The model a run trains where --model_name is not given: the published one on a GPU, a CPU's smoke run elsewhere.
PUBLISHED_MODEL, CPU_MODEL = 'sd2-base', 'tiny'


def default_model(has_gpu: bool) -> str:
    return PUBLISHED_MODEL if has_gpu else CPU_MODEL


SYNTHETIC_SAMPLES = 100_000  # one synthetic "epoch"; runs are normally bounded in batches instead

# The sample dataset a run trains on when given no data: generated JPEGs of shapes with captions (convert.py writes
# it on first use), and its held-out validation split: more images of the same generator, from another seed.
SAMPLE_DATASET = Path(__file__).resolve().parents[1] / 'data' / 'sample-mds'
SAMPLE_SIZE = 320  # generated images: a few seconds to make, enough for 20 tiny batches per epoch
SAMPLE_VALIDATION_DATASET = SAMPLE_DATASET.parent / 'sample-mds-validation'
SAMPLE_VALIDATION_SIZE, SAMPLE_VALIDATION_SEED = 64, 1

# The validation loss averages each sample's loss over this many fixed timesteps (as MLPerf's stable_diffusion
# and flux1 benchmarks do).
VALIDATION_TIMESTEPS = 8
# The sample grid's prompts, in the sample dataset's style (its generated captions), two seeds each.
SAMPLE_PROMPTS = (
    'a red circle on a blue background',
    'a yellow square on a purple background',
    'a white triangle on a green background',
    'a blue circle and an orange square on a gray background',
)
SAMPLE_SEEDS = (0, 1)
# The DDPM models' samplers for sample grids and generate.py (--sample_scheduler, --scheduler), as Diffusers names
# them; the flow-matching models sample with their own Euler sampler.
SAMPLERS = {'ddim': 'DDIMScheduler', 'euler': 'EulerDiscreteScheduler'}
