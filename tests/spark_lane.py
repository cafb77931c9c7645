"""The Spark route (datapath/spark_convert.py) in Spark's local mode: Parquet in Hugging Face's layout written as MDS
by Streaming's dataframe_to_mds, keeping and skipping the samples convert.py keeps and skips, and read by a training
run and precompute.py. Its own lane (make test-spark): it needs pyspark (requirements-spark.txt) and a Java runtime,
which make test's environment has not, so its file name is not one pytest collects by itself."""

import os
import sys

import pyspark
import pytest
from conftest import jpeg, settled
from pyspark.sql import SparkSession
from test_convert import read_mds, write_tar
from test_convert_parquet import write_hugging_face_parquet
from test_data import RecordSamples

import convert
import precompute
from datapath import spark_convert
from runs.run import main


@pytest.fixture(scope='module')
def spark():
    os.environ['PYSPARK_PYTHON'] = sys.executable  # the executors' Python: this environment's
    session = (
        SparkSession.builder.master('local[2]')
        .appName('spark_lane')
        .config('spark.ui.enabled', 'false')
        .config('spark.sql.shuffle.partitions', '2')
        # C1's quick compiles and the serial collector: a JVM of half a minute spends a fifth less CPU.
        .config('spark.driver.extraJavaOptions', '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC')
        .getOrCreate()
    )
    yield session
    session.stop()


def test_the_spark_route_keeps_and_skips_what_convert_py_does(spark, tmp_path):
    data = tmp_path / 'data'
    write_hugging_face_parquet(data / 'train-00000-of-00002.parquet', 0, 8)
    write_hugging_face_parquet(data / 'train-00001-of-00002.parquet', 10, 8)
    one = convert.convert([str(data)], str(tmp_path / 'convert'), progress=False)
    stats = spark_convert.spark_convert(spark.builder.getOrCreate(), [str(data)], str(tmp_path / 'spark'))
    assert stats['written'] == one['written'] == 12
    assert stats['skipped'] == one['skipped'] == {'not an image': 2, 'no caption': 2}
    assert sorted(reason for _, reason in stats['skipped_named']) == sorted(
        reason for _, reason in one['skipped_named']
    )
    # Spark's tasks write their parts in their own order: the same samples, not always in the same order.
    assert sorted(read_mds(tmp_path / 'spark')) == sorted(read_mds(tmp_path / 'convert'))
    with pytest.raises(convert.ConvertError, match='is not empty; pass --overwrite'):
        spark_convert.spark_convert(spark, [str(data)], str(tmp_path / 'spark'))

    record = RecordSamples()
    flags = ['--model_name', 'tiny', '--local', str(tmp_path / 'spark'), '--image_size', '32', '--batch_size', '3']
    trainer = main(settled([*flags, '--max_duration', '1ep']), (record,))
    assert int(trainer.state.timestamp.batch) == 4
    assert sorted(i for batch in record.batches for i in batch) == list(range(12))
    latents = ['--local', str(tmp_path / 'spark'), '--out', str(tmp_path / 'latents'), '--model_name', 'tiny']
    assert precompute.main([*latents, '--image_size', '32'])['encoded'] == 12


def test_the_spark_route_writes_nothing_when_every_row_is_skipped(spark, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({'image': [b'not an image'] * 3, 'caption': ['a', 'b', 'c']}), tmp_path / 'bad.parquet')
    with pytest.raises(convert.NothingWritten, match=r'no samples written, all 3 skipped \(3 not an image\)'):
        spark_convert.spark_convert(spark, [str(tmp_path / 'bad.parquet')], str(tmp_path / 'out'))
    assert not (tmp_path / 'out').exists()
    pq.write_table(pa.table({'url': ['http://a'], 'caption': ['a']}), tmp_path / 'links.parquet')
    with pytest.raises(convert.ConvertError, match='no image column .* among its columns url, caption'):
        spark_convert.spark_convert(spark, [str(tmp_path / 'links.parquet')], str(tmp_path / 'out'))
    (tmp_path / 'photos').mkdir()
    (tmp_path / 'photos' / 'a.jpg').write_bytes(jpeg(0))  # an image folder: convert.py's, not this route's
    with pytest.raises(convert.ConvertError, match=r'photos: no \.parquet or \.tar files at any depth'):
        spark_convert.spark_convert(spark, [str(tmp_path / 'photos')], str(tmp_path / 'out'))
    with pytest.raises(convert.ConvertError, match='missing: no such file or folder'):
        spark_convert.spark_convert(spark, [str(tmp_path / 'missing')], str(tmp_path / 'out'))
    assert not (tmp_path / 'out').exists()
    assert pyspark.__version__


def write_tars(folder) -> None:
    """Webdataset tars of img2dataset's layout (a sample's members in a row): five good samples, one without an
    image, one truncated image, and a third tar cut short (unreadable)."""
    folder.mkdir(parents=True)
    members = [
        (f'{i:09}.{ext}', jpeg(i) if ext == 'jpg' else f'tar caption {i}'.encode())
        for i in range(3)
        for ext in ('jpg', 'txt')
    ]
    members += [('000000003.txt', b'no image'), ('000000004.jpg', jpeg(4)[:400]), ('000000004.txt', b'truncated')]
    write_tar(folder / '00000.tar', members)
    write_tar(
        folder / '00001.tar',
        [(f'{i:09}.{ext}', jpeg(i) if ext == 'jpg' else b'second') for i in (10, 11) for ext in ('jpg', 'txt')],
    )
    write_tar(folder / '00002.tar', [('000020000.jpg', jpeg(20)), ('000020000.txt', b'cut')], truncate=700)


def test_webdataset_tars_beside_parquet_give_what_convert_py_gives(spark, tmp_path):
    data = tmp_path / 'data'
    write_tars(data / 'tars')
    write_hugging_face_parquet(data / 'parquet' / 'part-00000.parquet', 0, 8)
    one = convert.convert([str(data / 'tars'), str(data / 'parquet')], str(tmp_path / 'convert'), progress=False)
    stats = spark_convert.spark_convert(spark, [str(data)], str(tmp_path / 'spark'))
    assert stats['written'] == one['written'] == 5 + 6
    assert (
        stats['skipped']
        == one['skipped']
        == {
            'no image member': 1,
            'corrupt image': 1,
            'unreadable tar (ReadError), rest of the file skipped': 1,
            'not an image': 1,
            'no caption': 1,
        }
    )
    assert ('tars/00000.tar:000000003', 'no image member') in stats['skipped_named']
    assert sorted(read_mds(tmp_path / 'spark')) == sorted(read_mds(tmp_path / 'convert'))


def test_the_held_out_split_is_convert_pys_own(spark, tmp_path, capsys):
    """Hugging Face's split folders: the validation split is written apart, never trained on; with
    --validation_fraction, the samples held out are those convert.py holds out (the same hash of the same names)."""
    splits = tmp_path / 'splits'
    training = write_hugging_face_parquet(splits / 'train' / 'train-00000.parquet', 0, 8)
    validation = write_hugging_face_parquet(splits / 'validation' / 'validation-00000.parquet', 20, 5)
    write_hugging_face_parquet(splits / 'test' / 'test-00000.parquet', 40, 5)  # beside a validation split: unread
    stats = spark_convert.main([str(splits), str(tmp_path / 'split-out'), '--master', 'local[2]'])
    assert (stats['written'], stats['held_out']) == (len(training), len(validation)) == (6, 3)
    assert sorted(read_mds(tmp_path / 'split-out')) == sorted(training)
    assert sorted(read_mds(tmp_path / 'split-out' / 'validation')) == sorted(validation)
    assert (
        f"3 held out for validation in {tmp_path}/split-out/validation, the input's own split"
        in capsys.readouterr().out
    )
    with pytest.raises(convert.ConvertError, match='the input has its own validation split .* leave the flag out'):
        spark_convert.spark_convert(spark, [str(splits)], str(tmp_path / 'again'), validation_fraction=0.2)

    data = tmp_path / 'data'
    write_tars(data / 'tars')
    write_hugging_face_parquet(data / 'parquet' / 'part-00000.parquet', 0, 8)
    inputs = [str(data / 'tars'), str(data / 'parquet')]
    one = convert.convert(inputs, str(tmp_path / 'convert'), progress=False, validation_fraction=0.4)
    stats = spark_convert.spark_convert(spark, inputs, str(tmp_path / 'spark'), validation_fraction=0.4)
    assert 0 < one['held_out'] < one['held_out'] + one['written']  # both sides hold samples
    assert (stats['written'], stats['held_out']) == (one['written'], one['held_out'])
    assert stats['skipped'] == one['skipped']
    for split in ('', 'validation'):
        assert sorted(read_mds(tmp_path / 'spark' / split)) == sorted(read_mds(tmp_path / 'convert' / split))
