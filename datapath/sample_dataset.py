"""The sample dataset: a few hundred generated JPEGs of colored shapes with captions that describe them, which
benchmark.py trains on when no dataset is given (presets.SAMPLE_DATASET), with a held-out split of its own for the
validation loss (presets.SAMPLE_VALIDATION_DATASET). MDS shards in convert.py's columns, written once, on first use:
by the run before it builds its datasets (run.write_sample_datasets), and by precompute.py when it reads it.
"""

import io
import os
import random
import shutil
import time
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

from guards.outputs import WriteFailed, free_space_fix, system_reason
from settings.dataset_checks import IMAGE_CAPTION_COLUMNS, SHARD_HASH, DataError
from settings.presets import SAMPLE_DATASET, SAMPLE_SIZE

COLORS = {
    'red': (215, 48, 39),
    'orange': (244, 140, 40),
    'yellow': (250, 215, 60),
    'green': (60, 160, 70),
    'blue': (50, 100, 200),
    'purple': (130, 70, 170),
    'white': (245, 245, 245),
    'black': (20, 20, 20),
    'gray': (128, 128, 128),
}
SHAPES = ('circle', 'square', 'triangle')
SIZES = ((512, 512), (640, 512), (512, 640), (768, 512), (576, 768))  # width x height, shorter side >= 512


def generated_sample(rng: random.Random) -> tuple[bytes, str]:
    """A JPEG of one to three colored shapes on a gradient, and a caption that describes it."""
    width, height = rng.choice(SIZES)
    background, shade = rng.sample(sorted(COLORS), 2)
    image = ImageOps.colorize(Image.linear_gradient('L').resize((width, height)), COLORS[background], COLORS[shade])
    draw = ImageDraw.Draw(image)
    parts = []
    for _ in range(rng.randint(1, 3)):
        color = rng.choice([c for c in COLORS if c not in (background, shade)])
        shape = rng.choice(SHAPES)
        r = rng.randint(40, min(width, height) // 4)
        x, y = rng.randint(r, width - r), rng.randint(r, height - r)
        if shape == 'circle':
            draw.ellipse((x - r, y - r, x + r, y + r), fill=COLORS[color])
        elif shape == 'square':
            draw.rectangle((x - r, y - r, x + r, y + r), fill=COLORS[color])
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLORS[color])
        parts.append(f'a {color} {shape}')
    buffer = io.BytesIO()
    image.save(buffer, 'JPEG', quality=90)
    return buffer.getvalue(), f'{" and ".join(parts)} on a {background} background'


def ensure_sample_dataset(
    path: Path = SAMPLE_DATASET, num_samples: int = SAMPLE_SIZE, seed: int = 0, broken: bool = True
) -> Path:
    """Build the generated dataset once (local rank 0; other ranks wait) and return its folder.

    Two samples are written as they come in real crawls, an empty download and an HTML error page, so a
    first run also exercises the bad-sample path; the loader replaces them and says so (unless broken=False).
    """
    path = Path(path)
    if (path / 'index.json').is_file():
        return path
    if int(os.environ.get('LOCAL_RANK', '0')) != 0:
        deadline = time.monotonic() + 600
        while not (path / 'index.json').is_file():
            if time.monotonic() > deadline:
                raise DataError(f'{path}: local rank 0 did not finish building the sample dataset')
            time.sleep(0.5)
        return path
    work = path.parent / f'.{path.name}-{os.getpid()}'
    rng = random.Random(seed)
    from streaming import MDSWriter

    try:
        with MDSWriter(out=str(work), columns=IMAGE_CAPTION_COLUMNS, exist_ok=True, hashes=[SHARD_HASH]) as writer:
            for index in range(num_samples):
                image, caption = generated_sample(rng)
                if broken and index == num_samples // 3:
                    image = b''
                elif broken and index == 2 * num_samples // 3:
                    image = b'<!DOCTYPE html><html><body><h1>404 Not Found</h1></body></html>'
                writer.write({'jpg': image, 'caption': caption})
    except OSError as error:  # a full disk: the hidden folder goes, and the line names the dataset
        shutil.rmtree(work, ignore_errors=True)
        fix = free_space_fix(error, 'run again, which builds it')
        raise WriteFailed(f'{path} (the sample dataset)', system_reason(error), 'nothing written', fix) from error
    if path.exists():
        shutil.rmtree(path)  # a folder without index.json: left by an interrupted build
    try:
        work.rename(path)
    except OSError:  # another process (another node on a shared file system) finished first
        shutil.rmtree(work, ignore_errors=True)
    return path
