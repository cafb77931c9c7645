"""What a model folder holds: the built-in configs, the Diffusers pipeline layout a folder must have (a UNet's, or a
diffusion transformer's), which parts carry weights, and what the denoiser's config says about its inputs (SDXL's
micro-conditioning, the pooled text width, a transformer's text encoders and caption lengths). Light on purpose: no
torch, so that the flags (flags.py) answer --help at once.
"""

import functools
import json
import os
from pathlib import Path

from arguments import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent / 'configs'
BUILTIN_MODELS = sorted(path.name for path in CONFIGS_DIR.iterdir() if path.is_dir())
# Files a model folder must hold: the layout of Diffusers' pipelines (stabilityai/stable-diffusion-2-base), and
# the second text encoder's that SDXL's adds (stabilityai/stable-diffusion-xl-base-1.0).
CONFIG_FILES = ('unet/config.json', 'vae/config.json', 'text_encoder/config.json', 'scheduler/scheduler_config.json')
SECOND_ENCODER_CONFIG = 'text_encoder_2/config.json'
# A diffusion transformer's folder (black-forest-labs/FLUX.1-schnell, stabilityai/stable-diffusion-3.5-medium,
# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS): transformer/ in place of unet/, and the text encoders its class takes, in
# the order its pipeline names them. T5's captions are longer than CLIP's 77 tokens: 256 for Flux.1-schnell (as
# MLPerf's flux1 benchmark and Diffusers' pipeline) and SD3 (its pipeline's default), 300 for PixArt-Sigma.
TRANSFORMER_CONFIG = 'transformer/config.json'
TRANSFORMER_TEXT_ENCODERS = {
    'FluxTransformer2DModel': ('text_encoder', 'text_encoder_2'),  # CLIP-L (pooled), T5-XXL
    'SD3Transformer2DModel': ('text_encoder', 'text_encoder_2', 'text_encoder_3'),  # CLIP-L, CLIP-G, T5-XXL
    'PixArtTransformer2DModel': ('text_encoder',),  # T5-XXL
}
T5_CAPTION_LENGTH = {'FluxTransformer2DModel': 256, 'SD3Transformer2DModel': 256, 'PixArtTransformer2DModel': 300}
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
        try:
            configs[name] = json.loads((path / name).read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise ModelFolderError(f'--model_name {model_name!r}: {path / name} is not valid JSON ({error})')
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
    return path


def check_transformer_folder(model_name: str, path: Path) -> None:
    """A diffusion transformer's folder: a transformer class this benchmark trains, and its configs."""
    try:
        class_name = json.loads((path / TRANSFORMER_CONFIG).read_text()).get('_class_name')
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelFolderError(f'--model_name {model_name!r}: {path / TRANSFORMER_CONFIG} is not valid JSON ({error})')
    if class_name not in TRANSFORMER_TEXT_ENCODERS:
        raise ModelFolderError(
            f'--model_name {model_name!r}: {TRANSFORMER_CONFIG} names {class_name!r}; the diffusion transformers '
            f'trained here are {", ".join(TRANSFORMER_TEXT_ENCODERS)}'
        )
    needed = [
        TRANSFORMER_CONFIG,
        'vae/config.json',
        *(f'{encoder}/config.json' for encoder in TRANSFORMER_TEXT_ENCODERS[class_name]),
        'scheduler/scheduler_config.json',
    ]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ModelFolderError(
            f'--model_name {model_name!r}: missing config file(s) {", ".join(missing)} in {path} '
            f"(a {class_name}'s folder holds {', '.join(needed)})"
        )
    for name in needed:
        try:
            json.loads((path / name).read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise ModelFolderError(f'--model_name {model_name!r}: {path / name} is not valid JSON ({error})')


def download_from_hub(model_name: str) -> Path:
    """A hub id's configs and first weight file of each part, when the network is allowed (HF_HUB_OFFLINE unset)."""
    looks_like_hub_id = model_name.count('/') == 1 and not model_name.startswith(('.', '/', '~'))
    if not looks_like_hub_id:
        raise ModelFolderError(
            f'--model_name {model_name!r}: not a built-in model ({", ".join(BUILTIN_MODELS)}) and no such folder'
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
    return any((model_dir / part / name).is_file() for name in WEIGHT_FILES[part])


def is_transformer_folder(model_dir: Path) -> bool:
    return (Path(model_dir) / TRANSFORMER_CONFIG).is_file()


def denoiser_config(model_dir: Path) -> dict:
    """The denoiser's config: the UNet's, or a diffusion transformer's (whose keys say what it takes)."""
    if is_transformer_folder(model_dir):
        return json.loads((Path(model_dir) / TRANSFORMER_CONFIG).read_text())
    return json.loads((model_dir / 'unet' / 'config.json').read_text())


@functools.cache
def transformer_family(model_dir: Path) -> str | None:
    """A diffusion transformer's class name (its family: Flux, SD3, PixArt), None for a UNet's folder; read once per
    folder, as precompute.py asks for every batch."""
    return denoiser_config(model_dir)['_class_name'] if is_transformer_folder(model_dir) else None


def text_encoder_folders(model_dir: Path) -> tuple[str, ...]:
    """The folder of each text encoder, in the order the denoiser's pipeline names them."""
    if is_transformer_folder(model_dir):
        return TRANSFORMER_TEXT_ENCODERS[transformer_family(model_dir)]
    return tuple(name for name in ('text_encoder', 'text_encoder_2') if (Path(model_dir) / name).is_dir())


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
