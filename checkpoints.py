"""Checkpoint folders that a killed run cannot poison.

Composer writes a checkpoint straight to its final name and then points `latest-rank0.pt` at it; autoresume
loads what that link names. A run killed while writing leaves a partial file: a resumed run then stops when it
reaches the same batch (Composer will not write over an existing file), and a partial file the link names
cannot be loaded at all. Before autoresume reads a local save folder, `set_aside_incomplete` renames every
incomplete checkpoint file and points the link at the newest complete one.
"""

import re
import zipfile
from pathlib import Path

# Composer's default names for the file rank 0 writes (all of a DDP or full-state FSDP checkpoint) and its link.
CHECKPOINT_FILE = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
LATEST_LINK = 'latest-rank0.pt'


def set_aside_incomplete(folder: Path) -> list[str]:
    """Renames incomplete checkpoint files to NAME.incomplete and links `latest-rank0.pt` to the newest complete
    one; returns a line for each thing it changed. A complete file is a whole zip archive (torch.save's format,
    whose index is written last); sharded checkpoints (folders) are left to Composer."""
    files = [path for path in folder.iterdir() if CHECKPOINT_FILE.match(path.name) and not path.is_symlink()]
    files.sort(key=lambda path: int(CHECKPOINT_FILE.match(path.name).group(2)))  # by batch
    changes, complete = [], []
    for path in files:
        if zipfile.is_zipfile(path):
            complete.append(path)
            continue
        aside = path.with_name(path.name + '.incomplete')
        path.rename(aside)
        changes.append(f'{path}: an incomplete checkpoint (a run killed while writing it?): renamed {aside.name}')
    latest = folder / LATEST_LINK
    if complete and (not latest.is_symlink() or latest.resolve() != complete[-1].resolve()):
        linked = latest.readlink().name if latest.is_symlink() else None
        was = (
            'nothing'
            if linked is None
            else linked
            if linked in {path.name for path in complete}
            else f'{linked}, incomplete'
        )
        latest.unlink(missing_ok=True)
        latest.symlink_to(complete[-1].name)
        changes.append(f'{latest}: now links the newest complete checkpoint {complete[-1].name} (it linked {was})')
    return changes
