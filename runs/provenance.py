"""Where a results file's figures came from, so that a file read months later says how it was made: the command, the
code (the git commit, and whether the tree held changes), the seconds to the end of the first step (setup and a
compile) and in all, and on a GPU the driver, CUDA, cuDNN and NCCL versions, the GPU's name, clocks and power limit.
A field that cannot be read here (no git, no nvidia-smi) is None. A copy of the repo without its .git (a machine
given the working tree alone) names its commit in BENCHMARK_GIT_COMMIT."""

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
NVIDIA_SMI_FIELDS = ('driver_version', 'clocks.max.sm', 'clocks.max.memory', 'power.limit')


def output_of(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict:
    commit = output_of(['git', 'rev-parse', 'HEAD'])
    if commit is None:
        return {'git_commit': os.environ.get('BENCHMARK_GIT_COMMIT'), 'git_dirty': None}
    status = output_of(['git', 'status', '--porcelain', '--untracked-files=no'])
    return {'git_commit': commit, 'git_dirty': None if status is None else bool(status)}


def gpu_details() -> dict | None:
    """The GPU's and its stack's versions: torch's view, and nvidia-smi's driver, clocks (MHz) and power limit (W)."""
    if not torch.cuda.is_available():
        return None
    details = {
        'name': torch.cuda.get_device_name(),
        'memory_gb': round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1),
        'capability': '.'.join(map(str, torch.cuda.get_device_capability())),
        'cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version(),
        'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None,
    }
    query = output_of(['nvidia-smi', f'--query-gpu={",".join(NVIDIA_SMI_FIELDS)}', '--format=csv,noheader,nounits'])
    values = query.splitlines()[0].split(', ') if query else []
    details |= dict(zip(NVIDIA_SMI_FIELDS, values)) if len(values) == len(NVIDIA_SMI_FIELDS) else {}
    return details


def provenance(first_step_end: float | None) -> dict:
    """The record of this process; first_step_end: the wall-clock time (time.time()) its first batch ended."""
    started = psutil.Process().create_time()
    return {
        'command': shlex.join([sys.executable, *sys.argv]),
        **git_state(),
        'seconds_to_first_step_end': None if first_step_end is None else round(first_step_end - started, 1),
        'seconds_in_all': round(time.time() - started, 1),
        'gpu': gpu_details(),
    }
