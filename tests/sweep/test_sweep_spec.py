"""A sweep's spec resolved before anything runs (services/sweep/spec.py, ``asymptote sweep plan``): arms as
whole configs, leave-one-out and grids, and every wrong spec one line naming what is wrong, exit 2."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import main
from services.sweep.spec import LOO_COMPONENTS, SweepSpec, planned, resolve

GOOD: dict[str, Any] = {
    "arms": {"variants": [{"name": "dapo", "set": {"services.learner.loss.name": "dapo"}}]},
    "budget": {"per_arm": 2e13},
    "warmup": 6e12,
}


def write(tmp_path: Path, spec: dict[str, Any] | str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec))
    return path


def test_variants_are_the_base_with_their_overrides(tmp_path: Path) -> None:
    spec = {**GOOD, "arms": {"variants": [*GOOD["arms"]["variants"], {"name": "lr", "set": {"lr": 3e-4}}]}}
    _, plans = planned(write(tmp_path, spec), gpus_visible=0, cores=2)
    assert [p.name for p in plans] == ["base", "dapo", "lr"]
    base, dapo, lr = (p.config for p in plans)
    assert dapo.services.learner == {"loss": {"name": "dapo"}} and dapo.lr == base.lr
    assert lr.lr == 3e-4 and lr.services.learner == {}
    run = plans[1].run_config(seed=1, run_dir=tmp_path / "dapo-1", prefix="sw_dapo_1")
    assert (run.seed, run.prefix, run.run_dir, run.services.learner) == (
        1,
        "sw_dapo_1",
        tmp_path / "dapo-1",
        {"loss": {"name": "dapo"}},
    )


def test_leave_one_out_reverts_each_component_once() -> None:
    spec = SweepSpec.model_validate({**GOOD, "arms": {"leave_one_out": ["all"]}})
    plans = resolve(spec)
    assert [p.name for p in plans] == ["base", *(f"no-{c.replace('_', '-')}" for c in LOO_COMPONENTS)]
    by_name = {p.name: p.config for p in plans}
    assert by_name["no-zero-variance"].zero_variance == "keep" and by_name["base"].zero_variance == "drop"
    assert by_name["no-pipeline"].mode == "sync"
    assert by_name["no-loss"].services.learner == {"loss": {"name": "dapo"}}


def test_a_grid_is_every_combination() -> None:
    spec = SweepSpec.model_validate(
        {**GOOD, "include_base": False, "arms": {"grid": {"lr": [1e-4, 3e-4], "zero_variance": ["drop", "keep"]}}}
    )
    plans = resolve(spec)
    assert sorted((p.config.lr, p.config.zero_variance) for p in plans) == [
        (1e-4, "drop"),
        (1e-4, "keep"),
        (3e-4, "drop"),
        (3e-4, "keep"),
    ]
    assert len({p.name for p in plans}) == 4


def test_the_plan_prints_its_runs_budget_and_looks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "plan", str(write(tmp_path, {**GOOD, "seeds": 2}))]) == 0
    out = capsys.readouterr().out
    assert "4 runs, 1 at a time" in out and "80 TFLOP in all" in out and "judged from 6 TFLOP" in out


BAD: list[tuple[str, dict[str, Any] | str, str]] = [
    ("not YAML", "arms: [\n", "not YAML"),
    ("not a mapping", "- a\n- b\n", "a sweep spec is a mapping"),
    ("an unknown field", {**GOOD, "arm": {}}, "arm: extra inputs are not permitted"),
    ("no budget", {k: v for k, v in GOOD.items() if k != "budget"}, "budget: field required"),
    (
        "an override of a setting that does not exist",
        {**GOOD, "arms": {"variants": [{"name": "x", "set": {"services.learner.loss.nme": "dapo"}}]}},
        "arm 'x': services: learner.loss.nme: extra inputs are not permitted",
    ),
    (
        "a value the setting refuses",
        {**GOOD, "arms": {"variants": [{"name": "x", "set": {"lr": -1.0}}]}},
        "arm 'x': lr: input should be greater than 0",
    ),
    ("a top-level field that does not exist", {**GOOD, "base": {"max_step": 10}}, "arm 'base': max_step: extra"),
    (
        "two identical arms",
        {**GOOD, "arms": {"variants": [{"name": "a", "set": {"lr": 1e-4}}]}},
        "arms 'base' and 'a' are the same run",
    ),
    (
        "two arms of one name",
        {**GOOD, "arms": {"variants": [{"name": "a", "set": {"lr": 3e-4}}, {"name": "a", "set": {"lr": 1e-3}}]}},
        "two arms are named 'a'",
    ),
    ("a budget below warm-up", {**GOOD, "budget": {"per_arm": 1e12}}, "budget.per_arm 1e+12 is not above warmup"),
    (
        "a total below one arm's budget",
        {**GOOD, "budget": {"per_arm": 2e13, "total": 1e13}},
        "budget.total 1e+13 is below budget.per_arm",
    ),
    ("more runs at once than the machine places", {**GOOD, "at_once": 4096}, "at_once 4096: the CPU build"),
    (
        "an arm that sets what the sweep sets",
        {**GOOD, "arms": {"variants": [{"name": "x", "set": {"prefix": "mine"}}]}},
        "arm 'x': prefix is set by the sweep",
    ),
    ("an unknown leave-one-out component", {**GOOD, "arms": {"leave_one_out": ["kl"]}}, "'kl' is not a component"),
    (
        "arms given two ways",
        {**GOOD, "arms": {"leave_one_out": ["loss"], "grid": {"lr": [1e-3]}}},
        "give the arms one way",
    ),
    ("a single arm", {**GOOD, "include_base": False}, "a sweep compares at least 2 arms, got 1"),
    ("a bad arm name", {**GOOD, "arms": {"variants": [{"name": "Big Arm"}]}}, "arms.variants.0.name"),
    (
        "a path through a value",
        {**GOOD, "arms": {"variants": [{"name": "x", "set": {"lr": 1e-3, "lr.value": 2}}]}},
        "override lr.value goes inside lr, which is not a section",
    ),
]


@pytest.mark.parametrize("action", ["plan", "run"])
@pytest.mark.parametrize(("spec", "said"), [(s, w) for _, s, w in BAD], ids=[k for k, _, _ in BAD])
def test_a_wrong_spec_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: dict[str, Any] | str, said: str, action: str
) -> None:
    """``plan`` and ``run`` alike: exit 2, one line, and (``run``) not even the sweep's folder made."""
    folder = tmp_path / "sweep-dir"
    extra = ["--dir", str(folder)] if action == "run" else []
    assert main(["sweep", action, str(write(tmp_path, spec)), *extra]) == 2
    assert not folder.exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith(f"asymptote sweep: {tmp_path / 'sweep.yaml'}: ")
    assert said.lower() in err.lower(), err


def test_runs_at_once_on_gpus_count_each_arms_gpus(tmp_path: Path) -> None:
    spec = {**GOOD, "base": {"gpus": 2}, "at_once": 2}
    _, plans = planned(write(tmp_path, spec), gpus_visible=4, cores=2)
    assert len(plans) == 2
    with pytest.raises(Exception, match="2 runs of 2 GPUs each need 4, and 3 are visible"):
        planned(write(tmp_path, spec), gpus_visible=3, cores=2)


def test_a_metrics_port_in_use_is_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        folder = tmp_path / "sweep-dir"
        assert (
            main(["sweep", "run", str(write(tmp_path, GOOD)), "--dir", str(folder), "--metrics-port", str(port)]) == 2
        )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--metrics-port {port}: cannot serve metrics there" in err
    assert not folder.exists()
