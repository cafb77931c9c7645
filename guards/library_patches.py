"""The libraries' names this repo replaces, checked as each patch is installed.

Some faults are fixed by replacing a library's function (often a private one): Composer's checkpoint loading (read
weights-only), its upload of a checkpoint (kept on disk when the upload fails for good), Streaming's choice of a
shared-memory prefix and its shared-memory blocks (one job at a time, descriptors closed), its index reading (checked
as untrusted input). A release that renames or reshapes such a name would silently undo the fix: the patch would
set a name nothing reads, or call the old one with the wrong arguments. So each patch is installed by `install` (or,
where it overrides or extends, checks what it relies on with `replaced`), which checks that the name is there and
takes the arguments the patch passes, and otherwise stops the program in one line naming the package, its version
and the name. docs/architecture.md lists them, with why each exists.
"""

import importlib.metadata
import inspect

# The distribution each top-level package comes from, for the version a refusal names.
DISTRIBUTIONS = {'composer': 'mosaicml', 'streaming': 'mosaicml-streaming', 'torch': 'torch', 'wandb': 'wandb'}
# Every name replaced so far in this process: (package, owner, name), once each, in the order first installed.
GUARDED: dict[tuple[str, str, str], None] = {}
# The replacements installed in this process, by id, each with the library's own name it replaced: a patch installed
# again (a second run in one process) is checked against the library's original, not against this repo's own.
INSTALLED: dict[int, tuple[object, object]] = {}
MISSING = object()  # a name that is not there (an attribute a patch reads may be None)


class LibraryChanged(RuntimeError):
    """A name a patch replaces is gone or takes other arguments: one line, and the program does not start."""


def replaced(owner, name: str, parameters: tuple[str, ...], why: str):
    """`owner.name` (owner: a module, a class, or an object whose attribute a patch sets or reads), checked to exist
    and to take `parameters` as its leading parameters (`self` left out for a method); LibraryChanged otherwise.
    Returns it, for the patch to wrap."""
    if inspect.ismodule(owner):
        where = owner.__name__
    else:
        kind = owner if inspect.isclass(owner) else type(owner)
        where = f'{kind.__module__}.{kind.__qualname__}'
    package = where.split('.')[0]
    original = getattr(owner, name, MISSING)
    original = INSTALLED.get(id(original), (None, original))[1]
    problem = None
    if original is MISSING:
        problem = 'is not there'
    elif parameters and callable(original):
        try:
            found = [p for p in inspect.signature(original).parameters if p != 'self'][: len(parameters)]
        except (TypeError, ValueError):  # no signature to read (a builtin)
            found = None
        if found is not None and tuple(found) != parameters:
            problem = f'takes ({", ".join(found)}), where this repo passes ({", ".join(parameters)})'
    if problem:
        version = installed_version(package)
        raise LibraryChanged(
            f'{DISTRIBUTIONS.get(package, package)} {version}: {where}.{name} {problem}; this repo replaces it '
            f'({why}): install the version requirements.txt pins'
        )
    GUARDED[package, where, name] = None  # a patch installed again (a second run) is listed once
    return original


def install(owner, name: str, parameters: tuple[str, ...], why: str, replacement_of):
    """owner.name = replacement_of(original), the original checked by `replaced` first. Returns the replacement."""
    original = replaced(owner, name, parameters, why)
    replacement = replacement_of(original)
    INSTALLED[id(replacement)] = (replacement, original)  # the replacement held: its id names no other object
    setattr(owner, name, replacement)
    return replacement


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(package, package))
    except importlib.metadata.PackageNotFoundError:
        return '(version unknown)'
