"""The README's GPU table and benchmarks/results.md's dated entries, from what benchmarks/measured/ holds: each
DATE-GPU folder's campaign.json (the rows, their seconds and provenance, each naming its results file) and the
results files. Typed figures drift from the files; these tables are written from them.

    python benchmarks/measured_tables.py              # prints the README's rows and each folder's entry table
    python benchmarks/measured_tables.py --write      # rewrites them in README.md and benchmarks/results.md

The README's rows: every headline row (the fast recipe at batch 256 with its paths on, or the published recipe),
today's fast recipe compiled in bold; rows of dates no folder holds stay as they are. A dated entry's table: the
rows of its campaign's headline step, from precomputed latents first, compiled, eager, then the published recipe.
A folder without an entry gets one, appended after the entries' heading, its prose left to be written."""

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURED = REPO / 'benchmarks' / 'measured'
README, RESULTS = REPO / 'README.md', REPO / 'benchmarks' / 'results.md'
# The paths of the fast recipe a headline row keeps on: a row with one of them off measures that path.
FAST_PATHS = ('fused_adamw', 'low_precision_norm')
ENTRY_HEADER = (
    '| row | encoders | recipe | compile | batch | microbatch | img/s | TFLOP/s | MFU '
    '| peak GB allocated / reserved | s, start to exit |\n'
    '|---|---|---|---|---|---|---|---|---|---|---|'
)


def folders(measured: Path = MEASURED) -> list[Path]:
    """The dated folders with a campaign.json, newest date first, GPUs in name order within a date."""
    found = [path.parent for path in measured.glob('*/campaign.json')]
    return sorted(sorted(found, key=lambda path: path.name[11:]), key=lambda path: path.name[:10], reverse=True)


def measured_rows(folder: Path) -> list[dict]:
    """The folder's rows with a results file, each with its results, once per file (a row landed under two keys,
    the A/B's and the headline's, is one run)."""
    campaign = json.loads((folder / 'campaign.json').read_text())
    rows, seen = [], set()
    for key, row in campaign['rows'].items():
        if 'file' in row and row['file'] not in seen and 'same_as' not in row:
            seen.add(row['file'])
            rows.append({**row, 'key': key, 'results': json.loads((folder / row['file']).read_text())})
    return rows


def is_headline(results: dict) -> bool:
    config = results['config']
    if config['run_recipe'] == 'published':
        return True
    return config['batch_size'] == 256 and all(config[path] for path in FAST_PATHS)


def kind(results: dict) -> int:
    """0: the fast recipe compiled; 1: eager; 2: the published recipe."""
    config = results['config']
    return 2 if config['run_recipe'] == 'published' else 0 if config['compile'] else 1


def gpu_name(results: dict) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100 80GB'."""
    words = results['device_name'].removeprefix('NVIDIA ').split()
    return ' '.join(word for word in words if not word.startswith('HBM'))


def readme_row(results: dict, date: str) -> str:
    config = results['config']
    run = {
        0: 'fast, ' + ('channels-last, ' if config['channels_last'] else '') + '`--compile`',
        1: 'fast, eager' + (', channels-last' if config['channels_last'] else ''),
        2: 'published (fp16, EMA)',
    }[kind(results)]
    todays = kind(results) == 0 and not config['channels_last']  # the README's headline: today's recipe compiled
    bold = '**{}**' if todays else '{}'
    cells = (
        gpu_name(results),
        'precomputed' if config['precomputed_latents'] else 'online',
        run,
        results['device_train_microbatch_size'],
        bold.format(f'{results["img_per_sec_per_device"]:.1f}'),
        bold.format(f'{results["mfu"]:.1%}'),
        f'{results["peak_gpu_memory_gb"]:.1f} / {results["peak_gpu_memory_reserved_gb"]:.1f} GB',
        date,
    )
    return '| ' + ' | '.join(map(str, cells)) + ' |'


def readme_rows(measured: Path = MEASURED) -> list[str]:
    """The README's rows of every folder: the fast recipe's folder by folder (compiled, then eager), then the
    published recipe's folder by folder; fastest first within each."""
    found = [
        (
            kind(row['results']) == 2,
            index,
            kind(row['results']),
            -row['results']['img_per_sec_per_device'],
            row['results'],
            folder.name[:10],
        )
        for index, folder in enumerate(folders(measured))
        for row in measured_rows(folder)
        if is_headline(row['results'])
    ]
    return [readme_row(results, date) for *_, results, date in sorted(found, key=lambda found: found[:4])]


def entry_row(row: dict) -> str:
    results = row['results']
    config = results['config']
    encoders = 'precomputed' if config['precomputed_latents'] else 'online'
    name = f'{encoders}-{config["run_recipe"]}'
    name += f'-mb{config["device_train_microbatch_size"]}' if config['run_recipe'] == 'published' else ''
    name += '-compiled' if config['compile'] else ''
    bold = '**{}**' if config['compile'] else '{}'
    seconds = f'{row["seconds"]:.0f}' if 'seconds' in row else '-'
    if 'first_step_seconds' in row and config['compile']:
        seconds += f" ({row['first_step_seconds']:.0f} to the first step's end)"
    cells = (
        f'`{name}`',
        encoders,
        config['run_recipe'],
        config['compile'] or '-',
        config['batch_size'],
        results['device_train_microbatch_size'],
        bold.format(f'{results["img_per_sec_per_device"]:.2f}'),
        f'{results["flops_per_sec"] / 1e12:.1f}',
        bold.format(f'{results["mfu"]:.1%}'),
        f'{results["peak_gpu_memory_gb"]:.1f} / {results["peak_gpu_memory_reserved_gb"]:.1f}',
        seconds,
    )
    return '| ' + ' | '.join(map(str, cells)) + ' |'


def entry_rows(folder: Path) -> list[str]:
    """A dated entry's table rows: the campaign's headline step, precomputed first, compiled, eager, published."""
    rows = [row for row in measured_rows(folder) if row.get('step') == 'headline']
    order = sorted(rows, key=lambda row: (not row['results']['config']['precomputed_latents'], kind(row['results'])))
    return [entry_row(row) for row in order]


def entry(folder: Path) -> str:
    """A new dated entry: its heading, machine and versions from the rows' provenance, the table; prose to add."""
    rows = measured_rows(folder)
    first = rows[0]
    versions = first['results'].get('versions', {})
    given = first.get('provenance', {})
    stack = ', '.join(f'{name} {version}' for name, version in versions.items() if version)
    return '\n'.join(
        [
            f'## {folder.name[:10]}: {gpu_name(first["results"])}, the GPU campaign',
            '',
            f'- **machine**: one {first["results"]["device_name"]}, driver {given.get("driver")}, CUDA '
            f'{given.get("cuda")}, cuDNN {given.get("cudnn")}; commit {given.get("git_commit")}.',
            f'- **versions**: {stack}.',
            '',
            f'The raw results files are in [measured/{folder.name}](measured/{folder.name}).',
            '',
            ENTRY_HEADER,
            *entry_rows(folder),
            '',
        ]
    )


# ------------------------------------------------------------------------------------------------ writing


def replace_readme_rows(text: str, rows: list[str], dates: set[str]) -> str:
    """The README's GPU table with its rows of these dates replaced by `rows`, where the first of them stood."""
    lines = text.split('\n')
    dated = [i for i, line in enumerate(lines) if line.startswith('| ') and line.rstrip(' |').split('| ')[-1] in dates]
    if not dated:
        raise SystemExit('README.md: no GPU table row of a measured date to replace')
    kept = [line for i, line in enumerate(lines) if i not in dated]
    return '\n'.join(kept[: dated[0]] + rows + kept[dated[0] :])


def replace_entry_table(text: str, folder: Path) -> str:
    """The table after the line that names the folder's raw files, its rows replaced; a new entry where no line
    names the folder, placed before the newest entry."""
    marker = f'(measured/{folder.name})'
    lines = text.split('\n')
    named = [i for i, line in enumerate(lines) if marker in line]
    if not named:
        first_entry = next(i for i, line in enumerate(lines) if line.startswith('## '))
        return '\n'.join(lines[:first_entry] + entry(folder).split('\n') + lines[first_entry:])
    header = next(i for i in range(named[0], len(lines)) if lines[i].startswith('| row |'))
    end = next((i for i in range(header + 2, len(lines)) if not lines[i].startswith('|')), len(lines))
    return '\n'.join(lines[: header + 2] + entry_rows(folder) + lines[end:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split('\n\n')[0])
    parser.add_argument('--write', action='store_true', help='rewrite README.md and benchmarks/results.md')
    parser.add_argument('--measured', type=Path, default=MEASURED)
    parser.add_argument('--readme', type=Path, default=README)
    parser.add_argument('--results', type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = readme_rows(args.measured)
    if not args.write:
        print('\n'.join(['README.md:', *rows]))
        for folder in folders(args.measured):
            print('\n'.join(['', f'benchmarks/results.md, {folder.name}:', *entry_rows(folder)]))
        return
    dates = {folder.name[:10] for folder in folders(args.measured)}
    args.readme.write_text(replace_readme_rows(args.readme.read_text(), rows, dates))
    text = args.results.read_text()
    for folder in folders(args.measured):
        text = replace_entry_table(text, folder)
    args.results.write_text(text)
    print(f'wrote {args.readme} and {args.results}')


if __name__ == '__main__':
    main()
