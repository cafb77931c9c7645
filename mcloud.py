"""Check mcloud.yaml offline and launch it, or a sweep over GPU counts, on the MosaicML platform.

python mcloud.py check [mcloud.yaml]                  # offline: every problem, exit 1 if any
python mcloud.py sweep --gpus 8 16 32 64 128          # print the runs of the published table
python mcloud.py sweep --gpus 8 16 32 64 128 --submit # and submit them (needs `mcli init`)
"""

import argparse
import copy
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from guards import arguments
from guards.stopping import SIGNALS, Stopped, stop_on_signals

if TYPE_CHECKING:  # mcli takes half a second to import: loaded where it is used, so --help answers at once
    from mcli import RunConfig

REPO = Path(__file__).resolve().parent
# Top-level fields mosaicml-cli 0.7.5 still reads but has deprecated in favour of `compute`.
DEPRECATED_FIELDS = {
    'gpu_num': 'compute.gpus',
    'gpu_type': 'compute.gpu_type',
    'cluster': 'compute.cluster',
    'cpus': 'compute.cpus',
}
# mcli passes integrations through unchecked; these are the git_repo integration's documented keys.
GIT_REPO_KEYS = {'integration_type', 'git_repo', 'git_branch', 'git_commit', 'path', 'ssh_clone', 'pip_install', 'host'}


def check(path: Path) -> list[str]:
    """Every problem with a run YAML that can be found without the network, as readable lines."""
    from mcli import RunConfig
    from mcli.models.run_config import FinalRunConfig

    if path.is_dir():
        return [f'{path}: a folder, not a run YAML: give the YAML file in it (mcloud.yaml)']
    if not path.is_file():
        return [f'{path}: no such file']
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            config = RunConfig.from_file(str(path))
        except Exception as error:  # YAML syntax errors and wrong types surface here
            return [f'{path}: cannot be parsed: {error}']
    problems = [f'{path}: {warning.message}' for warning in caught]
    for field, replacement in DEPRECATED_FIELDS.items():
        if getattr(config, field) not in (None, ''):
            problems.append(f'{path}: field {field!r} is deprecated: use {replacement!r}')
    for field in ('name', 'image', 'command'):
        if not getattr(config, field):
            problems.append(f'{path}: field {field!r} is missing')
    if not config.compute.get('gpus') and not config.compute.get('nodes'):
        problems.append(f"{path}: compute needs 'gpus' (or 'nodes')")
    for field in ('gpus', 'nodes'):  # mcli passes any value through to the platform
        value = config.compute.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            problems.append(f'{path}: compute.{field} must be a positive whole number, got {value!r}')
    for number, integration in enumerate(config.integrations):
        if integration.get('integration_type') == 'git_repo':
            for key in sorted(set(integration) - GIT_REPO_KEYS):
                problems.append(f'{path}: integrations[{number}]: unknown git_repo field {key!r}')
    torch_pin = re.search(r'^torch==(\S+)', (REPO / 'requirements.txt').read_text(), re.MULTILINE).group(1)
    if config.image and f':{torch_pin}_' not in config.image:
        problems.append(
            f'{path}: image {config.image!r} does not carry torch {torch_pin}, the version '
            'requirements.txt pins (mosaicml/pytorch tags start with the torch version)'
        )
    try:
        FinalRunConfig.finalize_config(copy.deepcopy(config))
    except Exception as error:
        problems.append(f'{path}: mcli validation failed: {error}')
    return problems


def sweep_configs(path: Path, gpu_counts: list[int], gpu_type: str | None) -> list['RunConfig']:
    from mcli import RunConfig

    base = RunConfig.from_file(str(path))
    configs = []
    for gpus in gpu_counts:
        config = copy.deepcopy(base)
        config.compute['gpus'] = gpus
        if gpu_type:
            config.compute['gpu_type'] = gpu_type
        config.name = f'{base.name}-{gpus}x{config.compute.get("gpu_type", "gpu").replace("_", "-")}'
        configs.append(config)
    return configs


def parse_args(argv=None) -> argparse.Namespace:
    parser = arguments.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest='command', required=True)
    check_parser = commands.add_parser('check', help='validate a run YAML offline')
    check_parser.add_argument('yaml', nargs='?', default=str(REPO / 'mcloud.yaml'))
    sweep_parser = commands.add_parser('sweep', help='one run per GPU count')
    sweep_parser.add_argument('yaml', nargs='?', default=str(REPO / 'mcloud.yaml'))
    sweep_parser.add_argument('--gpus', type=int, nargs='+', default=[8, 16, 32, 64, 128])
    sweep_parser.add_argument('--gpu_type', default=None, help='override compute.gpu_type, e.g. h100_80gb')
    sweep_parser.add_argument('--submit', action='store_true', help='submit the runs (default: only print them)')
    args = parser.parse_args(argv)
    if args.command == 'sweep' and any(gpus <= 0 for gpus in args.gpus):
        parser.error(f'--gpus {args.gpus}: GPU counts must be positive')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    problems = check(Path(args.yaml))
    if problems:
        print('\n'.join(problems), file=sys.stderr)
        return 1
    if args.command == 'check':
        print(f'{args.yaml}: valid for mosaicml-cli 0.7.5')
        return 0
    for config in sweep_configs(Path(args.yaml), args.gpus, args.gpu_type):
        print(f'{config.name}: {config.compute["gpus"]} x {config.compute.get("gpu_type")}')
        if args.submit:
            from mcli import create_run
            from mcli.api.exceptions import MCLIException

            try:
                run = create_run(config)
            except MCLIException as error:  # no API key (mcli init not run), a refused run, the platform unreachable
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                arguments.stop(1, f'submitting {config.name} failed: {reason}')
            print(f'  submitted as {run.name}')
    if not args.submit:
        print('(not submitted: add --submit)')
    return 0


def stopped_line(signum: int) -> str:
    """Ctrl-C or SIGTERM: the runs printed as submitted were; one being submitted may have reached the platform."""
    return (
        f'{SIGNALS[signum]}: mcloud.py stopped; runs printed as submitted above were submitted, and one being '
        'submitted when it stopped may have been: `mcli get runs` lists them'
    )


if __name__ == '__main__':
    try:
        with stop_on_signals(stopped_line):
            status = main()
    except Stopped as stopped:
        print(f'error: {stopped}', file=sys.stderr)
        sys.exit(stopped.exit_status)
    sys.exit(status)
