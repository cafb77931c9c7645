"""Inductor's and Triton's caches for the GPU campaign (gpu_campaign.py): one folder every row of a call compiles
into and reads from, packed into the campaign's folder at the end of a call and unpacked by the next call, which
carries the folder back: a compiled row whose graphs an earlier call compiled reads them instead of compiling.
Only what a later process reloads is packed, within what a lent machine returns (a file of at most 16 MiB)."""

import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

COMPILE_CACHE = Path(tempfile.gettempdir()) / 'gpu-campaign-compile-cache'
COMPILE_CACHE_FILE = 'compile-cache.tar.gz'
COMPILE_CACHE_LIMIT = 15 << 20  # bytes packed: a file over 16 MiB does not come back from a lent machine
# What a later process reloads: Inductor's compiled graphs (their code inside each entry) and AOT autograd's, and
# each Triton kernel's binary with its metadata. Triton's intermediate forms (.ttir, .ttgir, .llir, .ptx, the
# source) are for reading, not loading, and Inductor's generated modules are written again from the graph entries.
INDUCTOR_KEPT = ('fxgraph', 'aotautograd')
TRITON_KEPT = ('.cubin', '.hsaco', '.json')


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


def reloaded_files(cache: Path) -> list[Path]:
    """The cache's files a later process reloads (INDUCTOR_KEPT, TRITON_KEPT)."""
    inductor = [path for name in INDUCTOR_KEPT for path in (cache / 'inductor' / name).rglob('*') if path.is_file()]
    triton = [path for path in (cache / 'triton').rglob('*') if path.is_file() and path.suffix in TRITON_KEPT]
    return sorted(inductor + triton)


def kept_group(path: Path, kept: set[Path]) -> bytes:
    """A Triton group file naming only the files packed beside it (an older Triton misses a group naming one gone)."""
    group = json.loads(path.read_text())
    children = group.get('child_paths', {})
    group['child_paths'] = {name: child for name, child in children.items() if Path(child) in kept}
    return json.dumps(group).encode()


def keep_compile_cache(out: Path, cache: Path = COMPILE_CACHE) -> str | None:
    """Packs what reloads of `cache` into --out for the next call, where it fits COMPILE_CACHE_LIMIT; the line
    saying what was done."""
    files = reloaded_files(cache) if cache.is_dir() else []
    if not files:
        return None
    kept = set(files)
    packed = out / COMPILE_CACHE_FILE
    partial = packed.with_name(packed.name + '.partial')
    with tarfile.open(partial, 'w:gz') as archive:
        for path in files:
            info = archive.gettarinfo(path, arcname=str(path.relative_to(cache)))
            data = kept_group(path, kept) if path.name.startswith('__grp__') else path.read_bytes()
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    size = partial.stat().st_size
    if size > COMPILE_CACHE_LIMIT:
        partial.unlink()
        return f'compile cache: {size / 2**20:.0f} MiB packed, over {COMPILE_CACHE_LIMIT >> 20} MiB: not kept'
    partial.replace(packed)
    return f'compile cache: {len(files)} files kept in {packed} ({size / 2**20:.1f} MiB): carry it back'
