"""Every shell command in the README's and docs/' fenced blocks reads as its program reads it: a script of this repo
gets flags its parser takes, with values it accepts (a bracketed alternative, a mistyped flag or a value not among
the choices fails here); a `make` command names a target of the Makefile; a file it runs exists. Parsed only, not
run: what they do is tested where each program is."""

import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO

import convert
import generate
import mcloud
import precompute
import report
from settings import flags

PAGES = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
# A bash block, and what the marker line above it says its commands need that a CPU machine lacks (a GPU, a
# cluster, results of GPU runs, ten minutes of a measurement): the docs' journeys leave such a block out.
FENCE = re.compile(r'^(?:<!-- needs: (.+?) -->\n)?```(?:bash|sh|shell)\n(.*?)^```', re.MULTILINE | re.DOTALL)
# The programs whose flags are parsed, by script name.
PARSERS = {
    'benchmark.py': flags.parse_args,
    'convert.py': convert.parse_args,
    'precompute.py': precompute.parse_args,
    'generate.py': generate.parse_args,
    'report.py': report.parse_args,
    'mcloud.py': mcloud.parse_args,
}
SHELL_OPERATORS = {'&&', '||', '|', ';', '>', '>>', '2>&1', '&'}
MAKE_TARGETS = set(re.findall(r'^([\w.-]+):', (REPO / 'Makefile').read_text(), re.MULTILINE))


def shell_blocks(page: Path) -> list[tuple[str, list[str]]]:
    """Each of a page's bash blocks: what its marker says it needs ('' without one), and its commands, continuation
    lines joined, comments and output lines left out."""
    blocks = []
    for needs, block in FENCE.findall(page.read_text()):
        lines = (line.strip() for line in block.replace('\\\n', ' ').splitlines())
        blocks.append((needs, [line for line in lines if line and not line.startswith('#')]))
    return blocks


def shell_commands(page: Path) -> list[str]:
    """The commands of all a page's bash blocks, in its order."""
    return [command for _, commands in shell_blocks(page) for command in commands]


def segments(command: str) -> list[list[str]]:
    """The simple commands of a line, split at &&, |, ; and redirections."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=';&|>')
    lexer.whitespace_split, lexer.commenters = True, '#'
    parts, current = [], []
    for token in lexer:
        if token in SHELL_OPERATORS or set(token) <= set(';&|>'):
            parts.append(current)
            current = []
        else:
            current.append(token)
    parts.append(current)
    return [
        [token for i, token in enumerate(part) if not re.fullmatch(r'[A-Z_]+=\S*', token) or i > 0] for part in parts
    ]


def problem(tokens: list[str]) -> str | None:
    """Why the program would refuse these arguments, or None."""
    while tokens and re.fullmatch(r'[A-Z_]+=\S*', tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == 'make':
        missing = [t for t in tokens[1:] if not t.startswith('-') and '=' not in t and t not in MAKE_TARGETS]
        return f'no Makefile target {missing[0]}' if missing else None
    script = next((i for i, token in enumerate(tokens) if token.endswith('.py')), None)
    if script is None or not re.search(r'python|composer|torchrun', tokens[0]):
        return None
    name = tokens[script]
    if not (REPO / name).is_file():
        return f'no file {name}'
    parse = PARSERS.get(Path(name).name) if Path(name).parent == Path('.') else None
    if parse is None:
        return None
    try:
        parse(tokens[script + 1 :])
    except SystemExit as exit:
        return f'refused its arguments (exit status {exit.code})'
    except ValueError as error:  # convert.py's checks of values
        return str(error)
    return None


@pytest.mark.parametrize('page', PAGES, ids=[page.name for page in PAGES])
def test_every_documented_command_reads_as_its_program_reads_it(page, capsys):
    refused = []
    for command in shell_commands(page):
        for tokens in segments(command):
            why = problem(tokens)
            if why:
                refused.append(f'{command}\n    {why}: {capsys.readouterr().err.strip()[-300:]}')
    assert refused == [], '\n'.join(refused)


def test_a_bracketed_alternative_and_a_mistyped_flag_are_caught(capsys):
    assert problem(shlex.split('python benchmark.py --compile [--precomputed_latents]'))
    assert problem(shlex.split('.venv/bin/python convert.py photos/ out --validation_fractio 0.1'))
    assert problem(shlex.split('make no-such-target'))
    assert problem(shlex.split('python benchmark.py --use_synth_data --compile --precomputed_latents')) is None
    assert segments('make install && python report.py a.json > out.md') == [
        ['make', 'install'],
        ['python', 'report.py', 'a.json'],
        ['out.md'],
    ]
