"""A generator whose task runs programs refuses to start without a sandbox to run them in.

Without the check it started, sampled every code task and scored each 0
(the verifier's sandbox chosen on first use, failing each time). Here the
sandbox is made unavailable by naming a bubblewrap that is not there: the
check refuses in one line that says what would fix it; with a sandbox pool,
or a task that runs no programs, nothing is checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asymptote.errors import ConfigError
from asymptote.sandbox import PoolClientSettings, SandboxSettings
from asymptote.tasks import MixtureEntry, MixtureSettings
from services.generator.scoring import check_sandboxes
from services.local.workloads import workload_task
from tests.helpers.refusals import refusal

REPO = Path(__file__).resolve().parents[2]
MISSING = SandboxSettings(backend="bubblewrap", bwrap_path=Path("/nonexistent/bwrap"))


def code_task_without_a_sandbox() -> MixtureSettings:
    code = workload_task("words-code")
    code = code.model_copy(update={"verifier": code.verifier.model_copy(update={"sandbox": MISSING})})
    return MixtureSettings(
        tasks=(
            MixtureEntry(name="words", weight=1.0, task=workload_task("words")),
            MixtureEntry(name="code", weight=1.0, task=code),
        )
    )


def test_a_code_task_with_no_working_sandbox_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as refused:
        check_sandboxes(code_task_without_a_sandbox(), None)
    message = str(refused.value)
    assert message.startswith("the task runs programs, but this generator has no sandbox pool (sandbox_pool)")
    assert "bubblewrap" in message and "/nonexistent/bwrap" in message and "unsafe_no_sandbox" in message


def test_a_pool_or_a_task_without_programs_is_not_checked() -> None:
    check_sandboxes(code_task_without_a_sandbox(), PoolClientSettings(endpoint="127.0.0.1:1"))
    check_sandboxes(workload_task("words"), None)


def test_the_generator_command_refuses_before_starting_its_engine(tmp_path: Path) -> None:
    config = tmp_path / "generator.yaml"
    task = code_task_without_a_sandbox().model_dump(mode="json")
    config.write_text(yaml.safe_dump({"engine": {"model_dir": str(tmp_path)}, "task": task}))
    assert "no sandbox pool (sandbox_pool)" in refusal("generator", config)
