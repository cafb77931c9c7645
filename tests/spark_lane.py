"""The Spark route (datapath/spark_convert.py) in Spark's local mode: Parquet in Hugging Face's layout written as MDS
by Streaming's dataframe_to_mds, keeping and skipping the samples convert.py keeps and skips, and read by a training
run and precompute.py. Its own lane (make test-spark): it needs pyspark (requirements-spark.txt) and a Java runtime,
which make test's environment has not, so its file name is not one pytest collects by itself."""

import os
import sys

import pyspark
import pytest
from conftest import settled
from pyspark.sql import SparkSession
from test_convert import read_mds
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
    assert pyspark.__version__
