"""Loader throughput per worker (one core): StreamingLAIONDataset reading MDS shards of JPEGs and making
512px training batches (read, decode, EXIF, RGB, resize + center crop, uint8 tensor, CLIP tokens, batching),
against a bare Pillow loop over the same JPEG bytes held in memory: decode, resize the shorter side,
center-crop, to a uint8 tensor.

    .venv/bin/python benchmarks/loader_throughput.py [--images 48] [--rounds 3] [--size 512]

Sources are photo-like JPEGs (quality 90, 4:3) whose shorter side is 512, 768 or 1024 px. Target: the
loader at least 0.9x the bare loop; JPEG draft mode (DCT-domain downscaling) makes it faster on large
sources. Rounds alternate between the loops so drift in the machine's speed hits both; medians are shown.
Last, the loader cores one GPU needs at the published throughputs (16 and 137 img/s per GPU, see ANCHORS).
"""

import argparse
import datetime
import io
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')

# img/s per GPU: MosaicML's published benchmark (8 x A100-40GB), NVIDIA's MLPerf Training v4.1 (8 x H100).
ANCHORS = {'seed benchmark, 8x A100': 16.0, 'MLPerf v4.1, 8x H100': 137.0}
WORDS = 'a photo of the red old house near river with trees and blue sky at sunset in winter small dog cat'.split()


def photo_like(rng, width: int, height: int) -> bytes:
    """Smooth color regions plus fine grain: JPEG sizes and decode costs close to real photos'. `rng`: numpy's."""
    import numpy as np  # the heavy libraries load once the flags parse: --help answers without them
    from PIL import Image

    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.float32) + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, 'JPEG', quality=90)
    return buffer.getvalue()


def bare_pillow(data: bytes, size: int):
    """The bare loop's image: decoded, shorter side resized to `size`, center-cropped, as a uint8 tensor."""
    import numpy as np  # loaded by main() already: a lookup per image, not a load
    import torch
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert('RGB')
    scale = size / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


def rate(function, count: int) -> float:
    start = time.perf_counter()
    function()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--images', type=int, default=64, help='images per source size (each read 4 times)')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--size', type=int, default=512, help='training resolution')
    parser.add_argument('--batch_size', type=int, default=16)
    args = parser.parse_args()
    for flag in ('images', 'rounds', 'size', 'batch_size'):
        if getattr(args, flag) <= 0:
            parser.error(f'--{flag} {getattr(args, flag)}: must be positive')
    # Loaded once the flags parse: --help and a bad flag answer without torch or Streaming.
    import numpy as np
    import torch
    from streaming import MDSWriter

    from data import StreamingLAIONDataset, collate
    from datapath.images import decode_image

    torch.set_num_threads(1)  # one worker = one core
    warnings.simplefilter('ignore', UserWarning)  # torch.from_numpy on Pillow's read-only pixels
    rng = np.random.default_rng(0)
    words = random.Random(0)
    root = Path(tempfile.mkdtemp(prefix='loader-throughput-'))
    rows = []
    for short in (512, 768, 1024):
        images = [photo_like(rng, short * 4 // 3, short) for _ in range(args.images)]
        folder = root / f'{short}px'
        with MDSWriter(out=str(folder), columns={'jpg': 'bytes', 'caption': 'str'}) as writer:
            for data in images:
                writer.write({'jpg': data, 'caption': ' '.join(words.choices(WORDS, k=words.randint(5, 25)))})
        # An epoch of 4 passes over the files, so Streaming's per-epoch start is amortized as in real epochs.
        passes = 4
        dataset = StreamingLAIONDataset(
            local=str(folder),
            image_size=args.size,
            batch_size=args.batch_size,
            shuffle=False,
            epoch_size=passes * len(images),
        )

        def loader():
            batch = []
            for sample in dataset:
                batch.append(sample)
                if len(batch) == args.batch_size:
                    collate(batch)
                    batch = []

        loader()  # warm-up: page cache, tokenizer load
        timings = {'bare': [], 'nodraft': [], 'loader': []}
        for _ in range(args.rounds):
            timings['bare'].append(
                rate(lambda: [bare_pillow(d, args.size) for d in images * passes], passes * len(images))
            )
            timings['nodraft'].append(
                rate(lambda: [decode_image(d, args.size, draft=False) for d in images * passes], passes * len(images))
            )
            timings['loader'].append(rate(loader, passes * len(images)))
        medians = {key: statistics.median(values) for key, values in timings.items()}
        rows.append((short, sum(map(len, images)) / len(images) / 1024, medians))

    print_table(rows, args)


def cpu_name() -> str:
    if Path('/proc/cpuinfo').exists():
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    return platform.processor()


def print_table(rows: list, args: argparse.Namespace) -> None:
    print(
        f'{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores; {args.images} images per size, '
        f'median of {args.rounds} rounds, {args.size}px output, one core each'
    )
    print(
        f'{"source":>12} {"JPEG KB":>8} {"bare Pillow":>12} {"decode_image":>13} {"loader":>9} {"loader/bare":>12}'
        f' {"cores@16":>9} {"cores@137":>10}'
    )
    print(f'{"":>12} {"":>8} {"img/s":>12} {"(no draft)":>13} {"img/s":>9}')
    for short, kb, m in rows:
        print(
            f'{short * 4 // 3}x{short:<6} {kb:8.0f} {m["bare"]:12.1f} {m["nodraft"]:13.1f} {m["loader"]:9.1f} '
            f'{m["loader"] / m["bare"]:11.2f}x {16 / m["loader"]:9.2f} {137 / m["loader"]:10.2f}'
        )
    print(
        'cores@N: loader workers (cores) one GPU needs to feed N img/s, '
        + ', '.join(f'{n:g} img/s = {name}' for name, n in ANCHORS.items())
    )


if __name__ == '__main__':
    main()
