"""A run's metrics mirrored to an experiment tracker: TensorBoard or Weights & Biases (``--report-to``).

Owns reading what the run directory gains (``metrics.jsonl``: one row per
learner step; ``eval.jsonl``: one row per eval round) and logging each new
row once: a step's numeric fields under ``train/`` at its step, an eval
round's under ``eval/`` at the policy version it measured (with its
compute, the curve's x axis). It reads the files as any reader would, from
where it stopped, so a service that restarts, a tracker that is slow, or a
resumed run changes nothing; off by default, and the services know nothing
of it.

TensorBoard writes event files into ``<run>/tensorboard`` (``tensorboard
--logdir runs``); W&B logs to the project ``WANDB_PROJECT`` (default
``asymptote``) in the mode W&B's own environment sets (``WANDB_MODE=offline``
keeps it on the machine), with the stack's config as the run's config.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

Tracker = Literal["tensorboard", "wandb"]
TRACKERS: tuple[Tracker, ...] = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"


class _Sink(Protocol):
    def train(self, step: int, values: dict[str, float]) -> None: ...
    def eval(self, version: int, values: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def train(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"train/{key}", value, global_step=step)

    def eval(self, version: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"eval/{key}", value, global_step=version)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "asymptote"),
            name=name,
            dir=str(run_dir),
            config=dict(config),
            reinit="finish_previous",
        )
        # Train rows go by learner step, eval rows by the policy version they measured: each its own axis.
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/policy_version")
        self.run.define_metric("eval/*", step_metric="eval/policy_version")

    def train(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"train/step": step, **{f"train/{k}": v for k, v in values.items()}})

    def eval(self, version: int, values: dict[str, float]) -> None:
        self.run.log({"eval/policy_version": version, **{f"eval/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # Wait for W&B's own service process to write out and close the run's files: a busy machine can
        # otherwise end the supervisor before the offline log holds the rows (wandb's atexit hook is not
        # reliable once the process is being stopped). The supervisor is W&B's only user in its process.
        wandb.teardown()


def _numbers(row: Mapping[str, Any], leave_out: tuple[str, ...]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k not in leave_out and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class _Tail:
    """The complete lines a JSON-lines file gained since the last read (a half-written last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipped a line that is not JSON", self.path)
        return out


class Mirror:
    """Mirror ``run_dir``'s metrics.jsonl and eval.jsonl to ``report_to`` as they grow (``poll``)."""

    def __init__(self, run_dir: Path, report_to: tuple[Tracker, ...], name: str, config: Mapping[str, Any]) -> None:
        self.sinks: list[_Sink] = []
        for tracker in dict.fromkeys(report_to):
            self.sinks.append(_TensorBoard(run_dir) if tracker == "tensorboard" else _WandB(run_dir, name, config))
        self.steps = _Tail(run_dir / "metrics.jsonl")
        self.evals = _Tail(run_dir / "eval.jsonl")
        self.last_step = 0

    def poll(self) -> int:
        """Log what the files gained; returns the rows logged. A step trained again after a restart (at or
        below one already logged) is left out: the tracker shows the steps whose weights continued up to it."""
        logged = 0
        for row in self.steps.rows():
            step = int(row.get("step", 0))
            if step <= self.last_step:
                continue
            self.last_step = step
            values = _numbers(row, ("step", "unix_s"))
            for sink in self.sinks:
                sink.train(step, values)
            logged += 1
        for row in self.evals.rows():
            values = _numbers(row, ("policy_version", "unix_s"))
            if isinstance(row.get("task"), str):  # a mixture's sub-task: a curve of its own
                values = {f"{row['task']}/{name}": value for name, value in values.items()}
            for sink in self.sinks:
                sink.eval(int(row.get("policy_version", 0)), values)
            logged += 1
        return logged

    def close(self) -> None:
        self.poll()
        for sink in self.sinks:
            sink.close()
