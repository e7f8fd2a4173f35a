"""The command-line parser of every ``asymptote`` subcommand.

argparse answers a bad flag with its whole usage block and the error
under it; a user's mistake here gets one line that names the flag and
what was wrong, and exit status 2 (argparse's own convention). ``--help``
still prints the usage in full, with each flag's default; a flag is
matched whole, never by a prefix.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from asymptote.errors import ConfigError


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


class _KeepLines(_WithDefaults, argparse.RawDescriptionHelpFormatter):
    """Flags with their defaults, and a description and epilog printed as written."""


def service_parser(service: str, config: type[Any], env_prefix: str) -> ArgumentParser:
    """``asymptote <service>``'s parser: ``--config``, described by the service's config model (its
    docstring, and each top-level setting's first sentence and default, as the config file takes them),
    within 80 columns."""
    import json
    import re
    import textwrap

    from pydantic import BaseModel

    lines = []
    for name, field in config.model_fields.items():
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = "a section" if isinstance(value, BaseModel) else f"default {json.dumps(value, default=str)}"
        sentence = re.split(r"(?<=\.)\s+", " ".join((field.description or "").split()))[0]
        said = f"{name} ({default})" + (f": {sentence}" if sentence else "")
        lines.append(textwrap.fill(said, width=78, initial_indent="  ", subsequent_indent="      "))
    about = (config.__doc__ or "").strip().splitlines()[0]
    # An example key the service has: nats.url, or (a service without NATS) the first nested setting.
    example = "nats.url"
    if "nats" not in config.model_fields:
        nested = [
            f"{name}.{next(iter(field.annotation.model_fields))}"
            for name, field in config.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ]
        example = nested[0] if nested else next(iter(config.model_fields))
    settings = (
        f"Settings come from --config (YAML), then {env_prefix}__<KEY> environment variables "
        f"({env_prefix}__{example.upper().replace('.', '__')} sets {example}); docs/configuration.md gives "
        "every one."
    )
    return ArgumentParser(
        prog=f"asymptote {service}",
        description=f"{textwrap.fill(about, 78)}\n\n{textwrap.fill(settings, 78)}",
        epilog="top-level settings:\n" + "\n".join(lines),
        formatter_class=_KeepLines,
    )


def validation_problems(exc: ValidationError, name: Callable[[tuple[int | str, ...]], str]) -> str:
    """Every error of ``exc`` as ``<name of its location>: <what was wrong>, got <input>``, joined by "; "."""
    problems = []
    for err in exc.errors():
        what = str(err["msg"]).removeprefix("Value error, ")
        what = what[0].lower() + what[1:] if what else what
        got = f", got {err['input']!r}" if err["type"] != "missing" and not isinstance(err["input"], Mapping) else ""
        problems.append(f"{name(tuple(err['loc']))}: {what}{got}")
    return "; ".join(problems)


def writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` if missing; ConfigError naming ``flag`` when it cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create the directory: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the directory is not writable")
