"""A sweep's spec (``sweep.yaml``): the base run, its arms, seeds, budget and the rule's settings.

Owns reading a spec and resolving it into the runs it names, each a whole
``StackConfig`` (what ``asymptote up --config`` takes), before anything
starts, so that a spec that is wrong in any way is one line naming what is
wrong (``ConfigError``; exit 2 from the command line) and nothing runs:

- ``base``: StackConfig fields, the recipe every arm starts from;
- ``arms``: one of ``variants`` (a named list of overrides, each a dotted
  path of a StackConfig field, e.g. ``services.learner.loss.name: dapo``),
  ``leave_one_out`` (the paper's LOO: each arm reverts one component of the
  ScaleRL recipe, ``LOO_COMPONENTS``) or ``grid`` (every combination of the
  values given per path); the base is an arm too unless
  ``include_base: false``;
- ``seeds`` per arm, the ``budget`` per arm and in all and the ``warmup``
  on the fitter's compute axis (FLOPs), ``at_once`` (arms running at the
  same time), and the rule's ``margin``, ``alpha`` and ``look_ratio``
  (``services.sweep.rule.SweepSettings``).

Each arm's run gets its own NATS prefix and run directory from the sweep;
an arm may not set them. Knows nothing about launchers or Optuna.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from asymptote.cli_args import validation_problems
from asymptote.config import Frozen, merge, set_path
from asymptote.errors import ConfigError
from services.fitter.decision import ALPHA, MARGIN
from services.local.config import StackConfig
from services.sweep.rule import SweepSettings

ARM_NAME = r"^[a-z][a-z0-9_-]{0,39}$"
SWEEP_OWNED = ("run_dir", "prefix", "nats_url", "seed")
"""StackConfig fields the sweep sets for every run of an arm: where it writes, its NATS namespace and server,
and its seed (``seeds`` per arm)."""

LOO_COMPONENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "loss": ("CISPO -> DAPO", {"services.learner.loss.name": "dapo"}),
    "fp32_head": ("FP32 LM head -> bf16 operands", {"services.learner.head_precision": "bf16_fp32_acc"}),
    "aggregation": ("prompt-level loss aggregation -> sample", {"services.learner.loss.aggregation": "sample"}),
    "normalization": ("batch-level advantage normalisation -> group", {"services.learner.loss.normalization": "group"}),
    "zero_variance": ("zero-variance filtering -> kept in the loss", {"zero_variance": "keep"}),
    "no_positive_resampling": (
        "No-Positive-Resampling -> only prompts every sample solved retired",
        {"services.broker.pass_rate_retire": 1.0},
    ),
    "pipeline": ("PipelineRL-k -> synchronous on-policy", {"mode": "sync"}),
}
"""The ScaleRL recipe's components a leave-one-out arm reverts, each with what it becomes (the paper's
Section 4 alternatives) and the overrides that make it so."""


class Variant(Frozen):
    """One arm: a name and the StackConfig settings it changes from the base, by dotted path."""

    name: str = Field(pattern=ARM_NAME)
    """The arm's name (lower case, digits, - and _; it names the arm's runs and NATS prefixes)."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Dotted StackConfig paths and their values, e.g. ``{services.learner.loss.name: dapo, lr: 3.0e-4}``."""


class ArmsSpec(Frozen):
    """The arms, given one way: variants, leave-one-out, or a grid."""

    variants: tuple[Variant, ...] = ()
    """Named arms, each a set of overrides of the base."""
    leave_one_out: tuple[str, ...] = ()
    """Components of the recipe (``LOO_COMPONENTS``) to revert, one arm each; ``[all]``: every component."""
    grid: dict[str, tuple[Any, ...]] = Field(default_factory=dict)
    """Dotted StackConfig paths and the values to try: one arm per combination."""

    @model_validator(mode="after")
    def _one_kind(self) -> ArmsSpec:
        given = [k for k in ("variants", "leave_one_out", "grid") if getattr(self, k)]
        if len(given) != 1:
            said = " and ".join(given) if given else "none"
            raise ValueError(f"give the arms one way (variants, leave_one_out or grid), got {said}")
        return self


class Budget(Frozen):
    """What the sweep may spend, on the fitter's compute axis (FLOPs by default)."""

    per_arm: float = Field(gt=0.0)
    """Compute each arm's run goes to unless the rule stops it: its last look."""
    total: float | None = Field(default=None, gt=0.0)
    """Compute of every run of every arm together; None: arms x seeds x per_arm."""


class SweepSpec(Frozen):
    """A sweep: the base run, its arms and seeds, the budget, and how the rule decides."""

    base: dict[str, Any] = Field(default_factory=dict)
    """StackConfig fields every arm starts from (what ``asymptote up --config`` takes)."""
    arms: ArmsSpec
    """The arms."""
    include_base: bool = True
    """The base itself is an arm (named ``base``)."""
    seeds: int = Field(default=1, ge=1, le=16)
    """Runs of each arm, seeds 0 to seeds - 1."""
    budget: Budget
    """Compute per arm and in all."""
    warmup: float = Field(gt=0.0)
    """Compute before which no arm is judged (the fit's early cutoff; the paper's: about one epoch)."""
    at_once: int = Field(default=1, ge=1)
    """Runs at the same time; at most what the machine can place (its GPUs, or its cores on the CPU)."""
    extra_seeds: int = Field(default=1, ge=0, le=8)
    """Seeds an arm may get beyond ``seeds`` while it leads, or is the leader's closest challenger, and the
    two are undecided: capacity and compute that stopped arms freed, spent where they decide (LUCB). Within
    ``budget.total`` (by default what every planned run at its budget would spend), so it costs nothing
    the plan did not."""
    margin: float = Field(default=MARGIN, gt=0.0, lt=1.0)
    """Delta: arms whose asymptotes differ by less are equivalent."""
    alpha: float = Field(default=ALPHA, gt=0.0, lt=1.0)
    """The sweep's rate of wrong eliminations, spread over the arms and the looks."""
    look_ratio: float = Field(default=math.sqrt(2.0), gt=1.0)
    """Planned looks: geometric from the warm-up by this ratio, then the budget."""

    @model_validator(mode="after")
    def _check_budget(self) -> SweepSpec:
        if self.budget.per_arm <= self.warmup:
            raise ValueError(
                f"budget.per_arm {self.budget.per_arm:g} is not above warmup {self.warmup:g}: no arm would be judged"
            )
        if self.budget.total is not None and self.budget.total < self.budget.per_arm:
            raise ValueError(
                f"budget.total {self.budget.total:g} is below budget.per_arm {self.budget.per_arm:g}: "
                "not one run could reach its budget"
            )
        return self

    @property
    def settings(self) -> SweepSettings:
        """The rule's settings for this sweep."""
        return SweepSettings(
            warmup_compute=self.warmup,
            budget_compute=self.budget.per_arm,
            margin=self.margin,
            alpha=self.alpha,
            look_ratio=self.look_ratio,
        )


@dataclass(frozen=True)
class ArmPlan:
    """One arm, resolved: its overrides of the base and the whole config each of its runs starts from."""

    name: str
    overrides: dict[str, Any]
    config: StackConfig
    """The arm's StackConfig, without the fields the sweep sets per run (SWEEP_OWNED)."""
    reverts: str = ""
    """For a leave-one-out arm, the component it reverts and what it becomes."""

    def run_config(self, seed: int, run_dir: Path, prefix: str, nats_url: str | None = None) -> StackConfig:
        """The config of the arm's run of ``seed``: the arm's, with the sweep's run directory, prefix and server."""
        return self.config.model_copy(update={"seed": seed, "run_dir": run_dir, "prefix": prefix, "nats_url": nats_url})


def nested(dotted: Mapping[str, Any]) -> dict[str, Any]:
    """``{"services.learner.loss.name": "dapo"}`` as ``{"services": {"learner": {"loss": {"name": "dapo"}}}}``."""
    out: dict[str, Any] = {}
    for path, value in dotted.items():
        keys = path.split(".")
        if not all(keys):
            raise ConfigError(f"{path!r} is not a dotted path of settings")
        set_path(out, keys, value)
    return out


def _arm_config(name: str, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> StackConfig:
    owned = [path for path in overrides if path.split(".")[0] in SWEEP_OWNED]
    if owned:
        raise ConfigError(f"arm {name!r}: {owned[0]} is set by the sweep for each run, not by an arm")
    try:
        return StackConfig.model_validate(merge(dict(base), nested(overrides)))
    except ValidationError as exc:
        raise ConfigError(f"arm {name!r}: {validation_problems(exc, _path)}") from exc


def _path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "config"


def _grid_name(path: str, value: Any) -> str:
    leaf = re.sub(r"[^a-z0-9]+", "_", path.split(".")[-1].lower()).strip("_")
    shown = re.sub(r"[^a-z0-9.+-]+", "_", str(value).lower()).strip("_")
    return f"{leaf}-{shown}"


def resolve(spec: SweepSpec) -> list[ArmPlan]:
    """Every arm of ``spec``, each validated as a whole config. ConfigError names the first problem: an arm
    whose overrides name a setting that does not exist or give it a value it refuses, two arms with the same
    name or the same config, an unknown leave-one-out component, fewer than two arms."""
    owned = [k for k in spec.base if k in SWEEP_OWNED]
    if owned:
        raise ConfigError(f"base: {owned[0]} is set by the sweep for each run, not by the base")
    base_config = _arm_config("base", spec.base, {})
    wanted: list[tuple[str, dict[str, Any], str]] = [("base", {}, "")] if spec.include_base else []
    arms = spec.arms
    if arms.variants:
        wanted += [(v.name, dict(v.set), "") for v in arms.variants]
    elif arms.leave_one_out:
        names = list(LOO_COMPONENTS) if arms.leave_one_out == ("all",) else list(arms.leave_one_out)
        for component in names:
            if component not in LOO_COMPONENTS:
                raise ConfigError(
                    f"arms.leave_one_out: {component!r} is not a component of the recipe; "
                    f"known: {', '.join(LOO_COMPONENTS)} (or all)"
                )
            what, overrides = LOO_COMPONENTS[component]
            wanted.append((f"no-{component.replace('_', '-')}", dict(overrides), what))
    else:
        paths = list(arms.grid)
        for values in itertools.product(*(arms.grid[p] for p in paths)):
            overrides = dict(zip(paths, values, strict=True))
            wanted.append(("_".join(_grid_name(p, v) for p, v in overrides.items())[:40], overrides, ""))
    plans: list[ArmPlan] = []
    seen_names: set[str] = set()
    for name, overrides, reverts in wanted:
        if name in seen_names:
            raise ConfigError(f"arms: two arms are named {name!r}")
        seen_names.add(name)
        config = base_config if name == "base" and not overrides else _arm_config(name, spec.base, overrides)
        plans.append(ArmPlan(name, overrides, config, reverts))
    if len(plans) < 2:
        raise ConfigError(f"a sweep compares at least 2 arms, got {len(plans)}")
    dumped = [p.config.model_dump(mode="json") for p in plans]
    for (i, a), (j, b) in itertools.combinations(enumerate(dumped), 2):
        if a == b:
            raise ConfigError(
                f"arms {plans[i].name!r} and {plans[j].name!r} are the same run (their overrides change nothing "
                "between them)"
            )
    return plans


def placeable(spec: SweepSpec, plans: list[ArmPlan], gpus_visible: int, cores: int) -> None:
    """ConfigError when ``at_once`` runs cannot all be placed at once: on GPUs, each run holds its arm's
    ``gpus`` (None: every visible GPU); on the CPU build, a run needs a core of its own for its generators'
    engine."""
    per_run = max((gpus_visible if p.config.gpus is None else p.config.gpus) for p in plans)
    if gpus_visible > 0 and per_run > 0:
        if spec.at_once * per_run > gpus_visible:
            raise ConfigError(
                f"at_once {spec.at_once}: {spec.at_once} runs of {per_run} GPUs each need {spec.at_once * per_run}, "
                f"and {gpus_visible} are visible (set the arms' gpus to split them)"
            )
        return
    if spec.at_once > cores:
        raise ConfigError(
            f"at_once {spec.at_once}: the CPU build gives each run's generator engine a core, and this machine has "
            f"{cores}"
        )


def load_spec(path: Path) -> SweepSpec:
    """``path`` read as a sweep spec; ConfigError naming the file and what is wrong in it."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {' '.join(str(exc).split())}") from exc
    if data is None:
        raise ConfigError(f"{path}: the file is empty; a sweep spec needs at least arms, budget and warmup")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a sweep spec is a mapping of settings, got {type(data).__name__}")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {validation_problems(exc, _path)}") from exc


def planned(path: Path, gpus_visible: int | None = None, cores: int | None = None) -> tuple[SweepSpec, list[ArmPlan]]:
    """The spec at ``path`` and its arms, every check done: what a sweep runs, or ConfigError. The machine's
    GPUs and cores are this one's unless given."""
    spec = load_spec(path)
    if gpus_visible is None:
        from services.local.placement import visible_gpus

        gpus_visible = len(visible_gpus())
    try:
        plans = resolve(spec)
        placeable(spec, plans, gpus_visible, (os.cpu_count() or 1) if cores is None else cores)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return spec, plans
