"""Every command the README and docs/ show exists, with every flag they give it.

Commands are taken from the documents themselves: each line of a fenced
shell block and each inline code span that runs ``asymptote``,
``./scripts/up.sh`` (``asymptote up``) or ``python -m benchmarks.<name>``.
Each is asked for ``--help`` (what a user would try first, exit 0), and
every ``--flag`` the document writes must be in that help: a renamed or
removed flag fails here, not in a user's shell. Commands of other tools
(helm, kubectl, pip) are theirs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

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


def documented() -> dict[str, set[str]]:
    """Each documented command (``asymptote up``, ``asymptote kube status``, ``benchmarks.swap``) and the
    flags the documents give it."""
    found: dict[str, set[str]] = {}
    for doc in DOCUMENTS:
        text = doc.read_text()
        lines = [ln for block in FENCE.findall(text) for ln in block.replace("\\\n", " ").splitlines()]
        lines += INLINE.findall(text)
        for line in lines:
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
            flags = (w.strip("[]|").split("=")[0] for w in words)  # `[--step N]`: an optional flag
            found.setdefault(name, set()).update(f for f in flags if f.startswith("--"))
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
