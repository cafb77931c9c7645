"""The sections a `RunConfig` (config.py) is made of, one for each part of a run: the model, the data, the batch and
its duration, the EMA, the speed paths, the outputs, the evaluation and the training objective. Each is frozen and
settled once by config.resolve_config; the builders read the sections they need."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from settings.durations import Duration
from settings.families import Recipe
from settings.memory_plan import Plan
from settings.model_folder import CaptionInputs, ModelFolder


@dataclass(frozen=True)
class ModelSection:
    """The model trained and where its defaults come from; read by runs/run.py to build it (models/) and by the
    export and sample grids."""

    model_name: str
    model_dir: Path  # the folder the model is built from (a built-in config, or the user's)
    model_folder: ModelFolder  # its configs, read once (model_folder.read_model_folder)
    caption_inputs: CaptionInputs  # what its batches carry beside the image (caption columns, SDXL's time_ids)
    prediction_type: str | None
    attention: str
    run_recipe: str  # 'fast' or 'published': where the speed paths' and precision's defaults come from


@dataclass(frozen=True)
class DataSection:
    """The training data and how it is loaded; read by runs/training.py's data loaders, the validation split's
    (runs/evaluation.py), and the checkpoints' record of the run (runs/checkpoints.py)."""

    use_synth_data: bool
    remote: str | None
    local: str | None
    sample_data: bool  # no dataset given: the generated sample dataset at `local`, written on first use
    precomputed_latents: bool
    tokenizer: str | None
    image_size: int  # with precomputed latents: the size the data was precomputed at
    num_workers: int
    cpu_threads: int | None  # PyTorch's threads; None: its own choice (on a GPU)
    # --cpu_threads or OMP_NUM_THREADS gave the count; else it was chosen, and a resumed run takes its checkpoint's
    cpu_threads_given: bool
    epoch_size: int | None  # samples per epoch of the sample dataset (None: the whole dataset)
    dataset_identity: str | None  # a converted dataset's samples and index digest (dataset_checks.dataset_identity)


@dataclass(frozen=True)
class BatchSection:
    """The batch, how it is split over devices and microbatches, how long the run trains and how it is seeded; read
    by runs/training.py's Trainer and loaders, and by the checkpoints' resumption checks (runs/checkpoints.py)."""

    batch_size: int
    world_size: int
    device_batch_size: int  # batch_size / world_size
    device_train_microbatch_size: int | str  # an int dividing device_batch_size, or 'auto'
    memory_plan: Plan | None  # the arithmetic of a microbatch planned for this GPU (memory_plan.py); None: unplanned
    max_duration: str
    num_batches: int  # the run's length in batches, whatever unit max_duration is in
    seed: int
    precision: str
    fsdp: str
    fsdp_state_dict_type: str


@dataclass(frozen=True)
class EMASection:
    """The averaged weights (ema.py): whether they are kept, their half life, where they live and their export;
    read by runs/training.py (the EMA algorithm), runs/evaluation.py (their evaluators) and runs/run.py (the
    export)."""

    use_ema: bool
    ema_half_life: Duration
    ema_offload: bool
    export_ema_unet: str | None


@dataclass(frozen=True)
class SpeedSection:
    """The speed paths, each on or off (docs/speed.md); read where the model is built (runs/run.py, models/kernels.py)
    and by the Trainer's optimizer and loaders (runs/training.py)."""

    channels_last: bool
    compile: str | None  # an Inductor mode (flags.COMPILE_MODES), None: eager
    activation_checkpointing: bool
    fp8: bool
    fused_groupnorm: bool  # fused_groupnorm.py's Triton GroupNorm + SiLU in the UNet
    cudnn_benchmark: bool
    fused_adamw: bool
    low_precision_norm: bool
    encoders_bf16: bool
    pin_memory: bool


@dataclass(frozen=True)
class OutputSection:
    """What the run writes: checkpoints, their resumption, the loggers, the results file and the profile; read by
    runs/checkpoints.py, runs/training.py and runs/run.py."""

    run_name: str | None
    save_folder: str | None
    save_interval: str
    save_num_checkpoints_to_keep: int  # -1: all
    autoresume: bool
    trust_checkpoint: bool  # load a checkpoint that names code beyond tensors and plain values (flags.py)
    wandb_name: str | None
    wandb_project: str | None
    results_json: str | None
    profile: str | None


@dataclass(frozen=True)
class EvaluationSection:
    """Whether the run learns: the validation loss, sample images and the pipeline export; read by
    runs/evaluation.py and runs/export.py."""

    eval_local: str | None  # the held-out split's folder (the sample dataset's own split by default on it)
    sample_validation: bool  # eval_local is the sample dataset's held-out split, written on first use
    eval_remote: str | None
    eval_interval: str | None  # a Composer time string; None: no validation
    sample_interval: str | None  # None: no sample images
    sample_dir: str | None
    sample_prompts: tuple[str, ...]
    sample_scheduler: str
    sample_steps: int
    guidance_scale: float
    export_pipeline: str | None


# The flow matching fields of a Recipe, each also a flag of benchmark.py.
FLOW_FLAGS = ('timestep_density', 'logit_mean', 'logit_std', 'mode_scale', 'loss_weighting', 'precondition_outputs')


@dataclass(frozen=True)
class ObjectiveSection:
    """What the step optimizes beyond the model's loss: the stability options (runs/stability.py, the learning-rate
    warmup of runs/training.py), off by default for the UNets, and a diffusion transformer's training recipe
    (models/diffusion_transformer.py), None for the UNets."""

    grad_clip_norm: float | None
    lr_warmup: str | None
    caption_dropout: float
    flux_guidance: float | None  # the guidance a guidance-distilled Flux embeds in training; None for other models
    recipe: Recipe | None  # a diffusion transformer's training recipe, with the flags given applied
    learns_flow: bool = False  # the recipe's flow matching fields apply (Flux, SD3); PixArt's DDPM step reads none

    def listed(self) -> dict:
        """Its fields as the printed configuration and the results file list them: the recipe's flow matching fields
        also each under its flag's name, after caption_dropout (None where the model learns no flow)."""
        listed = {}
        for field in dataclasses.fields(self):
            if field.name != 'learns_flow':
                listed[field.name] = getattr(self, field.name)
            if field.name == 'caption_dropout':
                listed |= {flag: getattr(self.recipe, flag) if self.learns_flow else None for flag in FLOW_FLAGS}
        return listed
