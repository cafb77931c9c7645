"""What a user sees of a run, held against a recorded copy: the lines a tiny run prints (its figures masked, as they
vary) and the keys of its results file. A change inside the configuration or the run's steps keeps both; a change
meant to alter them records them again with RECORD_EXPECTED=1 and shows in the diff of tests/expected/."""

import argparse
import json
import os
import re
from pathlib import Path

import pytest
from conftest import REPO, TINY

import benchmark
from costs.results import cpu_name
from settings.config import resolve_config
from settings.flags import parse_args

EXPECTED = Path(__file__).parent / 'expected'
FLAGS = [*TINY, '--image_size', '32', '--batch_size', '4', '--max_duration', '4ba', '--cpu_threads', '1']
FLAGS += ['--use_ema', '--run_name', 'shown', '--save_interval', '2ba']


def masked(text: str) -> str:
    """The lines with the repo's folder, the CPU's name and the figures that vary from run to run masked, the
    configuration's lines joined where they were broken (where depends on the length of the repo's path), and the
    version check's `stack:` line left out: printed only off the pins (make test-current), and tested in
    test_stack.py."""
    text = re.sub(r',\n {8}', ', ', text)
    text = re.sub(r'^stack: .*\n', '', text, flags=re.MULTILINE)
    text = text.replace(str(REPO), '<repo>').replace(cpu_name(), '<cpu>')
    text = re.sub(r'\d+:\d\d:\d\d', '<time>', text)
    return re.sub(r'\d+\.\d+', '<x>', text)


def keys(results: dict) -> dict:
    return {'results': sorted(results), 'config': sorted(results['config'])}


def held_against(name: str, shown: str) -> None:
    expected = EXPECTED / name
    if os.environ.get('RECORD_EXPECTED') == '1':
        expected.parent.mkdir(exist_ok=True)
        expected.write_text(shown)
    assert shown == expected.read_text(), f'{name} differs (RECORD_EXPECTED=1 records it again)'


def test_a_tiny_runs_lines_and_results_keys_are_as_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the run's folders are given relative to it: no path of this machine in the lines
    benchmark.cli([*FLAGS, '--save_folder', 'ckpt', '--results_json', 'results.json'])
    held_against('tiny-run-lines.txt', masked(capsys.readouterr().out))
    results = json.loads((tmp_path / 'results.json').read_text())
    held_against('tiny-run-results-keys.json', json.dumps(keys(results), indent=1) + '\n')


def test_every_flag_is_held_by_a_section_and_shown_and_a_value_in_none_is_refused():
    """The run's configuration is its sections (settings/run_sections.py): each flag is in one, so the start lines
    and the results file show it; a settled value no section holds would be dropped, and is refused."""
    args = parse_args([*TINY, '--image_size', '32'])
    assert set(vars(args)) <= set(resolve_config(args).as_dict())
    with pytest.raises(AssertionError, match=r"in no section of RunConfig .*\['a_new_flag'\]"):
        resolve_config(argparse.Namespace(**vars(args), a_new_flag=1))
