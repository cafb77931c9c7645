"""Image-caption pairs from Parquet files, read one row group at a time (a file of many gigabytes is never held in
memory whole): Hugging Face's layout, as `datasets` writes it (an `image` column of {bytes, path} structs, or of
bytes; the caption in `text` or `caption`), and img2dataset's (`jpg` bytes, `caption`).

Each sample is (name, image bytes or None, caption or None, reason to skip or None), as convert.py's other readers
yield them; a sample's name is its file and row ('train-00000.parquet:17').
"""

from pathlib import Path

from datapath.caption_metadata import CAPTION_COLUMNS

IMAGE_COLUMNS = ('image', 'jpg', 'jpeg', 'png', 'webp', 'img')
BATCH_ROWS = 256  # rows decoded from Arrow to Python at once, within a row group


class ParquetLayoutError(ValueError):
    """A Parquet file whose columns fit no known layout: one line naming the file and listing its columns."""


def parquet_layout(path: Path, caption_column: str | None = None) -> tuple[str, str]:
    """The image column and the caption column of a Parquet file, from its schema alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    names = schema.names

    def holds_image(name: str) -> bool:
        kind = schema.field(name).type
        if pa.types.is_struct(kind):
            return kind.get_field_index('bytes') >= 0
        return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)

    return pick_columns(str(path), names, holds_image, caption_column)


def pick_columns(where: str, names: list[str], holds_image, caption_column: str | None) -> tuple[str, str]:
    """The image column (the first of IMAGE_COLUMNS that holds_image) and the caption column (caption_column, else
    the first of CAPTION_COLUMNS) among a table's column names; the Spark route picks its DataFrame's alike."""
    image = next((name for name in IMAGE_COLUMNS if name in names and holds_image(name)), None)
    captions = (caption_column,) if caption_column else CAPTION_COLUMNS
    caption = next((name for name in captions if name in names), None)
    if image is None or caption is None:
        wanted = []
        if image is None:
            wanted.append(f'image column ({", ".join(IMAGE_COLUMNS)}: bytes, or a struct with bytes)')
        if caption is None:
            wanted.append(f'caption column ({", ".join(captions)}{"" if caption_column else "; or --caption_column"})')
        raise ParquetLayoutError(f'{where}: no {" and no ".join(wanted)} among its columns {", ".join(names)}')
    return image, caption


def row_groups(path: Path) -> list[tuple[int, int, int, int]]:
    """(row group, its first row, its bytes, its rows) of each row group of a file: the pieces convert.py shares
    out."""
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    groups, first = [], 0
    for number in range(metadata.num_row_groups):
        group = metadata.row_group(number)
        groups.append((number, first, group.total_byte_size, group.num_rows))
        first += group.num_rows
    return groups


def parquet_samples(path: Path, groups: list[tuple[int, int, int, int]], image_column: str, caption_column: str):
    """The samples of some row groups of a file, in row order."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as parquet:
        for number, first, *_ in groups:
            batches = parquet.iter_batches(BATCH_ROWS, row_groups=[number], columns=[image_column, caption_column])
            row = first
            for batch in batches:
                for image, caption in zip(*(batch.column(name).to_pylist() for name in (image_column, caption_column))):
                    if isinstance(image, dict):
                        image = image.get('bytes')
                    reason = 'no image' if image is None else 'no caption' if caption is None else None
                    yield f'{path}:{row}', image, caption, reason
                    row += 1
