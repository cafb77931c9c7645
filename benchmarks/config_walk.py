"""The walk of a run's settled values through the code: which of the repo's functions a tiny run hands its RunConfig
or one of its sections to, in the order first handed, and how often that walk climbs back to a higher floor of the
import graph or re-enters runs/run.py. The figures docs/architecture.md gives before and after a change.

    .venv/bin/python benchmarks/config_walk.py            # the walk of this checkout
    .venv/bin/python benchmarks/config_walk.py --list     # and each stay, in order

A stay is a function of the repo's (not a library's, not a test's) called with the configuration or a section of it
among its arguments (`self` included), counted once however often it is called; a room is a file holding stays; a
climb back up is a step of the walk, in first-call order, to a file on a higher floor than the one before (a
module's floor: one above the highest module of the repo it imports, anywhere in it); an entry to runs/run.py is a
step into it from another file. Run in this process on random tensors (the tiny model, 2 batches), with
sys.settrace watching calls only, so the run's own lines are not slowed.
"""

import argparse
import ast
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The types of a run's settled values, by the modules that define them (settings/config.py's RunConfig and the
# sections of settings/run_sections.py).
SETTLED_MODULES = ('settings.config', 'settings.run_sections')
RUN = ['--model_name', 'tiny', '--use_synth_data', '--batch_size', '2', '--max_duration', '2ba', '--cpu_threads', '1']
SKIPPED = ('.venv', 'tests', 'benchmarks')
# The functions that read a model folder: the repo's description of it, and Diffusers' and Transformers' reading of
# one of its config.json files.
MODEL_FOLDER_READS = ('read_model_folder', 'ConfigMixin.load_config', 'PretrainedConfig.get_config_dict')


def repo_modules() -> dict[str, Path]:
    """The repo's importable modules (dotted name: file): the entry scripts at its top and each package's files."""
    packages = [path.parent for path in REPO.glob('*/__init__.py') if path.parent.name not in SKIPPED]
    files = [*REPO.glob('*.py'), *(path for package in packages for path in package.glob('*.py'))]
    return {'.'.join(path.relative_to(REPO).with_suffix('').parts).removesuffix('.__init__'): path for path in files}


def floors(modules: dict[str, Path]) -> dict[str, int]:
    """Each module's floor: 1 for one importing none of the repo's modules, else one above the highest it imports."""
    needs = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.update([node.module, *(f'{node.module}.{alias.name}' for alias in node.names)])
        needs[name] = {other for other in imported if other in modules and other != name}
    floor: dict[str, int] = {}
    while len(floor) < len(needs):
        ready = [name for name in needs if name not in floor and needs[name] <= set(floor)]
        if not ready:  # an import circle: its modules share the floor above what they stand on
            ready = [name for name in needs if name not in floor]
        floor |= {name: 1 + max((floor.get(other, 0) for other in needs[name]), default=0) for name in ready}
    return floor


def settled(value) -> bool:
    return type(value).__module__ in SETTLED_MODULES


def walk(flags: list[str]) -> tuple[dict[tuple[str, str], bool], int]:
    """The stays (file relative to the repo, function's qualified name) of a run of benchmark.py with `flags`, in
    the order first called, each with whether it was handed the whole RunConfig; and how often a model folder's
    description or one of its configs was read (MODEL_FOLDER_READS)."""
    stays: dict[tuple[str, str], bool] = {}
    reads = 0
    root = str(REPO) + '/'
    skipped = tuple(f'{root}{folder}/' for folder in SKIPPED)

    def on_call(frame, event, arg):
        nonlocal reads
        code = frame.f_code
        reads += code.co_qualname in MODEL_FOLDER_READS
        if event != 'call' or not code.co_filename.startswith(root) or code.co_filename.startswith(skipped):
            return None
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        values = [frame.f_locals.get(name) for name in names]
        if any(settled(value) for value in values):
            whole = any(type(value).__name__ == 'RunConfig' for value in values)
            key = (code.co_filename.removeprefix(root), code.co_qualname)
            stays[key] = stays.get(key, False) or whole
        return None  # no line events: the run keeps its speed

    sys.argv = ['benchmark.py', *flags]
    sys.settrace(on_call)
    try:
        runpy.run_path(str(REPO / 'benchmark.py'), run_name='__main__')
    except SystemExit as stop:
        if stop.code:
            raise
    finally:
        sys.settrace(None)
    return stays, reads


def figures(stays: dict[tuple[str, str], bool], floor_of: dict[str, int]) -> dict[str, int]:
    files = [file for file, _ in stays]
    floor = [floor_of.get(module_of(file), 0) for file in files]
    return {
        'stays': len(stays),
        'handed the whole RunConfig': sum(stays.values()),
        'rooms': len(set(files)),
        'climbs back up': sum(1 for before, after in zip(floor, floor[1:]) if after > before),
        'runs/run.py entered': sum(
            1 for before, after in zip(files, files[1:]) if after == 'runs/run.py' and before != after
        ),
    }


def module_of(file: str) -> str:
    return file.removesuffix('.py').replace('/', '.').removesuffix('.__init__')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--list', action='store_true', help='print each stay, in the order first called')
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    modules = repo_modules()
    stays, reads = walk(RUN)
    floor_of = floors(modules)
    counts = figures(stays, floor_of)
    if args.list:
        for (file, function), whole in stays.items():
            print(f'  floor {floor_of.get(module_of(file), "?")}  {file}:{function}{"  (RunConfig)" if whole else ""}')
    counts['model folder reads'] = reads
    print('walk of a tiny run: ' + ', '.join(f'{value} {name}' for name, value in counts.items()))


if __name__ == '__main__':
    main()
