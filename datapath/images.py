"""Image bytes -> the training image: decoded, EXIF orientation applied, made RGB, resized and center-cropped
to a square; or BadSample, naming why not. `unit_range` maps a batch of uint8 images to the VAE's [-1, 1].

torch is imported where a tensor is made, not at the top: convert.py checks images (and its flags) without it.
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

# Pillow's own decompression-bomb threshold (~89.5 megapixels): larger images are bad samples.
MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS


class BadSample(ValueError):
    """One sample that cannot be trained on: `kind` counts it, the message says why."""

    def __init__(self, kind: str, detail: str = ''):
        super().__init__(f'{kind}: {detail}' if detail else kind)
        self.kind = kind


def unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 images in [0, 255] -> floats in [-1, 1] (what ToTensor + Normalize(0.5, 0.5) give); floats pass."""
    import torch

    if images.dtype != torch.uint8:
        return images
    return images.float().div(127.5).sub(1).contiguous()  # from `collate`'s channels-last layout


def decode_image(data, size: int, max_pixels: int = MAX_IMAGE_PIXELS, draft: bool = True) -> torch.Tensor:
    """Image bytes -> uint8 tensor (3, size, size): EXIF orientation applied, any mode made RGB, shorter
    side resized to `size` and center-cropped (no aspect distortion). Raises BadSample otherwise."""
    image = rgb_image(data, size, max_pixels, draft)
    width, height = image.size
    if (width, height) != (size, size):
        # Resize the centered square straight to size x size: the same as resizing the shorter side,
        # then center-cropping, in one pass over fewer pixels.
        short = min(width, height)
        left, top = (width - short) / 2, (height - short) / 2
        image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + short, top + short), reducing_gap=3.0)
    with warnings.catch_warnings():
        # A read-only view of Pillow's pixel bytes, no copy: batching copies it (a fresh copy of 0.8 MB
        # costs about as much as the whole resize here, page faults included).
        warnings.simplefilter('ignore', UserWarning)
        import torch

        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


def check_image(data, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """Raises the BadSample decode_image would, at the least cost: a JPEG decoded at 1/8 scale (every byte of it is
    still read), nothing resized. What conversion checks before writing a sample."""
    rgb_image(data, 1, max_pixels, draft=True)


def rgb_image(data, size: int, max_pixels: int = MAX_IMAGE_PIXELS, draft: bool = True) -> Image.Image:
    """Image bytes -> the decoded RGB image with its EXIF orientation applied, a JPEG decoded at the smallest DCT
    scale that keeps its shorter side >= size when `draft`. Raises BadSample otherwise."""
    if isinstance(data, Image.Image):  # a column Streaming decodes itself ('jpeg', 'png', 'pil')
        image = data
    elif not isinstance(data, bytes):
        raise BadSample('no image bytes', f'got {type(data).__name__}')
    elif not data:
        raise BadSample('empty image bytes', 'a failed download')
    else:
        try:
            with warnings.catch_warnings():  # size is checked below, with a clearer message
                warnings.simplefilter('ignore', Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as error:
            raise BadSample('decompression bomb', str(error))
        except Image.UnidentifiedImageError:
            raise BadSample('not an image', f'the bytes start with {data[:32]!r}')
        except Exception as error:  # a header Pillow recognizes but cannot parse
            raise BadSample('corrupt image', f'{type(error).__name__}: {error}')
    width, height = image.size
    if width * height > max_pixels:
        raise BadSample('decompression bomb', f'{width}x{height} pixels, more than {max_pixels}')
    try:
        if draft and image.format == 'JPEG':
            # DCT-domain downscaling by 1/2, 1/4 or 1/8 while decoding, as far as the shorter side stays
            # >= size: up to 64x fewer pixels to decode and resize. A no-op below 2x the target.
            short = min(width, height)
            image.draft(None, (max(1, width * size // short), max(1, height * size // short)))
        image.load()  # decodes: truncated or corrupt data raises here
        orientation = image.getexif().get(0x0112, 1)  # EXIF Orientation
        if orientation in ORIENTATION_TRANSPOSE:
            image = image.transpose(ORIENTATION_TRANSPOSE[orientation])
        image = to_rgb(image)
    except BadSample:
        raise
    except Exception as error:
        raise BadSample('corrupt image', f'{type(error).__name__}: {error}')
    return image


def size_conditions(data, size: int) -> torch.Tensor:
    """SDXL's micro-conditioning of an image decode_image made: its original height and width (after EXIF
    orientation), the top-left corner of the center crop in the resized image (shorter side = size), and the
    target height and width. Reads only the header."""
    image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    width, height = image.size
    if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # a quarter turn swaps the sides
        width, height = height, width
    scale = size / min(width, height)
    top, left = round((height - min(width, height)) / 2 * scale), round((width - min(width, height)) / 2 * scale)
    import torch

    return torch.tensor([height, width, top, left, size, size], dtype=torch.float32)


ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == 'RGB':
        return image
    if image.mode.startswith('I') or image.mode == 'F':
        # 16-bit (and 32-bit) grey: Pillow's convert() clips at 255, turning most of the image white.
        array = np.asarray(image, dtype=np.float32)
        scale = 257.0 if image.mode.startswith('I;16') or array.max() > 255 else 1.0
        image = Image.fromarray(np.clip(array / scale, 0, 255).astype(np.uint8), 'L')
    if image.mode in ('RGBA', 'LA', 'PA', 'RGBa', 'La') or 'transparency' in image.info:
        # Transparent pixels hold arbitrary colors: composite onto white rather than dropping alpha.
        rgba = image.convert('RGBA')
        image = Image.alpha_composite(Image.new('RGBA', rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert('RGB')  # L, P, CMYK, YCbCr, 1, ...
