"""Validation points and the live projection.

Owns eval-round aggregation (results of one round, deduplicated by task id,
become one point once every held-out prompt has reported), the run's curve
points (``eval.jsonl``), refitting on each new point, and the current
projection (``fit.json``, Prometheus, gRPC), with whether it is determined
(``decision.determination``). R0 is the pass rate of the round at policy
version 0.

Readers in other threads (a Prometheus scrape, a gRPC call) see the state
through ``snapshot()``: one immutable object replaced whole after each
refit, so a reader never mixes two fits.

A mixture of tasks (asymptote/tasks/mixture.py) has one curve per
sub-task: ``RunCollectors`` keeps a ``Collector`` per sub-task (the eval
results name theirs), each fitted as if it were alone; their rows share
``eval.jsonl``, each tagged with its ``task``, and ``fit.json`` holds each
one's fit under ``tasks``. A single-task run's files are as they always
were (no ``task`` in a row, the fit at the top of ``fit.json``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asymptote.compute import ComputeUnit, compute_text
from asymptote.contracts.v1 import rollout_pb2, services_pb2
from services.fitter.compute_axis import AxisValue, ComputeAxis
from services.fitter.curve import CurveFit, CurveFitSettings, FitError, Intervals, bootstrap_intervals, fit_curve
from services.fitter.decision import Determination, determination, recommend
from services.fitter.holdout import project_from_half
from services.fitter.plot import PlotSeries, compute_axis_label, plot_curves

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    """One eval round's point on the curve, as a line of ``eval.jsonl``."""

    step: int
    policy_version: int
    compute: float
    pass_rate: float
    num_prompts: int
    num_samples: int
    min_version: int
    max_version: int
    unix_s: float
    sampled_version: float | None = None
    """The token-weighted mean of the versions that sampled the round (``policy_version`` is the version it
    was issued at: in flight, later versions may sample it)."""
    tokens_by_version: dict[str, int] = field(default_factory=dict)
    """Completion tokens of the round each policy version sampled (JSON keys are strings)."""
    compute_by_version: dict[str, float] = field(default_factory=dict)
    """Those versions' compute; ``compute`` is their token-weighted mean."""
    task: str | None = None
    """The mixture's sub-task the point belongs to; None (and no ``task`` key in the row) in a single-task run."""
    compute_unit: ComputeUnit = "device_seconds"
    """The unit of ``compute`` and ``compute_by_version``: "flops" (the axis), or "device_seconds" (what rows
    written before the FLOPs axis hold, which have no ``compute_unit``)."""
    device_seconds: float | None = None
    """Device-seconds held by then (token-weighted as ``compute``): the run's cost, not its axis; None in
    rows written before the FLOPs axis."""
    prompt_ids: list[str] | None = None
    """The round's held-out prompts, sorted: the order of ``correct`` and ``samples``. None in rows written
    before per-prompt counts."""
    correct: list[int] | None = None
    """Correct completions of each prompt (``prompt_ids``' order): what a paired bootstrap over prompts
    resamples, so two runs evaluated on the same prompts compare prompt by prompt."""
    samples: list[int] | None = None
    """Completions sampled of each prompt (``prompt_ids``' order); ``num_samples`` is their sum."""

    def row(self) -> dict[str, Any]:
        """The point as a line of ``eval.jsonl`` (without ``task`` in a single-task run)."""
        values = asdict(self)
        if self.task is None:
            del values["task"]
        return values


def sampled_compute(tokens_by_version: dict[int, int], compute_of: Callable[[int], float]) -> float:
    """The compute that produced a round: each sampling version's compute, weighted by its tokens."""
    total = sum(tokens_by_version.values())
    return sum(n * compute_of(v) for v, n in tokens_by_version.items()) / total


@dataclass(frozen=True)
class Snapshot:
    """What readers see: the latest fit attempt and the state it was made from.

    Replaced whole, never mutated, so everything in one snapshot belongs together.
    """

    projection: services_pb2.Projection
    """The latest fit attempt: a fit, or ``ok=False`` with the reason."""
    last_ok: services_pb2.Projection | None
    """The latest successful fit (the same object as ``projection`` when that succeeded)."""
    num_points: int
    """Validation points collected, R0's included."""
    last_compute: float
    """Compute of the latest point (in the curve's axis unit, ``projection.compute_unit``); 0 without points."""
    last_pass_rate: float
    """Pass rate of the latest point; 0 without points."""
    half_run_projected: float | None = None
    """The pass rate at the latest point's compute projected by a fit of the points
    at most half that compute (``holdout.project_from_half``); None until it can be made."""
    half_run_measured: float | None = None
    """The latest point's pass rate, as the half-run check compares it."""
    determination: Determination | None = None
    """Whether ``last_ok`` is determined (``decision.determination``) and if not why; None without one."""


@dataclass
class _Round:
    eval_id: str
    version: int
    expected: int
    results: dict[str, rollout_pb2.EvalResult] = field(default_factory=dict)


def load_points(path: Path, task: str | None = None) -> list[Point]:
    """The points of a previous life of this fitter, in policy-version order: those of sub-task ``task``
    (None: the rows without a task, a single-task run's).

    A line that does not parse (a write cut short by a crash) is skipped
    with a warning: its round's results were not acked, so they are
    redelivered and the point is made again.
    """
    if not path.exists():
        return []
    points = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            point = Point(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            log.warning("skipping unreadable curve point %s:%d: %s", path, line_number, exc)
            continue
        if point.task == task:
            points.append(point)
    return sorted(points, key=lambda p: p.policy_version)


def tasks_in(path: Path) -> list[str]:
    """The sub-tasks whose rows ``eval.jsonl`` holds, in order of first appearance (none: a single task)."""
    if not path.exists():
        return []
    found: dict[str, None] = {}
    for line in path.read_text().splitlines():
        try:
            task = json.loads(line).get("task")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(task, str):
            found[task] = None
    return list(found)


class Collector:
    """Eval rounds in, curve points and projections out (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        settings: CurveFitSettings,
        target_multiples: tuple[float, ...],
        axis: ComputeAxis,
        plot: bool,
        planned_compute: float | None = None,
        task: str | None = None,
        on_fit: Callable[[str, dict[str, Any]], None] | None = None,
        compute_unit: ComputeUnit = "flops",
    ) -> None:
        self.run_dir = run_dir
        self.run_name = run_name
        self.task = task
        """The mixture's sub-task this curve is of; None in a single-task run."""
        self.on_fit = on_fit
        """A sub-task's fit goes here (RunCollectors merges them into fit.json); None: this writes fit.json."""
        self.settings = settings
        self.target_multiples = target_multiples
        self.planned_compute = planned_compute
        self.axis = axis
        self.plot = plot
        self.eval_path = run_dir / "eval.jsonl"
        self.points: list[Point] = load_points(self.eval_path, task)
        self.compute_unit: ComputeUnit = self.points[0].compute_unit if self.points else compute_unit
        """The unit of the curve's compute axis: ``compute_unit``, or that of the points of a previous life (a run
        begun on device-seconds continues on them: one curve has one axis)."""
        if self.compute_unit != compute_unit:
            log.warning(
                "%s holds points on the %s axis: the curve continues on it, not on %s",
                self.eval_path,
                self.compute_unit,
                compute_unit,
            )
        other = [p for p in self.points if p.compute_unit != self.compute_unit]
        if other:
            log.warning(
                "skipping %d curve points of %s on another axis than %s", len(other), self.eval_path, self.compute_unit
            )
            self.points = [p for p in self.points if p.compute_unit == self.compute_unit]
        self._rounds: dict[str, _Round] = {}
        self._done = {p.policy_version for p in self.points}
        self._lock = threading.Lock()
        self._snapshot = Snapshot(services_pb2.Projection(ok=False, reason="no eval points yet"), None, 0, 0.0, 0.0)
        if self.points:
            log.info("loaded %d curve points from %s", len(self.points), self.eval_path)
            self.refit()

    def snapshot(self) -> Snapshot:
        """The current state, consistent with itself (safe from any thread)."""
        with self._lock:
            return self._snapshot

    @property
    def projection(self) -> services_pb2.Projection:
        """The latest fit attempt."""
        return self.snapshot().projection

    def is_done(self, version: int) -> bool:
        """Whether the eval round of ``version`` has its point."""
        return version in self._done

    def add_result(self, result: rollout_pb2.EvalResult) -> Point | None:
        """Add one eval result; returns the round's point when it completes."""
        version = int(result.eval_version)
        if version in self._done:
            return None
        rnd = self._rounds.setdefault(
            result.eval_id, _Round(result.eval_id, version, max(int(result.eval_num_prompts), 1))
        )
        rnd.results[result.task_id] = result
        if len(rnd.results) < rnd.expected:
            return None
        del self._rounds[result.eval_id]
        self._done.add(version)
        # Sorted by prompt id, not by arrival: the per-prompt lists line up across rounds and runs.
        rs = sorted(rnd.results.values(), key=lambda r: r.prompt_id)
        finished = min(r.finished_unix_s for r in rs)
        tokens: dict[int, int] = {}
        for r in rs:
            for v, n in r.tokens_by_version.items():
                tokens[int(v)] = tokens.get(int(v), 0) + int(n)
        if not any(tokens.values()):  # no tokens, or a generator that does not say: the issued version
            tokens = {version: 1}
        values: dict[int, AxisValue] = {v: self.axis.at_version(v, finished) for v in sorted(tokens)}
        computes = {v: value.of(self.compute_unit) for v, value in values.items()}
        point = Point(
            step=version,
            policy_version=version,
            compute=sampled_compute(tokens, computes.__getitem__),
            compute_unit=self.compute_unit,
            device_seconds=sampled_compute(tokens, lambda v: values[v].device_seconds),
            sampled_version=sum(v * n for v, n in tokens.items()) / sum(tokens.values()),
            tokens_by_version={str(v): n for v, n in sorted(tokens.items())},
            compute_by_version={str(v): c for v, c in computes.items()},
            pass_rate=float(np.mean([r.num_correct / max(r.num_samples, 1) for r in rs])),
            num_prompts=len(rs),
            num_samples=sum(r.num_samples for r in rs),
            min_version=min(int(r.min_version) for r in rs),
            max_version=max(int(r.max_version) for r in rs),
            unix_s=time.time(),
            task=self.task,
            prompt_ids=[r.prompt_id for r in rs],
            correct=[int(r.num_correct) for r in rs],
            samples=[int(r.num_samples) for r in rs],
        )
        self.points.append(point)
        self.points.sort(key=lambda p: p.policy_version)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.eval_path.open("a") as f:
            f.write(json.dumps(point.row()) + "\n")
        log.info(
            "eval point%s: version %d, compute %s, pass rate %.3f (%d prompts)",
            f" of {self.task}" if self.task else "",
            point.policy_version,
            compute_text(point.compute, self.compute_unit),
            point.pass_rate,
            point.num_prompts,
        )
        self.refit()
        return point

    @property
    def r0(self) -> float | None:
        for p in self.points:
            if p.policy_version == 0:
                return p.pass_rate
        return None

    def refit(self) -> services_pb2.Projection:
        """Fit the points collected so far and publish the result (snapshot, fit.json, plot).

        Called from one thread at a time (the evals loop); readers use ``snapshot()``.
        """
        r0 = self.r0
        pts = [p for p in self.points if p.policy_version > 0]
        compute = np.array([p.compute for p in pts])
        pass_rate = np.array([p.pass_rate for p in pts])
        fitted: tuple[CurveFit, Intervals] | None = None
        judged: Determination | None = None
        if r0 is None:
            proj = services_pb2.Projection(ok=False, reason="no eval at policy version 0 yet (R0)")
        elif self.compute_unit == "flops" and compute.size and not np.any(compute > 0):
            # The services count FLOPs with N from the model's safetensors headers; without them N is 0.
            reason = (
                f"no FLOPs counted (N by service: {self.axis.num_params() or 'no telemetry yet'}): the model "
                "directory holds no safetensors weights, or telemetry has not come in; or set the fitter's "
                "compute_axis: device_seconds"
            )
            proj = services_pb2.Projection(
                ok=False, reason=reason, r0=r0, num_points_used=len(pts), compute_unit="flops"
            )
        else:
            proj, fitted = fit_projection(
                compute, pass_rate, r0, self.settings, self.target_multiples, self.planned_compute, self.compute_unit
            )
            judged = determination(*fitted) if fitted is not None else None
        last = self.points[-1] if self.points else None
        half = project_from_half(compute, pass_rate, r0, self.settings) if r0 is not None and len(pts) >= 2 else {}
        with self._lock:
            self._snapshot = Snapshot(
                projection=proj,
                last_ok=proj if proj.ok else self._snapshot.last_ok,
                num_points=len(self.points),
                last_compute=last.compute if last else 0.0,
                last_pass_rate=last.pass_rate if last else 0.0,
                half_run_projected=half.get("projected"),
                half_run_measured=half.get("measured") if half.get("projected") is not None else None,
                determination=judged if proj.ok else self._snapshot.determination,
            )
        self._write(proj, judged)
        if self.plot and len(pts):
            fit, intervals = fitted if fitted is not None else (None, None)
            try:
                plot_curves(
                    [PlotSeries(self.series_name, compute, pass_rate, fit, intervals, judged)],
                    self.run_dir / (f"curve-{self.task}.png" if self.task else "curve.png"),
                    target_compute=self.planned_compute,  # the horizon `asymptote fit` draws to as well
                    compute_label=compute_axis_label(self.compute_unit),
                )
            except Exception as exc:  # a plot must never stop the fitter
                log.warning("curve plot not written: %s", exc)
        return proj

    def series(self) -> list[tuple[str, Collector]]:
        """This curve with its name (as ``RunCollectors.series``)."""
        return [(self.series_name, self)]

    @property
    def series_name(self) -> str:
        """The curve's name: the run's, or ``run/sub-task`` in a mixture."""
        return f"{self.run_name}/{self.task}" if self.task else self.run_name

    def _write(self, proj: services_pb2.Projection, judged: Determination | None) -> None:
        """``fit.json`` (``fit_json``), with ``run``, ``num_points``, ``compute_by_service`` (device-seconds held
        so far, the run's cost: generator and learner training, and ``eval``, the eval rounds' sampling, which
        the curve's compute axis leaves out), ``flops_by_service`` (the same in FLOPs, the axis) and
        ``num_params`` (N by service)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        body = fit_json(proj, judged)
        body.update(
            run=self.run_name,
            num_points=len(self.points),
            compute_by_service=self.axis.by_service(),
            flops_by_service=self.axis.flops_by_service(),
            num_params=self.axis.num_params(),
        )
        if self.on_fit is not None and self.task is not None:
            self.on_fit(self.task, body)
            return
        write_fit_json(self.run_dir, body)


def fit_json(proj: services_pb2.Projection, judged: Determination | None) -> dict[str, Any]:
    """A fit attempt as ``fit.json`` states it, led by whether it is determined.

    ``determined``, ``why_not_determined`` (for an attempt that failed, its reason) and ``not_determined``
    (the kinds of reason, ``decision.NOT_DETERMINED_KINDS``; empty for a failed attempt) come first. A
    determined fit then has the Projection's fields by name. An undetermined one has them too except its
    point values: ``a``, ``b``, ``c_mid`` and each projection's ``pass_rate`` are kept apart under
    ``not_determined_point_estimates`` (they are not a forecast), the intervals stay where they are. A
    failed attempt has ``ok``, ``reason``, ``r0``, ``num_points_used`` and ``compute_unit`` only. Absent
    values are absent: no ``planned_compute`` without a budget.
    """
    from google.protobuf.json_format import MessageToDict

    determined = judged is not None and judged.determined
    head: dict[str, Any] = {
        "determined": determined,
        "why_not_determined": judged.why_not if judged is not None else proj.reason,
        "not_determined": [shortfall.kind for shortfall in judged.shortfalls] if judged is not None else [],
    }
    fields = MessageToDict(proj, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for name in ("determined", "why_not_determined", "not_determined"):
        fields.pop(name, None)
    if not proj.ok:
        kept = ("ok", "reason", "r0", "num_points_used", "compute_unit")
        return {**head, **{name: fields[name] for name in kept if name in fields}}
    if not determined:
        fields["not_determined_point_estimates"] = {
            "a": fields.pop("a"),
            "b": fields.pop("b"),
            "c_mid": fields.pop("c_mid"),
            "projected_pass_rates": [projection.pop("pass_rate") for projection in fields["projections"]],
        }
    return {**head, **fields}


def write_fit_json(run_dir: Path, body: dict[str, Any]) -> None:
    """Replace ``run_dir/fit.json`` with ``body`` (written beside it, then renamed: never half a file)."""
    tmp = run_dir / "fit.json.tmp"
    tmp.write_text(json.dumps(body, indent=2))
    tmp.replace(run_dir / "fit.json")


class RunCollectors:
    """The run's curves: one ``Collector`` for a single-task run, or one per sub-task of a mixture.

    Which it is comes from the eval results (a mixture's name their
    sub-task) or, after a restart, from ``eval.jsonl``'s rows. A mixture's
    ``fit.json`` is ``{"run", "num_points", "compute_by_service", "tasks":
    {sub-task: that sub-task's fit, as a single-task run's fit.json has it}}``.
    """

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        settings: CurveFitSettings,
        target_multiples: tuple[float, ...],
        axis: ComputeAxis,
        plot: bool,
        planned_compute: float | None = None,
        compute_unit: ComputeUnit = "flops",
    ) -> None:
        self.run_dir = run_dir
        self.run_name = run_name
        self.settings = settings
        self.target_multiples = target_multiples
        self.axis = axis
        self.plot = plot
        self.planned_compute = planned_compute
        self.compute_unit: ComputeUnit = compute_unit
        self.by_task: dict[str, Collector] = {}
        """A mixture's collectors, by sub-task (empty in a single-task run)."""
        self._fits: dict[str, dict[str, Any]] = {}
        self._single: Collector | None = None
        tasks = tasks_in(run_dir / "eval.jsonl")
        for task in tasks:
            self.collector(task)
        if not tasks:  # a single-task run (or a mixture before its first point): its points, refitted now
            self.collector()

    def collector(self, task: str = "") -> Collector:
        """The collector of sub-task ``task`` (made on first use); empty: the single task's."""
        if not task:
            if self._single is None:
                self._single = self._new(None)
            return self._single
        if task not in self.by_task:
            self.by_task[task] = self._new(task)
        return self.by_task[task]

    def _new(self, task: str | None) -> Collector:
        return Collector(
            self.run_dir,
            self.run_name,
            self.settings,
            self.target_multiples,
            self.axis,
            self.plot,
            self.planned_compute,
            task=task,
            on_fit=self._task_fit,
            compute_unit=self.compute_unit,
        )

    @property
    def mixed(self) -> bool:
        return bool(self.by_task)

    def add_result(self, result: rollout_pb2.EvalResult) -> Point | None:
        """Add one eval result to its sub-task's curve (the run's, in a single-task run)."""
        return self.collector(result.task).add_result(result)

    def is_done(self, result: rollout_pb2.EvalResult) -> bool:
        """Whether the round ``result`` belongs to has its point."""
        return self.collector(result.task).is_done(int(result.eval_version))

    def series(self) -> list[tuple[str, Collector]]:
        """Each curve with its name (``run``, or ``run/sub-task`` in a mixture)."""
        if self.by_task:
            return [(c.series_name, c) for c in self.by_task.values()]
        return [(self.run_name, self.collector())]

    def _task_fit(self, task: str, body: dict[str, Any]) -> None:
        self._fits[task] = body  # called from within a new collector too, before by_task holds it
        tasks = dict(self._fits)
        write_fit_json(
            self.run_dir,
            {
                "run": self.run_name,
                "num_points": sum(body["num_points"] for body in tasks.values()),
                "compute_by_service": self.axis.by_service(),
                "flops_by_service": self.axis.flops_by_service(),
                "num_params": self.axis.num_params(),
                "tasks": tasks,
            },
        )


def fit_projection(
    compute: np.ndarray,
    pass_rate: np.ndarray,
    r0: float,
    settings: CurveFitSettings,
    target_multiples: tuple[float, ...],
    planned_compute: float | None = None,
    compute_unit: ComputeUnit = "flops",
) -> tuple[services_pb2.Projection, tuple[CurveFit, Intervals] | None]:
    """Fit, bootstrap and recommend; a refusal becomes ``ok=False`` with the reason.

    The projections are at ``target_multiples`` of the largest compute so
    far and, when given, at ``planned_compute`` (the run's budget), which the
    recommendation looks to. A fit with a parameter at its bound is flagged
    (``at_bound``, ``identifiable`` false), and one that is not determined
    (``decision.determination``) gets "continue" with the reason: neither's
    projection is to be read.
    """
    try:
        fit = fit_curve(compute, pass_rate, r0, settings)
        current = float(compute.max())
        targets = [current * m for m in target_multiples]
        if planned_compute is not None and planned_compute not in targets:
            targets.append(planned_compute)
        iv = bootstrap_intervals(compute, pass_rate, r0, settings, fit, targets)
    except FitError as exc:
        failed = services_pb2.Projection(
            ok=False,
            reason=str(exc),
            r0=r0,
            num_points_used=len(compute),
            why_not_determined=str(exc),
            compute_unit=compute_unit,
        )
        return failed, None
    if fit.params_at_bounds:
        log.warning(
            "curve fit ended on the bound of %s: the points so far do not pin it down", ", ".join(fit.params_at_bounds)
        )
    advice = recommend(fit, iv, current, planned_compute)
    judged = determination(fit, iv)
    proj = services_pb2.Projection(
        ok=True,
        a=fit.a,
        b=fit.b,
        c_mid=fit.c_mid,
        r0=fit.r0,
        a_interval=services_pb2.Interval(low=iv.a.low, high=iv.a.high),
        b_interval=services_pb2.Interval(low=iv.b.low, high=iv.b.high),
        c_mid_interval=services_pb2.Interval(low=iv.c_mid.low, high=iv.c_mid.high),
        num_points_used=fit.num_points_used,
        rmse=fit.rmse,
        projections=[
            services_pb2.ProjectedValue(
                compute=c,
                pass_rate=float(fit.predict(c)),
                interval=services_pb2.Interval(low=i.low, high=i.high),
            )
            for c, i in zip(targets, iv.projection)
        ],
        fitted_unix_s=time.time(),
        at_bound=list(fit.params_at_bounds),
        identifiable=fit.identifiable,
        recommendation=advice.action,
        recommendation_reason=advice.reason,
        planned_compute=planned_compute,
        determined=judged.determined,
        why_not_determined=judged.why_not,
        not_determined=[shortfall.kind for shortfall in judged.shortfalls],
        compute_unit=compute_unit,
    )
    return proj, (fit, iv)
