"""Every command the README and docs/ show exists, with every flag they give it.

Commands are taken from the documents themselves: each line of a fenced
shell block and each inline code span that runs ``asymptote``,
``./scripts/up.sh`` (``asymptote up``) or ``python -m benchmarks.<name>``.
Each is asked for ``--help`` (what a user would try first, exit 0), and
every ``--flag`` the document writes must be in that help: a renamed or
removed flag fails here, not in a user's shell. Each line is then parsed by
the command's own argparse parser, stopped before the command runs, and
must not lack a required argument (``--output`` of the benchmarks): an
optional group (``[--step N]``) is left out and a placeholder (``DIR``)
given a value, as a user would; an inline span of a command's name alone
is prose naming it. Commands of other tools (helm, kubectl, pip) are theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from services.cli import COMMANDS
from services.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
INLINE = re.compile(r"`((?:\./scripts/up\.sh|asymptote|python -m benchmarks\.)[^`]*)`")
RUNS = re.compile(r"^(?:\./scripts/up\.sh|asymptote\s+[a-z-]+|python -m benchmarks\.\w+)")


SUBCOMMANDED = {"kube", "sandbox"}
"""Commands whose flags belong to a subcommand (``asymptote kube scale``, ``asymptote sandbox exec``)."""


@dataclass(frozen=True)
class Shown:
    """One documented command line."""

    doc: str
    name: str
    """The command: ``asymptote up``, ``asymptote kube status``, ``benchmarks.swap``."""
    words: list[str]
    """The line's words, ``./scripts/up.sh`` read as ``asymptote up``."""
    in_prose: bool = False
    """An inline code span, not a line of a shell block."""

    @property
    def names_only(self) -> bool:
        """Prose naming a command (`asymptote plan` says ...), not a line to run: an inline span of the
        command's name alone. A module run (``python -m benchmarks.scale``) is a line to run."""
        return self.in_prose and self.words[0] != "python" and len(self.words) == len(self.name.split())


def shown_lines() -> list[Shown]:
    """Every command line the documents show."""
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        fenced = [ln for block in FENCE.findall(text) for ln in block.replace("\\\n", " ").splitlines()]
        inline = INLINE.findall(text)
        for i, line in enumerate([*fenced, *inline]):
            line = re.sub(r"^\s*(\$\s*)?(\w+=\S+\s+)*", "", line).split("#")[0].strip()
            if not RUNS.match(line):
                continue
            words = line.replace("./scripts/up.sh", "asymptote up").split()
            if words[0] == "python":
                name = words[2].removeprefix("-m ")
            elif words[1] not in COMMANDS:
                continue  # `asymptote broker | generator | learner | fitter` and the like: prose about several
            elif words[1] in SUBCOMMANDED and len(words) > 2 and not words[2].startswith("-"):
                name = f"asymptote {words[1]} {words[2]}"
            else:
                name = f"asymptote {words[1]}"
            found.append(Shown(doc.name, name, words, in_prose=i >= len(fenced)))
    return found


def documented() -> dict[str, set[str]]:
    """Each documented command and the flags the documents give it."""
    found: dict[str, set[str]] = {}
    for shown in shown_lines():
        flags = (w.strip("[]|").split("=")[0] for w in shown.words)  # `[--step N]`: an optional flag
        found.setdefault(shown.name, set()).update(f for f in flags if f.startswith("--"))
    return found


def help_of(name: str) -> str:
    """``name --help`` run in-process: its output (SystemExit 0 expected)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        if name.startswith("asymptote "):
            code = cli([*name.split()[1:], "--help"])
            raise SystemExit(code)
        importlib.import_module(name).main(["--help"])  # every benchmark's entry point
    assert done.value.code in (0, None), f"{name} --help exited {done.value.code}"
    return out.getvalue()


COMMANDS_SHOWN = documented()


def test_the_documents_show_the_commands_a_user_runs() -> None:
    # The extraction finds what the README and the docs pages name (a guard on the parser above).
    assert {
        "asymptote up",
        "asymptote fit",
        "asymptote export",
        "asymptote plan",
        "asymptote kube status",
        "asymptote sandbox exec",
    } <= set(COMMANDS_SHOWN)
    assert {"--resume", "--model", "--dataset", "--holdout-fraction"} <= COMMANDS_SHOWN["asymptote up"]
    assert {"--to", "--step"} <= COMMANDS_SHOWN["asymptote export"]
    assert any(name.startswith("benchmarks.") for name in COMMANDS_SHOWN)


@pytest.mark.parametrize("name", sorted(COMMANDS_SHOWN))
def test_each_documented_command_answers_help_with_every_documented_flag(name: str) -> None:
    text = help_of(name)
    missing = sorted(flag for flag in COMMANDS_SHOWN[name] if flag not in text)
    assert not missing, f"{name}: the documents give {missing}, which its --help does not list"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_s_help_fits_80_columns(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = help_of(f"asymptote {command}")
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert text.strip() and not wide, wide


@pytest.mark.parametrize("service", ["broker", "generator", "learner", "fitter"])
def test_a_service_s_help_gives_each_top_level_setting_with_its_default(service: str) -> None:
    import importlib

    config = {"broker": "BrokerConfig", "generator": "GeneratorConfig", "learner": "LearnerConfig",
              "fitter": "FitterConfig"}[service]  # fmt: skip
    cls = getattr(importlib.import_module(f"services.{service}.config"), config)
    text = help_of(f"asymptote {service}")
    assert f"ASY_{service.upper()}__" in text and "docs/configuration.md" in text
    for name in cls.model_fields:
        assert f"  {name} (" in text, name
    assert '  prefix (default "asy")' in text


class _Parsed(Exception):
    """The command's own parser took the whole line: stop before the command runs."""


class _Refused(Exception):
    """The command's parser refused the line (argparse's ``exit(2, message)``)."""


@contextlib.contextmanager
def parse_only() -> Iterator[None]:
    """Every argparse parser parses and stops there: its outermost parse raises ``_Parsed``, a refusal
    ``_Refused`` with argparse's message (a subcommand's parser runs inside its parent's)."""
    depth = 0
    parse = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        depth += 1
        try:
            result = parse(self, *args, **kwargs)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed
        return result

    def exit(self: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> NoReturn:
        raise _Refused(message or f"exit {status}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        patch.setattr(argparse.ArgumentParser, "exit", exit)
        yield


PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")
"""A word standing for a value the reader gives (``DIR``, ``N``): taken as ``1`` to parse the line."""
REQUIRED = ("arguments are required", "is required")
"""argparse's refusal of a line that lacks a required argument."""


def as_typed(shown: Shown) -> list[str]:
    """The line's arguments as a user would type them: an optional group (``[--step N | --best]``) left out, a
    placeholder given a value."""
    line = re.sub(r"\[[^\]]*\]", " ", " ".join(shown.words))
    words = line.split()[3:] if shown.name.startswith("benchmarks.") else line.split()[1:]
    return ["1" if PLACEHOLDER.match(w) else w for w in words]


def parse_line(shown: Shown) -> str | None:
    """The command's own parser on the documented line, without running the command: its refusal, or None."""
    argv = as_typed(shown)
    with parse_only(), contextlib.redirect_stderr(io.StringIO()):
        try:
            if shown.name.startswith("asymptote "):
                cli(argv)
            else:
                importlib.import_module(shown.name).main(argv)
        except _Parsed:
            return None
        except _Refused as refused:
            return str(refused).strip()
    raise AssertionError(f"{shown.name} ran without parsing {argv}")


LINES_SHOWN = [shown for shown in shown_lines() if not shown.names_only]


@pytest.mark.parametrize("shown", LINES_SHOWN, ids=[f"{s.doc}:{' '.join(s.words)[:60]}" for s in LINES_SHOWN])
def test_each_documented_command_line_has_its_required_arguments(shown: Shown) -> None:
    refused = parse_line(shown)
    assert refused is None or not any(r in refused for r in REQUIRED), (
        f"{shown.doc}: {' '.join(shown.words)}: {refused}"
    )


def test_the_parse_catches_a_missing_required_argument_and_runs_nothing() -> None:
    def line(name: str, text: str) -> Shown:
        return Shown("test", name, text.split())

    assert "required: --to" in str(parse_line(line("asymptote export", "asymptote export runs/x")))
    assert "required: --output" in str(parse_line(line("benchmarks.scale", "python -m benchmarks.scale")))
    assert parse_line(line("benchmarks.scale", "python -m benchmarks.scale --output DIR")) is None
    assert parse_line(line("asymptote export", "asymptote export runs/x --to DIR [--step N | --best]")) is None
