"""benchmarks/gpu_campaign.py on a CPU: the tiny twins' rows, one folder of at most 8 files, and a second call that
resumes instead of measuring again."""

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_the_campaign_writes_one_folder_and_resumes(tmp_path):
    out = tmp_path / 'campaign'
    command = [sys.executable, 'benchmarks/gpu_campaign.py', '--out', str(out), '--steps', 'environment', 'sweep']
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(path.name for path in out.iterdir())
    assert files == ['campaign.json', 'campaign.md', 'logs.tar.gz'] and len(files) <= 8
    state = json.loads((out / 'campaign.json').read_text())
    assert list(state['rows']) == ['environment', 'sweep mb1', 'sweep mb2', 'sweep mb4', 'sweep mb8']
    assert all(row['img_per_sec_per_device'] > 0 for key, row in state['rows'].items() if key.startswith('sweep'))
    assert state['rows']['environment']['matmul_tflops'] > 0
    assert first.stdout.splitlines()[-1] == 'Every step measured.'

    again = subprocess.run([*command, '--resume'], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0 and '...' not in again.stdout  # no row ran again
    assert json.loads((out / 'campaign.json').read_text())['rows'] == state['rows']

    # A slice too short for another row stops and says what is left; the next call goes on.
    sliced = subprocess.run(
        [*command[:-2], 'profile', '--resume', '--time_limit', '0.01'], cwd=REPO, capture_output=True, text=True
    )
    assert sliced.returncode == 0 and 'row(s) left: run again with --resume.' in sliced.stdout
