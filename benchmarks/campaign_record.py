"""What a GPU campaign keeps: its folder (campaign.json with every row's results and provenance, and the table),
each row's provenance (the command, the commit passed in, the date, the driver, CUDA and cuDNN), and the landing
of a loan's rows under benchmarks/measured/DATE-GPU/, from where the next loan resumes."""

import datetime
import io
import json
import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

from benchmarks.campaign_rows import CHECKED_BY, REPO, slug

MEASURED = REPO / 'benchmarks' / 'measured'  # the committed folders: recorded figures, and rows measured already
LOG_TAIL_BYTES = 64 << 10  # of each row's output, in logs.tar.gz: a traceback's end, not megabytes of warnings
CHECKS = tuple(CHECKED_BY.values())  # the checks row's fields (campaign_probes.py checks)


def check_note(name: str, check: dict) -> str:
    """'fp8 passed (0.0012 within 0.05)', 'fused_groupnorm FAILED (0.3 over 0.01)', or why it was skipped."""
    if 'skipped' in check:
        return f'{name} skipped: {check["skipped"]}'
    if check['passed']:
        return f'{name} passed ({check["error"]:.2g} within {check["bound"]:g})'
    return f'{name} FAILED ({check["error"]:.2g} over {check["bound"]:g})'


# ------------------------------------------------------------------------------------------------ the folder


def write_folder(out: Path, work: Path, state: dict) -> None:
    """campaign.json, campaign.md, logs.tar.gz (the logs so far, the earlier archive's kept), profile summaries."""
    (out / 'campaign.json').write_text(json.dumps(state, indent=1) + '\n')
    (out / 'campaign.md').write_text(table(state) + '\n')
    for machine in state['machines'].values():
        for key, row in machine['rows'].items():
            if 'profile' in row:
                (out / f'{slug(key)}.md').write_text(row['profile'] + '\n')
    archive, kept = out / 'logs.tar.gz', {}
    if archive.is_file():
        with tarfile.open(archive) as old:
            kept = {member.name: old.extractfile(member).read() for member in old.getmembers() if member.isfile()}
    kept |= {log.name: log.read_bytes()[-LOG_TAIL_BYTES:] for log in work.glob('*.log')}
    with tarfile.open(archive, 'w:gz') as new:
        for name, data in sorted(kept.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            new.addfile(info, io.BytesIO(data))


def table(state: dict) -> str:
    """One table of every machine's rows, the machine named in each; the reports after it."""
    on_cpus_only = all(machine.startswith('cpu ') for machine in state['machines'])
    lines = [
        '# GPU campaign, rehearsed on a CPU: tiny rows that check the campaign, not the hardware'
        if on_cpus_only
        else '# GPU campaign',
        '',
        '| machine | step | row | microbatch | img/s per device | MFU | peak GB alloc. / reserved | seconds | note |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for machine, held in state['machines'].items():
        for key, row in held['rows'].items():
            lines.append('| ' + ' | '.join(str(cell) for cell in (machine, *cells(key, row))) + ' |')
    for machine, held in state['machines'].items():
        for key, row in held['rows'].items():
            if 'report' in row:
                lines += ['', f'## {key} ({machine})', '', row['report']]
    left = state.get('left')
    failed = sum('error' in row for held in state['machines'].values() for row in held['rows'].values())
    if left:
        ending = f'{left} row(s) left: run again with --resume.'
    elif failed:
        ending = f'Every step run; {failed} row(s) ended in an error (see their notes).'
    else:
        ending = 'Every step measured.'
    lines += ['', ending]
    return '\n'.join(lines)


def cells(key: str, row: dict) -> tuple:
    rate = row.get('img_per_sec_per_device') or row.get('img_per_sec')
    note = row.get('error') or row.get('skipped') or ''
    if row.get('pending'):
        note = f'cut by the deadline {row["cuts"]} time(s): tried again next call'
    if row.get('planned'):
        note = 'planned microbatch ' + note
    if row.get('microbatch_from'):
        note = f'microbatch from {row["microbatch_from"]}' + (f'; {note}' if note else '')
    if 'outcome' in row:
        note = row['outcome'] + (f': {note}' if note else '')
    if 'matmul_tflops' in row:
        matmul = f'{row["matmul_tflops"]:.1f} TFLOP/s {row["matmul_dtype"]}'
        note = f'{row["device"]}; matmul {matmul}, copy {row["copy_gb_s"]:.0f} GB/s'
    if 'tflops' in row:
        note = f'{row["tflops"]:.1f} TFLOP/s, {row["seconds_per_image"] * 1e3:.1f} ms per image'
    if checked := [name for name in CHECKS if isinstance(row.get(name), dict)]:
        note = '; '.join(check_note(name, row[name]) for name in checked)
    allocated, reserved = row.get('peak_gpu_memory_gb'), row.get('peak_gpu_memory_reserved_gb')
    memory = f'{allocated:.1f}' if allocated else ''
    memory += f' / {reserved:.1f}' if reserved else ''
    return (
        row.get('step', ''),
        key,
        row.get('microbatch') or '',
        f'{rate:.2f}' if rate else '',
        f'{row["mfu"]:.1%}' if row.get('mfu') else '',
        memory,
        f'{row["seconds"]:.0f}' if 'seconds' in row else '',
        note,
    )


# ------------------------------------------------------------------------------------------------ provenance


def provenance(row: dict, measured: dict, environment: dict | None) -> dict:
    """Where a row's figures came from: its command, the commit (BENCHMARK_GIT_COMMIT, which a copy without .git
    is given), the date, and the driver, CUDA and cuDNN its results file or the environment row records."""
    argv = row.get('argv') or (['-m', 'pytest', row['test']] if 'test' in row else [])
    gpu = ((measured.get('results') or {}).get('provenance') or {}).get('gpu') or {}
    environment = {
        **(environment or {}),
        **{name: measured[name] for name in ('driver', 'cuda', 'cudnn') if name in measured},
    }
    return {
        'command': shlex.join(['python3', *argv]) if argv else None,
        'git_commit': os.environ.get('BENCHMARK_GIT_COMMIT') or git_commit(),
        'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
        'driver': gpu.get('driver_version') or environment.get('driver'),
        'cuda': gpu.get('cuda') or environment.get('cuda'),
        'cudnn': gpu.get('cudnn') or environment.get('cudnn'),
    }


def git_commit() -> str | None:
    found = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ landing


def gpu_slug(machine: str) -> str:
    """'NVIDIA H100 80GB HBM3 torch 2.11.0' -> 'h100': the folder's name for a GPU."""
    words = machine.removeprefix('NVIDIA ').split()
    return re.sub(r'[^a-z0-9]+', '-', (words or ['unknown'])[0].lower())


def land(folder: Path, measured: Path = MEASURED) -> list[Path]:
    """Each machine's rows that are not landed yet into measured/DATE-GPU/ (the date each row was measured): its
    campaign.json (the rows, their provenance, each naming its results file) and the results files. Returns the
    folders written."""
    state = json.loads((folder / 'campaign.json').read_text())
    written = []
    for machine, held in state['machines'].items():
        if machine.startswith('cpu ') and measured == MEASURED:
            continue  # a CPU rehearsal measures the campaign, not a GPU: nothing to commit
        for key, row in held['rows'].items():
            if row.get('landed') or row.get('pending') or 'provenance' not in row:
                continue
            target = measured / f'{row["provenance"]["date"][:10]}-{gpu_slug(machine)}'
            target.mkdir(parents=True, exist_ok=True)
            state_file = target / 'campaign.json'
            landed = json.loads(state_file.read_text()) if state_file.is_file() else {'machine': machine, 'rows': {}}
            if landed['rows'].get(key, {}).get('provenance') == row['provenance']:
                continue  # landed by an earlier --land
            row = dict(row)
            if 'results' in row:
                row['file'] = f'{slug(key)}.json'
                (target / row['file']).write_text(json.dumps(row.pop('results'), indent=2) + '\n')
            landed['rows'][key] = row
            state_file.write_text(json.dumps(landed, indent=1) + '\n')
            written.append(target) if target not in written else None
    return written
