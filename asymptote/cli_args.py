"""The command-line parser of every ``asymptote`` subcommand.

argparse answers a bad flag with its whole usage block and the error
under it; a user's mistake here gets one line that names the flag and
what was wrong, and exit status 2 (argparse's own convention). ``--help``
still prints the usage in full.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")
