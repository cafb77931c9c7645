"""What a model folder holds: the built-in configs, the Diffusers pipeline layout a folder must have (a UNet's, or a
diffusion transformer's), which parts carry weights, and what the denoiser's config says about its inputs (SDXL's
micro-conditioning, the pooled text width, a transformer's text encoders and caption lengths, a Flux's guidance
embedding), the config fields a training step would not honour (refused before a run builds anything), and what
the model's batches carry beside the image (`CaptionInputs`: a caption column per text encoder, with its length,
padding id and vocabulary; the shapes of a transformer's text embeddings). Light on purpose: no torch, so that the
flags (flags.py, config.py) are checked at once.

A folder's layout is checked first (resolve_model_dir); its configs are then read once into a frozen `ModelFolder`
(read_model_folder, one per folder), and the questions about the model (caption_inputs, check_training_fields, ...)
take that description, not the path.
"""

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from guards.arguments import ConfigError
from settings.families import FAMILIES, is_flow_matching

CONFIGS_DIR = Path(__file__).resolve().parents[1] / 'configs'
BUILTIN_MODELS = sorted(path.name for path in CONFIGS_DIR.iterdir() if path.is_dir())
# Files a model folder must hold: the layout of Diffusers' pipelines (stabilityai/stable-diffusion-2-base), and
# the second text encoder's that SDXL's adds (stabilityai/stable-diffusion-xl-base-1.0).
CONFIG_FILES = ('unet/config.json', 'vae/config.json', 'text_encoder/config.json', 'scheduler/scheduler_config.json')
SECOND_ENCODER_CONFIG = 'text_encoder_2/config.json'
# A diffusion transformer's folder (black-forest-labs/FLUX.1-schnell, stabilityai/stable-diffusion-3.5-medium,
# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS): transformer/ in place of unet/, and the text encoders of its family
# (families.py).
TRANSFORMER_CONFIG = 'transformer/config.json'
# The Diffusers pipeline a trained UNet of one text encoder (SD 1.5, SD 2) is exported as and drawn with
# (model_index.json's _class_name); each diffusion transformer family names its own.
UNET_PIPELINE_NAME = 'StableDiffusionPipeline'
# Weight files of each part, as Diffusers and Transformers save them; a part without them is randomly initialized.
WEIGHT_FILES = {
    'unet': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'transformer': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'vae': ('diffusion_pytorch_model.safetensors', 'diffusion_pytorch_model.bin'),
    'text_encoder': ('model.safetensors', 'pytorch_model.bin'),
    'text_encoder_2': ('model.safetensors', 'pytorch_model.bin'),
    'text_encoder_3': ('model.safetensors', 'pytorch_model.bin'),
}
LATENT_DOWNSAMPLE = 8  # SD's VAE: image pixels per latent pixel along each side
# The values SDXL's UNet embeds beside the pooled text ('time_ids'): original height and width, crop top and
# left, target height and width.
MICRO_CONDITIONS = 6
# The noise schedule each training step builds from a folder's scheduler config (models/): Flux's
# and SD3's flow from FlowMatchEulerDiscreteScheduler's fields (num_train_timesteps, shift,
# use_dynamic_shifting); the DDPM models' (the UNets, PixArt) from DDPMScheduler's (num_train_timesteps, the betas,
# rescale_betas_zero_snr), with the target its prediction_type names.
FLOW_SCHEDULER = 'FlowMatchEulerDiscreteScheduler'
DDPM_BETA_SCHEDULES = ('linear', 'scaled_linear', 'squaredcos_cap_v2', 'sigmoid')
DDPM_TARGETS = ('epsilon', 'v_prediction')


class ModelFolderError(ConfigError):
    """A --model_name that names no usable model folder: reported as one line, exit status 2."""


def resolve_model_dir(model_name: str) -> Path:
    """A built-in config, a local folder, or (only when asked for) a hub id downloaded to the HF cache."""
    if model_name in BUILTIN_MODELS:
        return CONFIGS_DIR / model_name
    path = Path(model_name).expanduser()
    if not path.is_dir():
        path = download_from_hub(model_name)
    if (path / TRANSFORMER_CONFIG).is_file():
        check_transformer_folder(model_name, path)
        check_weight_files(model_name, path)
        return path
    missing = [name for name in CONFIG_FILES if not (path / name).is_file()]
    if missing:
        raise ModelFolderError(
            f'--model_name {model_name!r}: missing config file(s) {", ".join(missing)} in {path} '
            f'(expected the Diffusers layout: {", ".join(CONFIG_FILES)})'
        )
    configs = {}
    for name in (*CONFIG_FILES, SECOND_ENCODER_CONFIG):
        if not (path / name).is_file():
            continue
        configs[name] = read_config(model_name, path, name)
    # SDXL's UNet embeds the second encoder's pooled output: one without the other cannot train.
    micro_conditioning = has_micro_conditioning(configs['unet/config.json'])
    if micro_conditioning != (SECOND_ENCODER_CONFIG in configs):
        raise ModelFolderError(
            f'--model_name {model_name!r}: '
            + (
                "the UNet's addition_embed_type 'text_time' (SDXL) needs a second text encoder: "
                + SECOND_ENCODER_CONFIG
                if micro_conditioning
                else f"{SECOND_ENCODER_CONFIG} is there, but the UNet has no addition_embed_type 'text_time' to use it"
            )
        )
    check_weight_files(model_name, path)
    return path


def check_transformer_folder(model_name: str, path: Path) -> None:
    """A diffusion transformer's folder: a transformer class this benchmark trains, and its configs."""
    class_name = read_config(model_name, path, TRANSFORMER_CONFIG).get('_class_name')
    if class_name not in FAMILIES:
        raise ModelFolderError(
            f'--model_name {model_name!r}: {TRANSFORMER_CONFIG} names {class_name!r}; the diffusion transformers '
            f'trained here are {", ".join(FAMILIES)}'
        )
    needed = [
        TRANSFORMER_CONFIG,
        'vae/config.json',
        *(f'{encoder}/config.json' for encoder in FAMILIES[class_name].text_encoders),
        'scheduler/scheduler_config.json',
    ]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ModelFolderError(
            f'--model_name {model_name!r}: missing config file(s) {", ".join(missing)} in {path} '
            f"(a {class_name}'s folder holds {', '.join(needed)})"
        )
    for name in needed:
        read_config(model_name, path, name)


def read_config(model_name: str, path: Path, name: str) -> dict:
    """One config file of a model folder, or the one-line error of a file that is not JSON."""
    try:
        return json.loads((path / name).read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelFolderError(f'--model_name {model_name!r}: {path / name} is not valid JSON ({error})')


def download_from_hub(model_name: str) -> Path:
    """A hub id's configs and first weight file of each part, when the network is allowed (HF_HUB_OFFLINE unset)."""
    looks_like_hub_id = model_name.count('/') == 1 and not model_name.startswith(('.', '/', '~'))
    if not looks_like_hub_id:
        close = difflib.get_close_matches(model_name, BUILTIN_MODELS, n=1, cutoff=0.75)
        meant = f"; did you mean '{close[0]}'?" if close else ''
        raise ModelFolderError(
            f'--model_name {model_name!r}: not a built-in model ({", ".join(BUILTIN_MODELS)}) and no such folder{meant}'
        )
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', '', 'false'):
        raise ModelFolderError(
            f'--model_name {model_name!r}: looks like a hub id, but HF_HUB_OFFLINE is set; '
            f'use a built-in model ({", ".join(BUILTIN_MODELS)}) or a local folder'
        )
    # Imported only here, where a download is asked for: the hub client is not needed to train from a folder.
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            model_name,
            allow_patterns=[
                *CONFIG_FILES,
                SECOND_ENCODER_CONFIG,
                TRANSFORMER_CONFIG,
                'text_encoder_3/config.json',
                *(f'{part}/{name}' for part, names in WEIGHT_FILES.items() for name in names[:1]),
            ],
        )
    )


def has_weights(model_dir: Path, part: str) -> bool:
    """Whether a part folder carries weights: one file, or the index of a sharded checkpoint (Flux's, T5-XXL's)."""
    return bool(weight_files(model_dir / part, part))


def weight_files(part_dir: Path, part: str) -> list[Path]:
    """A part folder's weight files: the one file, or the shards its index lists (there or not)."""
    for name in WEIGHT_FILES[part]:
        index = part_dir / f'{name}.index.json'
        if (part_dir / name).is_file():
            return [part_dir / name]
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())['weight_map'].values()))
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                return [index]  # named as not a checkpoint index by check_weight_files
            return [part_dir / shard for shard in shards]
    return []


def check_weight_files(model_name: str, model_dir: Path) -> None:
    """Every weight file a folder's parts name is there and whole (a download cut short, a shard missing), checked
    before torch loads: a part with none is randomly initialized, as meant, but one whose weights are broken or
    half there is refused in one line rather than by a traceback as it loads."""
    for part in WEIGHT_FILES:
        for path in weight_files(model_dir / part, part):
            problem = weights_problem(path)
            if problem:
                raise ModelFolderError(f'--model_name {model_name!r}: {path.relative_to(model_dir)}: {problem}')


def weights_problem(path: Path) -> str | None:
    """What is wrong with one weights file, read without torch, or None where it looks whole: missing, not a
    shard index, a safetensors file whose header does not parse or that is shorter than its header says."""
    if path.name.endswith('.index.json'):
        return "not a sharded checkpoint's index (JSON with a 'weight_map'); download the folder again"
    if not path.is_file():
        return 'missing (the index of the sharded weights lists it); download the folder again, whole'
    if path.suffix != '.safetensors':
        return None  # torch's own format: read when it loads
    size = path.stat().st_size
    with open(path, 'rb') as file:
        length = int.from_bytes(file.read(8), 'little') if size >= 8 else size
        try:
            header = json.loads(file.read(length)) if 8 + length <= size else None
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        return f'not a safetensors file ({size:,} bytes, no header that reads): download it again'
    tensors = [entry for key, entry in header.items() if key != '__metadata__' and isinstance(entry, dict)]
    end = 8 + length + max((entry.get('data_offsets', [0, 0])[1] for entry in tensors), default=0)
    if size < end:
        return f'cut short: {size:,} of the {end:,} bytes its header gives; download it again'
    return None


@dataclass(frozen=True)
class ModelFolder:
    """A model folder's configs, read once (read_model_folder): what the flags' checks, the builders and the scripts
    ask of it. The configs are read-only views."""

    path: Path
    denoiser_config: Mapping  # the UNet's, or a diffusion transformer's (whose keys say what it takes)
    family: str | None  # a diffusion transformer's class name (Flux, SD3, PixArt); None for a UNet
    text_encoder_folders: tuple[str, ...]  # in the order the denoiser's pipeline names them
    text_encoder_configs: tuple[Mapping, ...]  # one per text encoder folder, in that order
    scheduler_config: Mapping
    vae_config: Mapping

    @property
    def is_transformer(self) -> bool:
        return self.family is not None

    @property
    def is_sdxl(self) -> bool:
        """A UNet of SDXL's family: a second text encoder, whose pooled output the UNet's micro-conditioning takes
        (resolve_model_dir refuses one without the other)."""
        return not self.is_transformer and SECOND_ENCODER_CONFIG.split('/')[0] in self.text_encoder_folders

    def part_config(self, part: str) -> Mapping:
        """The config of one part's folder: 'unet' or 'transformer' (the denoiser), 'vae', or a text encoder's."""
        if part in ('unet', 'transformer'):
            return self.denoiser_config
        if part == 'vae':
            return self.vae_config
        return self.text_encoder_configs[self.text_encoder_folders.index(part)]

    def __reduce__(self):
        # Pickled and copied as its path: the read-only views do not pickle, and the folder is read once anyway.
        return read_model_folder, (self.path,)


def as_model_folder(folder: 'ModelFolder | Path | str') -> ModelFolder:
    """A ModelFolder as given (the one a run's settling read), or the description of a checked folder's path."""
    return folder if isinstance(folder, ModelFolder) else read_model_folder(folder)


def read_model_folder(model_dir: Path) -> ModelFolder:
    """The description of a model folder whose layout resolve_model_dir has checked. Read once by whatever settles a
    script's values, and passed down from there (a path given to a builder is read into one)."""
    path = Path(model_dir).resolve()

    def config(name: str) -> Mapping:
        return MappingProxyType(read_config(str(path), path, name))

    family = None
    if (path / TRANSFORMER_CONFIG).is_file():
        denoiser = config(TRANSFORMER_CONFIG)
        family = denoiser['_class_name']
        encoders = FAMILIES[family].text_encoders
    else:
        denoiser = config('unet/config.json')
        encoders = tuple(name for name in ('text_encoder', 'text_encoder_2') if (path / name).is_dir())
    return ModelFolder(
        path=path,
        denoiser_config=denoiser,
        family=family,
        text_encoder_folders=encoders,
        text_encoder_configs=tuple(config(f'{name}/config.json') for name in encoders),
        scheduler_config=config('scheduler/scheduler_config.json'),
        vae_config=config('vae/config.json'),
    )


def has_micro_conditioning(unet_config) -> bool:
    """SDXL's UNet: it embeds the pooled text and the size/crop values beside the timestep."""
    return unet_config.get('addition_embed_type') == 'text_time'


def pooled_text_width(unet_config) -> int | None:
    """The width of the pooled text embedding an SDXL UNet takes (1280), None for other UNets."""
    if not has_micro_conditioning(unet_config):
        return None
    return (
        unet_config['projection_class_embeddings_input_dim'] - MICRO_CONDITIONS * unet_config['addition_time_embed_dim']
    )


def check_training_fields(model_name: str, folder: ModelFolder, prediction_type: str | None = None) -> None:
    """Refuses a folder whose configs ask for a training its family's step would not do, so that none is silently
    trained otherwise: a scheduler of another noise process than the step's (Flux and SD3: FlowMatchEulerDiscrete;
    the DDPM models: betas, not a flow or EDM schedule), a DDPM target other than epsilon or v_prediction,
    per-channel latent statistics in the VAE's config (and a shift for a UNet), a UNet's timestep-condition
    embedding. prediction_type: --prediction_type, which replaces the scheduler's (UNets only). docs/models.md
    lists what is honoured."""
    family = folder.family
    scheduler = folder.scheduler_config
    scheduler_class = scheduler.get('_class_name')
    where = f'--model_name {model_name!r}: scheduler/scheduler_config.json'
    model = family or 'a UNet'
    if is_flow_matching(family):
        if scheduler_class != FLOW_SCHEDULER:
            raise ModelFolderError(
                f"{where} names {scheduler_class!r}, but {family}'s training step draws its noise levels from "
                f"{FLOW_SCHEDULER}'s sigmas whatever the folder names: give the folder a {FLOW_SCHEDULER} config"
            )
    else:
        flow_sigmas = bool(scheduler.get('use_flow_sigmas'))
        flow = str(scheduler_class).startswith('FlowMatch') or flow_sigmas
        if flow or str(scheduler_class).startswith('EDM'):
            raise ModelFolderError(
                f'{where} names {scheduler_class!r}{" with flow sigmas" if flow_sigmas else ""}, '
                f"{'a flow matching' if flow else 'an EDM'} schedule; {model} trains on the DDPM noise of the config's "
                'betas (beta_schedule, beta_start, beta_end), which this one does not define'
            )
        beta_schedule = scheduler.get('beta_schedule', 'linear')
        if scheduler.get('trained_betas') is None and beta_schedule not in DDPM_BETA_SCHEDULES:
            raise ModelFolderError(
                f'{where}: beta_schedule {beta_schedule!r}; the DDPM training step knows '
                f'{", ".join(DDPM_BETA_SCHEDULES)} (or trained_betas)'
            )
        target = prediction_type or scheduler.get('prediction_type', 'epsilon')
        if target not in DDPM_TARGETS:
            raise ModelFolderError(
                f'{where}: prediction_type {target!r}; {model} trains the target epsilon or v_prediction'
                + ('' if family else ': pass --prediction_type to choose one')
            )
    vae = folder.vae_config
    if vae.get('latents_mean') is not None or vae.get('latents_std') is not None:
        raise ModelFolderError(
            f'--model_name {model_name!r}: vae/config.json holds per-channel latents_mean/latents_std; the training '
            'step normalizes latents by shift_factor and scaling_factor alone'
        )
    if family is None and vae.get('shift_factor'):
        raise ModelFolderError(
            f"--model_name {model_name!r}: vae/config.json has shift_factor {vae['shift_factor']}, which the UNets' "
            'training step does not subtract (it scales latents by scaling_factor alone, as Stable Diffusion did)'
        )
    if family is None and folder.denoiser_config.get('time_cond_proj_dim') is not None:
        raise ModelFolderError(
            f"--model_name {model_name!r}: unet/config.json has time_cond_proj_dim (a distilled UNet's embedding of "
            'a guidance scale beside the timestep), which the training step gives no input: it would stay untrained'
        )


def embeds_guidance(folder: ModelFolder) -> bool:
    """A guidance-distilled Flux (Flux.1-dev): its transformer embeds a guidance scale beside the timestep."""
    return (
        folder.is_transformer
        and FAMILIES[folder.family].embeds_guidance
        and bool(folder.denoiser_config.get('guidance_embeds'))
    )


# ------------------------------------------------------------------------------------ caption inputs

# CLIP's text encoder has 77 positions (SD2 tokenizes every caption to exactly this length).
CAPTION_LENGTH = 77
# CLIP BPE vocabulary size; random ids are drawn below it so any CLIP text encoder accepts them.
CLIP_VOCAB_SIZE = 49408
# OpenCLIP (SD2's text tower) pads with id 0 ("!") after the end-of-text token, not with end-of-text.
CLIP_PAD_ID = 0
CLIP_START_ID, CLIP_END_ID = 49406, 49407  # <|startoftext|>, <|endoftext|>
# T5's SentencePiece vocabulary (the diffusion transformers' long-caption encoder): ids 0 pad, 1 end of text.
T5_VOCAB_SIZE = 32128
T5_PAD_ID, T5_END_ID = 0, 1


def caption_pad_ids(folder: ModelFolder) -> tuple[int, ...]:
    """The padding id of each text encoder of a model folder, from its config's pad_token_id: 0 for OpenCLIP's
    encoders (SD 2, SDXL's second) and for T5, the end-of-text token for OpenAI's CLIP (SD 1.5, SDXL's first).
    Configs exported from OpenAI's CLIP carry a meaningless pad_token_id (1): CLIP's own end-of-text is used then."""
    pad_ids = []
    for config in folder.text_encoder_configs:
        pad = config.get('pad_token_id')
        if config.get('model_type') == 't5':
            pad_ids.append(T5_PAD_ID)
        else:
            pad_ids.append(pad if pad in (CLIP_PAD_ID, CLIP_END_ID) else CLIP_END_ID)
    return tuple(pad_ids)


@dataclass(frozen=True)
class CaptionInputs:
    """What a model's batches carry beside the image: one column of caption token ids per text encoder ('input_ids',
    'input_ids_2', ...), each as long as that encoder reads (77 for CLIP, 256 or 300 for T5), padded with its pad
    id and drawn (for synthetic captions) below its vocabulary size; and for SDXL 'time_ids' (size and crop)."""

    pad_ids: tuple[int, ...] = (CLIP_PAD_ID,)
    size_conditions: bool = False
    lengths: tuple[int, ...] = (CAPTION_LENGTH,)
    vocab_sizes: tuple[int, ...] = (CLIP_VOCAB_SIZE,)

    @property
    def id_columns(self) -> list[str]:
        return ['input_ids'] + [f'input_ids_{n}' for n in range(2, len(self.pad_ids) + 1)]

    @property
    def uses_t5(self) -> bool:
        return T5_VOCAB_SIZE in self.vocab_sizes


def caption_inputs(folder: ModelFolder) -> CaptionInputs:
    """What the batches of a model folder's model carry: a caption column per text encoder, with its pad id
    (caption_pad_ids), length and vocabulary, and SDXL's time_ids where the UNet takes them."""
    lengths, vocab_sizes = [], []
    for config in folder.text_encoder_configs:
        if config.get('model_type') == 't5':
            lengths.append(FAMILIES[folder.family].t5_caption_length)
            vocab_sizes.append(T5_VOCAB_SIZE)
        else:
            lengths.append(CAPTION_LENGTH)
            vocab_sizes.append(CLIP_VOCAB_SIZE)
    return CaptionInputs(
        caption_pad_ids(folder), has_micro_conditioning(folder.denoiser_config), tuple(lengths), tuple(vocab_sizes)
    )


def text_shapes(family: str, transformer_config, t5_length: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one sample's text conditioning for a diffusion transformer, from its config."""
    described = FAMILIES[family]
    length = CAPTION_LENGTH + t5_length if described.clip_tokens_first else t5_length
    shapes = {'text_embedding': (length, transformer_config[described.caption_width])}
    if described.caption_extra == 'pooled_text_embedding':
        shapes['pooled_text_embedding'] = (transformer_config['pooled_projection_dim'],)
    return shapes


def t5_tokenizer_needed(who: str, reads: str = 'reads captions', flag: str = '--tokenizer') -> str:
    """The one-line message for a T5 model given no --tokenizer: `who` (the model, or its pipeline) `reads` ..."""
    return (
        f'{flag}: {who} {reads} with T5, whose tokenizer no package here ships: pass --tokenizer DIR, a local '
        "folder of T5's tokenizer (e.g. FLUX.1-schnell's tokenizer_2), or for a smoke run data/t5-smoke-tokenizer "
        '(make t5-smoke-tokenizer)'
    )
