"""The local run's progress says what it waits for before the first step, from the services' own readiness."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from services.local.progress import Progress

READY = {"nats-server": True, "broker": True, "learner": True, "generator-0": True, "fitter": True}


def snap(step: int) -> dict[str, object]:
    return {"step": step, "policy_version": step, "batch_pass_rate": None, "samples_per_s": None,
            "staleness": None, "evals": [], "fit": {}}  # fmt: skip


def test_a_service_still_starting_is_named_with_its_reason() -> None:
    ready = {**READY, "generator-0": False, "learner": False}
    details = {"generator-0": "vLLM engine starting", "learner": ""}
    assert Progress.waiting(snap(0), ready, details) == "starting learner, generator-0 (vLLM engine starting)"


def test_all_ready_before_the_first_step_waits_for_rollouts() -> None:
    assert Progress.waiting(snap(0), READY, {}) == "waiting for the first batch of rollouts"


def test_once_steps_come_nothing_is_waited_for(tmp_path: Path) -> None:
    ready = {**READY, "generator-0": False}  # a restart mid-run shows in the services row, not as waiting
    assert Progress.waiting(snap(3), ready, {"generator-0": "vLLM engine starting"}) is None
    progress = Progress(tmp_path, max_steps=10)
    assert "starting" not in progress.line(snap(3), ready) and "step 3/10" in progress.line(snap(3), ready)


def test_the_line_and_the_panel_show_the_reason(tmp_path: Path) -> None:
    progress = Progress(tmp_path, max_steps=10)
    ready, details = {**READY, "generator-0": False}, {"generator-0": "vLLM engine starting"}
    assert progress.line(snap(0), ready, details).endswith("step 0/10  starting generator-0 (vLLM engine starting)")
    out = io.StringIO()
    Console(file=out, width=200).print(progress.render(snap(0), ready, details))
    assert "starting generator-0 (vLLM engine starting)" in out.getvalue()
