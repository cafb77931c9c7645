"""Command-line parsing shared by the scripts: argparse, with its errors as one line, and ConfigError, the bad input
every script reports in one line with exit status 2.

argparse answers a bad flag (`--batch_size abc`, a misspelled name) with its whole usage, 27 lines for
benchmark.py, above the one that says what is wrong. Every other bad input here is one `error:` line and exit
status 2, so argparse's are too, pointing to --help for the usage.
"""

import argparse
import sys


class ConfigError(ValueError):
    """A bad flag, model folder or dataset found before anything is built: one line naming the problem, exit 2."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f'error: {message} (see {self.prog} --help)', file=sys.stderr)
        sys.exit(2)
