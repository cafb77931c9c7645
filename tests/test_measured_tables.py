"""The README's GPU table and benchmarks/results.md's dated entries, written from benchmarks/measured/: on the
recorded H100 and H200 folders they are the rows typed there before, and a new folder gets its entry."""

import json
import shutil

from conftest import REPO

from benchmarks import measured_tables


def test_the_readme_rows_are_the_recorded_folders_rows_as_typed():
    rows = measured_tables.readme_rows()
    readme = (REPO / 'README.md').read_text().split('\n')
    start = readme.index(rows[0])
    assert readme[start : start + len(rows)] == rows
    assert len(rows) == 13  # 4 H100 and 5 H200 rows of the fast recipe, 2 and 2 of the published
    assert [row.split(' | ')[0] for row in rows[:4]] == ['| H100 80GB'] * 4


def test_each_folders_entry_table_is_its_rows_as_typed():
    results = (REPO / 'benchmarks' / 'results.md').read_text().split('\n')
    for folder in measured_tables.folders():
        rows = measured_tables.entry_rows(folder)
        start = results.index(rows[0])
        assert results[start : start + len(rows)] == rows, folder
        assert results[start - 2] == measured_tables.ENTRY_HEADER.split('\n')[0]


def test_writing_the_tables_leaves_the_typed_files_as_they_are_and_adds_a_new_folders_entry(tmp_path):
    readme, results = tmp_path / 'README.md', tmp_path / 'results.md'
    shutil.copy(REPO / 'README.md', readme)
    shutil.copy(REPO / 'benchmarks' / 'results.md', results)
    measured = tmp_path / 'measured'
    shutil.copytree(REPO / 'benchmarks' / 'measured', measured)
    argv = ['--write', '--measured', str(measured), '--readme', str(readme), '--results', str(results)]
    measured_tables.main(argv)
    assert readme.read_text() == (REPO / 'README.md').read_text()
    assert results.read_text() == (REPO / 'benchmarks' / 'results.md').read_text()

    # A later loan's folder: its compiled row leads the README's rows, and results.md gets an entry for it.
    new = measured / '2026-11-30-h200'
    new.mkdir()
    source = json.loads((measured / '2026-11-26-h200' / 'precomputed-fast-compiled.json').read_text())
    source['config']['channels_last'] = False
    source['img_per_sec_per_device'], source['mfu'] = 150.25, 0.3671
    (new / 'headline-recipe--A-.json').write_text(json.dumps(source))
    row = {'step': 'headline', 'cost': 'compile', 'seconds': 190.4, 'first_step_seconds': 141.2}
    row |= {'file': 'headline-recipe--A-.json', 'provenance': {'driver': '580.159.04', 'cuda': '13.0'}}
    state = {'machine': 'NVIDIA H200 torch 2.11.0', 'rows': {'headline recipe (A)': row}}
    (new / 'campaign.json').write_text(json.dumps(state))
    measured_tables.main(argv)
    written = readme.read_text()
    assert '| H200 | precomputed | fast, `--compile` | 64 | **150.2** | **36.7%** | 66.7 / 68.4 GB | 2026-11-30 |' in (
        written
    )
    assert written.count('2026-11-26 |') == (REPO / 'README.md').read_text().count('2026-11-26 |')
    entry = results.read_text()
    assert '(measured/2026-11-30-h200)' in entry
    assert "| **150.25** | 355.8 | **36.7%** | 66.7 / 68.4 | 190 (141 to the first step's end) |" in entry
    assert entry.index('## 2026-11-30: H200') < entry.index('## 2026-11-28')
