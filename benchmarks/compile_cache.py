"""Inductor's and Triton's caches for the GPU campaign (gpu_campaign.py): one folder every row of a call compiles
into and reads from, packed into the campaign's folder at the end of a call and unpacked by the next call, which
carries the folder back: a compiled row whose graphs an earlier call compiled reads them instead of compiling."""

import os
import tarfile
import tempfile
from pathlib import Path

# Inductor's and Triton's caches, kept across the rows of a call (every row's process reads them) and across calls:
# packed into --out at the end of a call, which the next call carries back, and unpacked before its first row.
# Compiling is most of a compiled row's time (docs/speed.md has the figures); a cache hit skips most of it.
COMPILE_CACHE = Path(tempfile.gettempdir()) / 'gpu-campaign-compile-cache'
COMPILE_CACHE_FILE = 'compile-cache.tar.gz'
COMPILE_CACHE_LIMIT = 24 << 20  # bytes packed: what a call's carry holds beside the wheels (64 MiB in all)


def use_compile_cache(out: Path, cache: Path = COMPILE_CACHE) -> str | None:
    """Points the rows' Inductor and Triton at `cache`, first unpacking the one --out holds; the line saying so."""
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', str(cache / 'inductor'))
    os.environ.setdefault('TRITON_CACHE_DIR', str(cache / 'triton'))
    packed = out / COMPILE_CACHE_FILE
    if not packed.is_file() or (cache.is_dir() and any(cache.iterdir())):
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(packed) as archive:
        archive.extractall(cache, filter='data')
    return f'compile cache: {packed} unpacked into {cache}'


def keep_compile_cache(out: Path, cache: Path = COMPILE_CACHE) -> str | None:
    """Packs `cache` into --out for the next call, where it fits COMPILE_CACHE_LIMIT; the line saying what was done."""
    files = [path for path in cache.rglob('*') if path.is_file()] if cache.is_dir() else []
    if not files:
        return None
    packed = out / COMPILE_CACHE_FILE
    partial = packed.with_name(packed.name + '.partial')
    with tarfile.open(partial, 'w:gz') as archive:
        for path in files:
            archive.add(path, arcname=str(path.relative_to(cache)))
    size = partial.stat().st_size
    if size > COMPILE_CACHE_LIMIT:
        partial.unlink()
        return f'compile cache: {size / 2**20:.0f} MiB packed, over {COMPILE_CACHE_LIMIT >> 20} MiB: not kept'
    partial.replace(packed)
    return f'compile cache: {len(files)} files kept in {packed} ({size / 2**20:.1f} MiB): carry it back'
