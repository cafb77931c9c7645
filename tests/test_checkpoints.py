"""--save_num_checkpoints_to_keep: the newest N checkpoints kept in the save folder, across resumptions too, and
the values Composer would take badly refused."""

import os
import sys

import pytest
from conftest import TINY, run_process, settled

from guards.arguments import ConfigError
from runs.run import main
from settings.config import resolve_config
from settings.flags import parse_args

KEPT = [*TINY, '--image_size', '32', '--batch_size', '4', '--save_interval', '1ba', '--run_name', 'kept']


def files(folder):
    """The folder's entries by name, a link as 'NAME -> TARGET'."""
    return sorted(f'{path.name} -> {path.readlink()}' if path.is_symlink() else path.name for path in folder.iterdir())


@pytest.mark.stack
def test_the_newest_checkpoints_are_kept_and_autoresume_continues_from_the_newest(tmp_path, capfd):
    folder = tmp_path / 'ckpt'
    keep = ['--save_folder', str(folder), '--save_num_checkpoints_to_keep', '2']
    main(settled([*KEPT, *keep, '--max_duration', '3ba']))
    kept = ['ep0-ba2-rank0.pt', 'ep0-ba3-rank0.pt', 'latest-rank0.pt -> ep0-ba3-rank0.pt']
    assert files(folder) == [*kept, 'run_description.json']  # the run's record beside them (generate.py's)
    capfd.readouterr()
    # Composer counts only the files its own process wrote: the resumed run deletes the first process's too.
    trainer = main(settled([*KEPT, *keep, '--max_duration', '5ba', '--autoresume']))
    assert "resumed run 'kept' from ep0-ba3-rank0.pt (batch 3 of 5)" in capfd.readouterr().out
    assert int(trainer.state.timestamp.batch) == 5
    kept = ['ep0-ba4-rank0.pt', 'ep0-ba5-rank0.pt', 'latest-rank0.pt -> ep0-ba5-rank0.pt']
    assert files(folder) == [*kept, 'run_description.json']


@pytest.mark.stack
def test_a_checkpoint_set_aside_as_incomplete_is_neither_counted_nor_deleted(tmp_path):
    folder = tmp_path / 'ckpt'
    keep = ['--save_folder', str(folder), '--save_num_checkpoints_to_keep', '1']
    main(settled([*KEPT, *keep, '--max_duration', '2ba']))
    (folder / 'ep0-ba3-rank0.pt').write_bytes(b'cut short')  # killed while writing batch 3's
    main(settled([*KEPT, *keep, '--max_duration', '3ba', '--autoresume']))
    assert files(folder) == [
        'ep0-ba3-rank0.pt',
        'ep0-ba3-rank0.pt.incomplete',
        'latest-rank0.pt -> ep0-ba3-rank0.pt',
        'run_description.json',
    ]


def test_every_checkpoint_is_kept_by_default(tmp_path):
    config = resolve_config(parse_args([*KEPT, '--save_folder', str(tmp_path / 'ckpt')]))
    assert config.outputs.save_num_checkpoints_to_keep == -1


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--save_num_checkpoints_to_keep', '0'], '--save_num_checkpoints_to_keep 0: keep 1 or more, or -1 for all'),
        (['--save_num_checkpoints_to_keep', '-2'], '--save_num_checkpoints_to_keep -2: keep 1 or more, or -1 for all'),
        (
            ['--save_num_checkpoints_to_keep', '2', '--save_folder', 's3://bucket/ckpt'],
            '--save_num_checkpoints_to_keep 2: deletes checkpoints of a local --save_folder only (s3://bucket/ckpt); '
            'pass one, or leave the flag out',
        ),
        (
            ['--save_num_checkpoints_to_keep', '2'],
            '--save_num_checkpoints_to_keep 2: deletes checkpoints of a local --save_folder only (none given); '
            'pass one, or leave the flag out',
        ),
    ],
)
def test_numbers_of_checkpoints_composer_would_take_badly_are_refused(flags, message):
    with pytest.raises(ConfigError) as error:
        resolve_config(parse_args([*KEPT, *flags]))
    assert str(error.value) == message


def test_a_resumption_onto_data_converted_again_or_replaced_is_refused_in_one_line(tmp_path):
    """The checkpoint records its dataset's samples and index digest: the same data written again resumes; smaller
    data (Streaming's traceback before) or other images of the same count are refused before anything trains."""
    import shutil

    from conftest import good_samples, write_dataset

    data, folder = tmp_path / 'mds', tmp_path / 'ckpt'
    flags = ['--model_name', 'tiny', '--image_size', '32', '--batch_size', '4', '--local', str(data)]
    flags += ['--save_folder', str(folder), '--save_interval', '2ba', '--run_name', 'moved']

    def rewrite(samples):
        shutil.rmtree(data, ignore_errors=True)
        write_dataset(data, samples)

    rewrite(good_samples(24))
    main(settled([*flags, '--max_duration', '2ba']))
    rewrite(good_samples(16))
    refused = r'trained on a dataset of 24 samples, index \w+; .*mds now holds 16 samples, index \w+ \(converted again'
    with pytest.raises(ConfigError, match=refused):
        main(settled([*flags, '--max_duration', '4ba', '--autoresume']))
    rewrite([{**sample, 'caption': 'another'} for sample in good_samples(23)] + good_samples(30)[29:])
    with pytest.raises(ConfigError, match='now holds 24 samples, index'):  # as many samples, other images
        main(settled([*flags, '--max_duration', '4ba', '--autoresume']))
    rewrite(good_samples(24))  # the same data, written again
    assert int(main(settled([*flags, '--max_duration', '4ba', '--autoresume'])).state.timestamp.batch) == 4


@pytest.mark.slow
def test_autoresume_on_s3_goes_on_from_the_newest_checkpoint_where_the_latest_link_lags(s3, tmp_path):
    """A run killed outright after a checkpoint's upload but before Composer pointed the latest link at it: the
    resumed run went on from the checkpoint before, trained to the newer one again and stopped on `Object ...
    already exists`. The link is pointed at the newest checkpoint first."""
    from conftest import REPO, s3_client

    def run(*args):  # benchmark.py in a working directory of its own, where Composer downloads what it resumes
        env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
        command = [sys.executable, str(REPO / 'benchmark.py'), *args]
        return run_process(command, cwd=tmp_path, env=env, timeout=600)

    flags = [*TINY, '--image_size', '32', '--batch_size', '4', '--save_folder', 's3://bucket/lagging']
    flags += ['--run_name', 'r', '--save_interval', '6ba']
    first = run(*flags, '--max_duration', '12ba')
    assert first.returncode == 0, first.stderr[-3000:]
    # The copy an earlier resumption in this directory left, which Composer would load rather than ask S3 again.
    stale = tmp_path / 's3:' / 'bucket' / 'lagging' / 'latest-rank0.pt'
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b'an earlier resumption of another checkpoint')
    client = s3_client(s3)
    link = client.get_object(Bucket='bucket', Key='lagging/latest-rank0.pt.symlink')['Body'].read().decode()
    assert link.strip() == 'lagging/ep0-ba12-rank0.pt'
    client.put_object(Bucket='bucket', Key='lagging/latest-rank0.pt.symlink', Body=b'lagging/ep0-ba6-rank0.pt')

    resumed = run(*flags, '--max_duration', '14ba', '--autoresume')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        'warning: the latest link in s3://bucket/lagging named ep0-ba6-rank0.pt, behind the newest checkpoint '
        'ep0-ba12-rank0.pt' in resumed.stdout + resumed.stderr
    )
    assert "resumed run 'r' from the latest in s3://bucket/lagging (batch 12 of 14)" in resumed.stdout
    assert not (tmp_path / 's3:').exists()  # the downloaded copy removed once loaded, with its folders
