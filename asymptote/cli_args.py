"""The command-line parser of every ``asymptote`` subcommand.

argparse answers a bad flag with its whole usage block and the error
under it; a user's mistake here gets one line that names the flag and
what was wrong, and exit status 2 (argparse's own convention). ``--help``
still prints the usage in full, with each flag's default; a flag is
matched whole, never by a prefix.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with "(default: ...)" after each flag that has a default worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        said = action.help or ""
        if action.default in (None, False, [], ()) or action.default is argparse.SUPPRESS or "default" in said:
            return said
        return super()._get_help_string(action) or ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (subparsers inherit it), no abbreviated flags (``--max``
    for ``--max-steps`` would break when a flag is added), and each flag's default in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _WithDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")
