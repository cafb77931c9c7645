"""Which versions of torch, numpy and transformers this code works with, checked once at the start of a run.

requirements.txt pins one stack; requirements-current.txt installs the rest onto a machine's own, often newer,
PyTorch (docs/install.md). On the pinned versions a run says nothing; on others it prints one line naming them
and what was tested; on a version known not to work it stops before building anything, with one line naming
the package and what to install.
"""

from importlib import metadata

from composer.utils import dist
from packaging.specifiers import SpecifierSet

from guards.arguments import ConfigError

PACKAGES = ('torch', 'numpy', 'transformers')

# requirements.txt's pins (tests/test_stack.py holds them equal).
PINNED = {'torch': '==2.7.0', 'numpy': '>=1.26,<2.2', 'transformers': '==4.57.6'}

# Tested to work (docs/install.md): every CPU tier on the pins (make test); the fast tier and a benchmark run on
# today's stack (make test-current: torch 2.15.0, numpy 2.4.6, transformers 5.24.0) and on a GPU image's own
# packages (make test-gpu-image: torch 2.11.0, transformers 5.17.0); an import and a benchmark run on torch 2.12.1,
# 2.13.0 and 2.14.1; SD2 training and the gpu tier on an H100 with numpy 2.5.2 (and transformers 4.57.6). Either
# range of transformers: 4.57 (with huggingface_hub <1) or 5.17 and later (hub 1.x or 2.x).
TESTED = {'torch': ('>=2.7,<2.16',), 'numpy': ('>=1.26,<2.6',), 'transformers': ('==4.57.6', '>=5.17,<5.25')}

# Known not to work: what goes wrong, and what to install instead (none at present among these packages).
BROKEN: dict[str, tuple[str, str]] = {}


class StackError(ConfigError):
    """A library version this code is known not to work with (reported like bad input: one line, exit 2)."""


def installed_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in PACKAGES}


def matches(version: str, specifier: str) -> bool:
    return SpecifierSet(specifier).contains(version, prereleases=True)


def describe(versions: dict[str, str | tuple[str, ...]]) -> str:
    """'torch 2.7.0, numpy >=1.26,<2.2, ...': a version, or ranges joined by 'or', per package."""

    def one(version: str | tuple[str, ...]) -> str:
        ranges = (version,) if isinstance(version, str) else version
        return ' or '.join(r.removeprefix('==') for r in ranges)

    return ', '.join(f'{name} {one(versions[name])}' for name in PACKAGES)


def stack_note(versions: dict[str, str]) -> str | None:
    """None on the pinned versions, else the one line to print; raises StackError on a version known not to work."""
    for name, (specifier, problem) in BROKEN.items():
        if matches(versions[name], specifier):
            raise StackError(f'{name} {versions[name]}: this code does not work with it: {problem}')
    if all(matches(versions[name], PINNED[name]) for name in PACKAGES):
        return None
    note = f'stack: {describe(versions)}: not the pinned versions ({describe(PINNED)}); '
    note += f'tested to work: {describe(TESTED)}'
    untested = [name for name in PACKAGES if not any(matches(versions[name], r) for r in TESTED[name])]
    if untested:
        note += f'; not tested on this {" and ".join(untested)}'
    return note


def check_stack() -> None:
    """Called once at the start of benchmark.py and precompute.py; prints on rank 0 only."""
    note = stack_note(installed_versions())
    if note and dist.get_global_rank() == 0:
        print(note, flush=True)
