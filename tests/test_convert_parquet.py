"""convert.py on Parquet (Hugging Face's layout, as `datasets` writes it, and img2dataset's), read by row group, and
on Hugging Face's split folders and split files: `train` is the training set, `validation` (else `test`) the
validation split."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, jpeg
from test_convert import read_mds

import convert


def arrow():
    """pyarrow, imported by the tests that run (requirements-data.txt): a lane whose environment has not it, which
    runs none of them, still collects this file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def write_hugging_face_parquet(path: Path, first: int, n: int, row_group_size: int = 3) -> list[tuple[bytes, str]]:
    """n rows of `image` {bytes, path} and `text`, one of them not an image and one without a caption; returns the
    (bytes, caption) that should be written, in order."""
    pa, pq = arrow()
    images, texts, expected = [], [], []
    for i in range(first, first + n):
        image = b'<html>404</html>' if i == first + 1 else jpeg(i, (24, 16))
        text = None if i == first + 2 else f' photo {i} '
        images.append({'bytes': image, 'path': f'{i}.jpg'})
        texts.append(text)
        if i not in (first + 1, first + 2):
            expected.append((image, text.strip()))
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            'image': pa.array(images, pa.struct([('bytes', pa.binary()), ('path', pa.string())])),
            'text': pa.array(texts, pa.string()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return expected


@pytest.mark.parametrize('workers', [1, 2])
def test_hugging_face_parquet_with_an_undecodable_row_skipped(tmp_path, workers):
    _, pq = arrow()
    expected = write_hugging_face_parquet(tmp_path / 'data.parquet', 0, 10)
    assert pq.ParquetFile(tmp_path / 'data.parquet').metadata.num_row_groups == 4  # read one at a time
    stats = convert.convert([str(tmp_path / 'data.parquet')], str(tmp_path / 'out'), progress=False, workers=workers)
    assert stats['skipped'] == {'not an image': 1, 'no caption': 1}
    assert stats['skipped_named'] == [
        (f'{tmp_path}/data.parquet:1', 'not an image'),
        (f'{tmp_path}/data.parquet:2', 'no caption'),
    ]
    assert read_mds(tmp_path / 'out') == expected


def test_img2dataset_parquet_of_jpg_bytes(tmp_path):
    pa, pq = arrow()
    rows = {
        'key': ['000000000', '000000001'],
        'url': ['http://a', 'http://b'],
        'jpg': [jpeg(1), jpeg(2)],
        'caption': ['a barn', 'a quay'],
        'status': ['success', 'success'],
    }
    (tmp_path / 'laion').mkdir()
    pq.write_table(pa.table(rows), tmp_path / 'laion' / '00000.parquet')
    convert.convert([str(tmp_path / 'laion')], str(tmp_path / 'out'), progress=False)
    assert read_mds(tmp_path / 'out') == [(jpeg(1), 'a barn'), (jpeg(2), 'a quay')]


def test_a_parquet_file_of_other_columns_is_refused_in_one_line_listing_them(tmp_path):
    pa, pq = arrow()
    pq.write_table(pa.table({'url': ['http://a'], 'width': [64]}), tmp_path / 'links.parquet')
    run = subprocess.run(
        [sys.executable, str(REPO / 'convert.py'), str(tmp_path / 'links.parquet'), str(tmp_path / 'out')],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f'error: {tmp_path}/links.parquet: no image column (image, jpg, jpeg, png, webp, img: bytes, or a struct '
        'with bytes) and no caption column (text, caption, prompt; or --caption_column) among its columns url, width'
    ]
    assert not (tmp_path / 'out').exists()
    pq.write_table(pa.table({'image': [jpeg(3)], 'alt': ['a lighthouse']}), tmp_path / 'alt.parquet')
    convert.convert([str(tmp_path / 'alt.parquet')], str(tmp_path / 'out'), caption_column='alt', progress=False)
    assert read_mds(tmp_path / 'out') == [(jpeg(3), 'a lighthouse')]


def test_hugging_face_split_files_give_the_training_set_and_the_validation_split(tmp_path):
    data = tmp_path / 'dataset' / 'data'
    training = write_hugging_face_parquet(data / 'train-00000-of-00002.parquet', 0, 6)
    training += write_hugging_face_parquet(data / 'train-00001-of-00002.parquet', 6, 6)
    validation = write_hugging_face_parquet(data / 'validation-00000-of-00001.parquet', 20, 5)
    write_hugging_face_parquet(data / 'test-00000-of-00001.parquet', 40, 5)  # a validation split is there: unread
    stats = convert.convert([str(tmp_path / 'dataset')], str(tmp_path / 'out'), progress=False, workers=2)
    assert (stats['written'], stats['held_out']) == (len(training), len(validation))
    assert read_mds(tmp_path / 'out') == training
    assert read_mds(tmp_path / 'out' / 'validation') == validation


def write_image_folder(folder: Path, first: int, n: int) -> list[tuple[bytes, str]]:
    folder.mkdir(parents=True)
    rows = []
    for i in range(first, first + n):
        (folder / f'{i:03}.jpg').write_bytes(jpeg(i, (24, 16)))
        rows.append({'file_name': f'{i:03}.jpg', 'text': f'photo {i}'})
    (folder / 'metadata.jsonl').write_text(''.join(json.dumps(row) + '\n' for row in rows))
    return [(jpeg(i, (24, 16)), f'photo {i}') for i in range(first, first + n)]


@pytest.mark.parametrize('held_out', ['validation', 'test'])
def test_split_image_folders_keep_the_validation_images_out_of_training(tmp_path, held_out, capsys):
    training = write_image_folder(tmp_path / 'mydata' / 'train', 0, 24)
    validation = write_image_folder(tmp_path / 'mydata' / held_out, 100, 12)
    stats = convert.main([str(tmp_path / 'mydata'), str(tmp_path / 'out')])
    assert (stats['written'], stats['held_out']) == (24, 12)
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(
            f'wrote 24 training samples in 1 shard(s) to {tmp_path}/out, 12 held out for validation in '
            f"{tmp_path}/out/validation, the input's own split, in "
        )
    )
    assert read_mds(tmp_path / 'out') == training
    assert read_mds(tmp_path / 'out' / 'validation') == validation
    refused = rf'--validation_fraction 0.2: the input has its own {held_out} split .*; leave the flag out'
    with pytest.raises(convert.ConvertError, match=refused):
        convert.main([str(tmp_path / 'mydata'), str(tmp_path / 'again'), '--validation_fraction', '0.2'])
