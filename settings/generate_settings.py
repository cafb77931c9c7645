"""generate.py's flags settled into a frozen GenerateSettings, as benchmark.py's are into a RunConfig: the flags
given, then, for a checkpoint, those its run's record settles (--model_name, --prediction_type, --tokenizer) and
the model folder they name, read once. Facts only (no torch loads here)."""

from dataclasses import dataclass

from settings.model_folder import ModelFolder


@dataclass(frozen=True)
class GenerateSettings:
    """What generate.py draws, from what, and how: each flag given or settled (read-only)."""

    checkpoint: str | None
    pipeline: str | None
    model_name: str | None
    prediction_type: str | None
    tokenizer: str | None
    ema: bool
    trust_checkpoint: bool
    prompt: tuple[str, ...]
    prompts: str | None
    out: str
    seed: int
    batch_size: int
    steps: int
    guidance_scale: float
    scheduler: str | None
    image_size: int | None
    clip_model: str | None
    fid_reference: str | None
    fid_weights: str | None
    model_folder: ModelFolder | None = None  # a checkpoint's model folder, once its run's record settles --model_name
