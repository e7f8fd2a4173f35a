"""A mixture's curves: one per sub-task, each fitted exactly as if it were a run of its own.

Two synthetic eval streams (known sigmoids, a held-out round's binomial
noise, seeded) go through the live fitter's path (``RunCollectors.
add_result``, as the evals loop feeds it) interleaved, each result naming
its sub-task; the same streams go, each alone, through a single-task
collector. The mixture's fit of each sub-task must be the lone fit, number
for number; its eval rows are tagged, the lone run's are not; the offline
``asymptote fit`` and the progress line and summary read both curves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from asymptote.contracts.v1 import rollout_pb2
from services.fitter.collector import Collector, RunCollectors
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, predict
from services.fitter.offline import main_fit
from services.local.progress import Progress
from tests.helpers.fitcheck import point_estimates

NUM_PROMPTS, NUM_SAMPLES = 60, 4
EVERY_VERSIONS, LAST_VERSION = 20, 300
COMPUTE_PER_VERSION_S = 60.0
SETTINGS = CurveFitSettings(num_bootstrap_resamples=50)
TARGETS = (2.0,)
FIT_KEYS = ("ok", "a", "b", "c_mid", "r0", "a_interval", "b_interval", "c_mid_interval", "num_points_used", "rmse")


@dataclass(frozen=True)
class Stream:
    task: str
    a: float
    b: float
    c_mid_version: float
    r0: float
    seed: int

    def rounds(self) -> list[tuple[int, list[int]]]:
        rng = np.random.default_rng(self.seed)
        out = []
        for version in range(0, LAST_VERSION + 1, EVERY_VERSIONS):
            compute = version * COMPUTE_PER_VERSION_S
            rate = (
                self.r0 if version == 0 else float(predict(compute, self.a, self.b, self.c_mid_version * 60, self.r0))
            )
            out.append((version, [int(n) for n in rng.binomial(NUM_SAMPLES, rate, size=NUM_PROMPTS)]))
        return out

    def results(self, version: int, correct: list[int], tagged: bool) -> list[rollout_pb2.EvalResult]:
        eval_id = f"eval-v{version}-{self.task}" if tagged else f"eval-v{version}"
        return [
            rollout_pb2.EvalResult(
                eval_id=eval_id,
                task_id=f"{eval_id}-p{prompt}",
                prompt_id=f"p{prompt}",
                num_samples=NUM_SAMPLES,
                num_correct=n,
                eval_version=version,
                min_version=version,
                max_version=version,
                eval_num_prompts=NUM_PROMPTS,
                finished_unix_s=version * COMPUTE_PER_VERSION_S,
                tokens_by_version={version: 100},
                task=self.task if tagged else "",
            )
            for prompt, n in enumerate(correct)
        ]


WORDS = Stream("words", a=0.60, b=2.0, c_mid_version=80, r0=0.25, seed=1)
CODE = Stream("code", a=0.45, b=1.5, c_mid_version=120, r0=0.15, seed=2)


def observe(axis: ComputeAxis, version: int) -> None:
    """One device since t = 0, a version a minute: compute is 60 s per version."""
    now = version * COMPUTE_PER_VERSION_S
    axis.observe(
        rollout_pb2.ComputeTelemetry(
            service="generator", instance_id="g", num_devices=1, device_seconds_total=now, unix_s=now, flops_total=now
        )
    )
    axis.mark_version(version, now)


def lone_fit(stream: Stream, run_dir: Path) -> dict[str, object]:
    axis = ComputeAxis(stale_s=30.0)
    collector = Collector(run_dir, "lone", SETTINGS, TARGETS, axis, plot=False)
    for version, correct in stream.rounds():
        observe(axis, version)
        for result in stream.results(version, correct, tagged=False):
            collector.add_result(result)
    return dict(json.loads((run_dir / "fit.json").read_text()))


def test_each_sub_task_is_fitted_as_if_alone(tmp_path: Path) -> None:
    mixed_dir = tmp_path / "mixed"
    axis = ComputeAxis(stale_s=30.0)
    run = RunCollectors(mixed_dir, "mixed", SETTINGS, TARGETS, axis, plot=False)
    done = []
    for (version, words), (_, code) in zip(WORDS.rounds(), CODE.rounds()):
        observe(axis, version)
        # Interleaved, as results from two rounds arrive on one stream.
        for w, c in zip(WORDS.results(version, words, True), CODE.results(version, code, True)):
            for result in (w, c):
                if run.add_result(result) is not None:
                    done.append((result.task, version))
                    assert run.is_done(result)
    assert done == [(t, v) for v in range(0, LAST_VERSION + 1, EVERY_VERSIONS) for t in ("words", "code")]

    rows = [json.loads(line) for line in (mixed_dir / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (LAST_VERSION // EVERY_VERSIONS + 1)
    assert {r["task"] for r in rows} == {"words", "code"}
    mixed = json.loads((mixed_dir / "fit.json").read_text())
    assert set(mixed["tasks"]) == {"words", "code"} and mixed["num_points"] == len(rows)

    for stream in (WORDS, CODE):
        alone = lone_fit(stream, tmp_path / stream.task)
        fit = mixed["tasks"][stream.task]
        assert fit["ok"] and alone["ok"]
        assert {k: fit.get(k) for k in FIT_KEYS} == {k: alone.get(k) for k in FIT_KEYS}, stream.task
        assert point_estimates(fit) == point_estimates(alone)
        # The lone run's files are a single task's: no task in its rows, its fit at the top.
        lone_rows = (tmp_path / stream.task / "eval.jsonl").read_text().splitlines()
        assert all("task" not in json.loads(line) for line in lone_rows) and "tasks" not in alone
    words, code = (point_estimates(mixed["tasks"][task])["a"] for task in ("words", "code"))
    assert abs(words - WORDS.a) < 0.1 and abs(code - CODE.a) < 0.1

    # A restarted fitter reads both curves back from eval.jsonl.
    again = RunCollectors(mixed_dir, "mixed", SETTINGS, TARGETS, ComputeAxis(stale_s=30.0), plot=False)
    assert [name for name, _ in again.series()] == ["mixed/words", "mixed/code"]
    assert [len(c.points) for _, c in again.series()] == [16, 16]

    # asymptote fit: one row per sub-task, each the lone fit; no comparison across sub-tasks.
    out = tmp_path / "report"
    console = Console(record=True, width=120)
    assert main_fit([mixed_dir], out, SETTINGS, (), console=console) == 0
    report = json.loads((out / "fit.json").read_text())
    assert set(report["runs"]) == {"mixed/words", "mixed/code"} and report["comparison"] == []
    printed = console.export_text()
    assert "mixed/words" in printed and "mixed/code" in printed
    for stream in (WORDS, CODE):
        assert (
            main_fit([tmp_path / stream.task], tmp_path / f"report-{stream.task}", SETTINGS, (), console=console) == 0
        )
        lone = json.loads((tmp_path / f"report-{stream.task}" / "fit.json").read_text())["runs"][stream.task]
        mixed_run = report["runs"][f"mixed/{stream.task}"]
        assert point_estimates(mixed_run) == point_estimates(lone) and mixed_run["r0"] == lone["r0"]

    # The live line and the summary name each sub-task's held-out pass rate and fit.
    progress = Progress(mixed_dir, max_steps=LAST_VERSION)
    snap = progress.snapshot()
    line = progress.line(snap)
    last = {t: [r for r in rows if r["task"] == t][-1]["pass_rate"] for t in ("words", "code")}
    assert f"held-out words {last['words']:.3f}@v{LAST_VERSION}" in line
    assert f"held-out code {last['code']:.3f}@v{LAST_VERSION}" in line
    assert "words: A" in line and "code: A" in line
    progress.console = Console(record=True, width=200)
    progress.finish({})
    summary = json.loads((mixed_dir / "summary.json").read_text())
    by_task = summary["heldout_by_task"]
    for t in ("words", "code"):
        first = next(r for r in rows if r["task"] == t)["pass_rate"]
        assert by_task[t] == {
            "heldout_pass_rate_step0": first,
            "heldout_pass_rate_final": last[t],
            "heldout_gain": last[t] - first,
        }
        assert point_estimates(summary["fit"]["tasks"][t]) == point_estimates(mixed["tasks"][t])
    assert summary["heldout_gain"] == (by_task["words"]["heldout_gain"] + by_task["code"]["heldout_gain"]) / 2
