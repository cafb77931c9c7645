"""The repo's layout holds: every top-level module is installed, and only the entry point's users import it."""

import ast
import tomllib

from conftest import REPO


def test_every_top_level_module_is_installed():
    # make install installs the repo in editable mode from this list: a module missing from it cannot be
    # imported by the scripts under benchmarks/.
    settings = tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['setuptools']
    assert sorted(settings['py-modules']) == sorted(path.stem for path in REPO.glob('*.py'))
    assert settings['packages'] == ['benchmarks']


def test_only_tests_import_the_command_line_script():
    importers = []
    for path in [*REPO.glob('*.py'), *REPO.glob('benchmarks/*.py')]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            if 'benchmark' in names:
                importers.append(path.name)
    assert importers == []
