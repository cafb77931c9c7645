"""A run's record: the settings a run of benchmark.py trained with (runs/checkpoints.RunDescription's: its model,
size, batch, prediction type and tokenizer), as a small JSON file beside its checkpoints in a local save folder and
in the pipeline folder it exports. Read without torch: generate.py takes its flags' defaults from the record beside
a checkpoint, and a run on an exported folder the size and batch it trained at.

Light on purpose (no torch): generate.py answers a bad flag before torch loads.
"""

import json
import os
import zipfile
from pathlib import Path

from guards.arguments import ConfigError

RUN_DESCRIPTION_FILE = 'run_description.json'
ZIP_START = b'PK\x03\x04'  # the first bytes of a zip archive, as torch.save writes a checkpoint


def write_run_description(folder: Path, description: dict) -> None:
    """Writes the record into `folder` whole or not at all (a reader never finds half a file)."""
    record = Path(folder) / RUN_DESCRIPTION_FILE
    partial = record.with_name(f'.{record.name}.partial')
    try:
        partial.write_text(json.dumps(description, indent=2) + '\n')
        os.replace(partial, record)
    finally:
        partial.unlink(missing_ok=True)


def exported_run(model_dir: Path, fix: str) -> dict:
    """The run description of a folder benchmark.py --export_pipeline wrote, {} for another folder; ConfigError,
    ending in `fix`, where the file is not a JSON object."""
    return read_run_description(Path(model_dir) / RUN_DESCRIPTION_FILE, fix) or {}


def recorded_beside(checkpoint: str, fix: str) -> dict | None:
    """The record of the run whose save folder holds `checkpoint`; None where there is none beside it (a checkpoint
    copied on its own, one of an older version: its record is inside, read once torch loads it)."""
    return read_run_description(Path(checkpoint).parent / RUN_DESCRIPTION_FILE, fix)


def resumed_record(save_folder: str | None, autoresume: bool) -> dict:
    """The record of the run --autoresume continues: the one beside the checkpoints of a local save folder (that of
    the newest written whole), {} where there is none (a new folder, one on S3, a run of an older version)."""
    if not autoresume or not save_folder or '://' in save_folder:
        return {}
    fix = 'remove it (the checkpoints hold the same record), or start over with a new --save_folder'
    return read_run_description(Path(save_folder) / RUN_DESCRIPTION_FILE, fix) or {}


def resumed_cpu_threads(threads: int | None, given: bool, record: dict) -> tuple[int | None, str | None]:
    """The CPU thread count a resumed run trains with, and a line to print where it differs from this process's:
    the checkpoint's, which its weights were trained with, where this run chose its own (so the continuation is
    bitwise the uninterrupted run's on any machine); a count given that differs is kept, with a warning."""
    recorded = record.get('cpu_threads')
    if recorded is None or threads is None or recorded == threads:
        return threads, None
    if given:
        return threads, (
            f'warning: cpu threads: {threads} given, where the checkpoint was trained with {recorded}: '
            'the continuation will not be bitwise what one uninterrupted run trains'
        )
    return recorded, (
        f"cpu threads: {recorded}, the checkpoint's (this process would choose {threads}): the same count keeps the "
        'continuation bitwise; --cpu_threads N sets another'
    )


def read_run_description(record: Path, fix: str) -> dict | None:
    if not record.is_file():
        return None
    try:
        description = json.loads(record.read_text())
    except (ValueError, UnicodeDecodeError):
        description = None
    if not isinstance(description, dict):
        raise ConfigError(f'{record}: not the JSON object of a run description; {fix}')
    return description


def not_a_checkpoint(path: str) -> str | None:
    """What the file is instead of a checkpoint (torch.save's zip archive, its pickle inside), or None where it is
    one: the archive's directory only, so that an empty, cut-off or wrong file is named in one line before torch
    loads."""
    size = os.path.getsize(path)
    if size == 0:
        return 'an empty file, not a checkpoint'
    with open(path, 'rb') as file:
        head = file.read(4)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        if head == ZIP_START:  # a zip's directory is at its end: a file cut short has none
            return f'a checkpoint cut short ({size:,} bytes and no end: a copy or a write that stopped part way?)'
        if head.lstrip()[:1] in (b'{', b'['):
            return 'a JSON file (a results file?), not a checkpoint'
        return 'not a checkpoint (not the zip archive torch.save writes)'
    if not any(name.endswith('/data.pkl') for name in names):
        return 'a zip archive without the pickle a checkpoint holds (data.pkl), not a checkpoint'
    return None
