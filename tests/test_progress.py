"""What a run prints: its configuration at the start, and the img/s of each progress line."""

import re
import types

import pytest

from runs import progress
from runs.progress import ProgressLines
from runs.start_lines import WIDTH, config_lines
from settings.config import resolve_config
from settings.flags import parse_args


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_state(batch: int, batch_size: int = 8):
    timestamp = types.SimpleNamespace(batch=batch, sample=batch * batch_size)
    return types.SimpleNamespace(timestamp=timestamp, loss=None)


def test_a_lines_img_per_sec_leaves_out_the_validation_and_sample_grids_between_lines(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress.time, 'perf_counter', clock)
    lines = ProgressLines(num_batches=3)
    lines.fit_start(fake_state(0), None)
    clock.now += 1.0  # a batch of 8 in 1 s
    lines.batch_end(fake_state(1), None)
    lines.eval_before_all(fake_state(1), None)
    clock.now += 30.0  # validation and a sample grid
    lines.eval_after_all(fake_state(1), None)
    clock.now += 1.0
    lines.batch_end(fake_state(2), None)
    clock.now += 2.0  # a slower batch, no evaluation: its own rate
    lines.batch_end(fake_state(3), None)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(': ', 1)[1].split(', ')[0] for line in printed] == ['8.00 img/s', '8.00 img/s', '4.00 img/s']
    assert printed[1].startswith('batch 2 of 3 (66%)') and '0:00:32 elapsed' in printed[1]  # elapsed keeps it all


def test_the_time_left_is_reckoned_from_the_batches_after_the_first(monkeypatch, capsys):
    """The first batch carries a compile (135 s on an H100): the time left leaves it out."""
    clock = Clock()
    monkeypatch.setattr(progress.time, 'perf_counter', clock)
    lines = ProgressLines(num_batches=12)
    lines.fit_start(fake_state(0), None)
    clock.now += 135.0
    lines.batch_end(fake_state(1), None)
    for batch in range(2, 5):
        clock.now += 2.0
        lines.batch_end(fake_state(batch), None)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("0:02:15 elapsed, the start's one-off work included") and 'left' not in printed[0]
    assert printed[1].endswith('0:02:17 elapsed, about 0:00:20 left')  # 10 batches of 2 s, not of 68.5 s
    assert printed[3].endswith('about 0:00:16 left')


def test_the_configuration_is_printed_as_grouped_lines_of_the_fields_set():
    flags = ['--model_name', 'tiny', '--use_synth_data', '--sample_interval', '1ep', '--wandb_project', 'p']
    fields = resolve_config(parse_args([*flags, '--results_json', 'r.json'])).as_dict()
    lines = config_lines(fields)
    assert lines[0] == 'config (every field in r.json):'
    assert all(len(line) <= WIDTH for line in lines), [line for line in lines if len(line) > WIDTH]
    text = '\n'.join(lines)
    assert 'model: model_name tiny, ' in text and 'evaluation: sample_interval 1ep, ' in text
    assert 'sample_prompts (4 items)' in text  # a list that would fill a line, by its count
    assert 'wandb_project p' in text and 'use_synth_data on' in text
    unset = [name for name, value in fields.items() if value is None or value is False]
    assert unset and not [name for name in unset if f' {name} ' in text or f' {name},' in text]
    assert 'ema_half_life' not in text  # a detail of --use_ema, which is off


def test_a_duration_rounded_to_whole_batches_and_the_synthetic_epoch_are_said():
    rounded = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--max_duration', '100sp']))
    assert rounded.batch.num_batches == 7
    assert any('7 whole batches of 16, 112 samples' in note for note in rounded.notes)
    exact = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--max_duration', '96sp']))
    assert not [note for note in exact.notes if '--max_duration' in note]
    epoch = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--max_duration', '1ep']))
    assert epoch.batch.num_batches == 6250
    assert any('an epoch of --use_synth_data is 100,000 samples, 6,250 batches of 16' in n for n in epoch.notes)


def test_the_published_recipe_on_a_cpu_names_what_it_leaves_out():
    tiny = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--recipe', 'published']))
    (line,) = [note for note in tiny.notes if note.startswith('--recipe published on a CPU: ')]
    assert 'fp32, not the published fp16' in line and 'SDPA attention, not xFormers' in line
    assert "microbatch the whole device batch (the tiny preset's), not the published 4" in line
    given = ['--precision', 'fp32', '--attention', 'sdpa', '--device_train_microbatch_size', '4']
    chosen = resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--recipe', 'published', *given]))
    assert '--recipe published on a CPU: all of it; kept: EMA' in chosen.notes  # each flag given: nothing dropped


def test_a_logged_warning_is_a_warning_line_not_pythons_default_format(monkeypatch):
    """torchao (imported by Diffusers) installs Python's default root handler at import: `WARNING:data:...`."""
    import io
    import logging

    from runs import run

    stream = io.StringIO()
    default = logging.StreamHandler(stream)
    default.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    mine = logging.StreamHandler(io.StringIO())
    mine.setFormatter(logging.Formatter('%(asctime)s %(name)s %(message)s'))  # a user's own: left as it is
    root = logging.getLogger()
    monkeypatch.setattr(root, 'handlers', [default, mine])
    run.warnings_as_lines()
    logging.getLogger('data').warning('bad sample 3 (shard shard.00000.mds, row 3): empty image bytes')
    assert stream.getvalue() == 'warning: bad sample 3 (shard shard.00000.mds, row 3): empty image bytes\n'
    assert mine.formatter._fmt == '%(asctime)s %(name)s %(message)s'


FIRST_IMPORT_OF_COMPOSER = """
import runpy, sys


class AnnounceComposer:
    def find_spec(self, name, path=None, target=None):
        if name == 'composer':
            print('-- composer starts loading', flush=True)
            sys.meta_path.remove(self)
        return None


sys.meta_path.insert(0, AnnounceComposer())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow
def test_the_start_is_printed_before_composer_loads(tmp_path):
    """Composer, Diffusers and Transformers take seconds to import (torch alone, which settling the flags asks
    whether there is a GPU, about one): the settled flags are printed before them."""
    import subprocess
    import sys

    from conftest import REPO, TINY

    flags = [*TINY, '--image_size', '32', '--batch_size', '2', '--max_duration', '1ba']
    run = subprocess.run(
        [sys.executable, '-c', FIRST_IMPORT_OF_COMPOSER, str(REPO / 'benchmark.py'), *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines.index('config (every field: --results_json):') < lines.index('-- composer starts loading')
    assert lines[0].startswith('defaults: ') and lines.count('config (every field: --results_json):') == 1


def test_a_two_batch_runs_throughput_is_its_second_batchs_and_says_its_windows_are_few(capsys):
    """The one window of a 2-batch run is its second batch, which the last progress line measures too. Before:
    `83.30 img/s` on that line and `throughput: 9.56 img/s`, as the FLOP count SpeedMonitor asks for at the first
    batch's end, made then, landed in the window."""
    from conftest import TINY, settled

    from runs.run import main

    main(settled([*TINY, '--image_size', '32', '--batch_size', '8', '--max_duration', '2ba']))
    out = capsys.readouterr().out
    shown = float(re.search(r'^batch 2 of 2 \(100%\): loss [\d.]+, ([\d.]+) img/s', out, re.MULTILINE).group(1))
    line = next(line for line in out.splitlines() if line.startswith('throughput: '))
    measured = float(re.match(r'throughput: ([\d.]+) img/s', line).group(1))
    assert measured == pytest.approx(shown, rel=0.25), out
    assert line.endswith(
        'median of 1 rolling window (few: the figure varies from run to run; 20 batches or more give a steadier one)'
    )
