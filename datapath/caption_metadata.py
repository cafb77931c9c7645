"""Captions kept as Hugging Face's image-folder convention, which Diffusers' training examples read: a
`metadata.jsonl` (one JSON object a line) or `metadata.csv` (a header row) in a folder, each row naming an image by
`file_name` (relative to that folder) and holding its caption in a text column. convert.py reads them for a folder
of images that has no same-name .txt captions."""

import csv
import json
import os
from pathlib import Path

METADATA_FILES = ('metadata.jsonl', 'metadata.csv')
# The caption column when --caption_column is not given: the first of these the file has (Diffusers' examples
# default to 'text').
CAPTION_COLUMNS = ('text', 'caption', 'prompt')


class CaptionMetadataError(ValueError):
    """A metadata file that cannot be read as captions: one line naming the file, the row and what is wrong."""


def metadata_captions(folder: Path, column: str | None = None) -> dict[Path, str]:
    """The captions every metadata file under `folder` (linked folders followed, each once) gives, by the image's
    path as the folder walk names it."""
    captions, seen = {}, set()
    for root, folders, files in os.walk(folder, followlinks=True):
        if os.path.realpath(root) in seen:
            folders.clear()
            continue
        seen.add(os.path.realpath(root))
        for name in METADATA_FILES:
            if name in files:
                for file_name, caption in read_metadata(Path(root, name), column):
                    captions[Path(root, file_name)] = caption
    return captions


def read_metadata(path: Path, column: str | None) -> list[tuple[str, str]]:
    """(file_name, caption) of each row of one metadata file."""
    try:
        text = path.read_text(encoding='utf-8-sig')  # a spreadsheet's CSV may start with a byte-order mark
    except (OSError, UnicodeDecodeError) as error:
        raise CaptionMetadataError(f'{path}: cannot be read as UTF-8 text ({error})')
    if path.suffix == '.jsonl':
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise CaptionMetadataError(f'{path}: line {number} is not JSON ({error.msg} at column {error.colno})')
            if not isinstance(row, dict):
                raise CaptionMetadataError(f'{path}: line {number} is not a JSON object')
            rows.append((number, row))
        where = 'line'
    else:
        rows = list(enumerate(csv.DictReader(text.splitlines()), 2))  # row 1: the header
        where = 'row'
    if not rows:
        return []
    caption_column = column or next((name for name in CAPTION_COLUMNS if name in rows[0][1]), None)
    if caption_column is None:
        raise CaptionMetadataError(
            f'{path}: no caption column ({", ".join(CAPTION_COLUMNS)}) among {", ".join(map(str, rows[0][1]))}; '
            'name it with --caption_column'
        )
    pairs = []
    for number, row in rows:
        if not row.get('file_name'):
            raise CaptionMetadataError(f'{path}: {where} {number} has no file_name (the image it captions)')
        if caption_column not in row:
            raise CaptionMetadataError(f'{path}: {where} {number} has no {caption_column!r} column')
        caption = row[caption_column]
        pairs.append((str(row['file_name']), '' if caption is None else str(caption)))
    return pairs
