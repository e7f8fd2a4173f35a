"""The learner's Prometheus metrics: one gauge per step metric."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("asymptote_learner_steps", "Optimizer steps", registry=r)
        self.samples = Counter("asymptote_learner_samples_trained", "Completions trained on", registry=r)
        self.policy_version = Gauge("asymptote_learner_policy_version", "Current policy version", registry=r)
        self.wait_s = Counter("asymptote_learner_wait_seconds", "Time spent waiting for data", registry=r)
        self.bad_batches = Counter(
            "asymptote_learner_bad_batches",
            "Batches refused as malformed (their groups are delivered again)",
            registry=r,
        )
        self.compute_s = Counter("asymptote_learner_compute_seconds", "Time spent computing steps", registry=r)
        self.checkpoint_stall_s = Counter(
            "asymptote_learner_checkpoint_stall_seconds",
            "Time the training loop spent starting checkpoints (staging the state; the writes go on behind it)",
            registry=r,
        )
        self.serve_stall_s = Counter(
            "asymptote_learner_serve_stall_seconds",
            "Time the training loop spent serving versions: copying the weights out in the served dtypes, and "
            "waiting for the previous version's digest (the digest and announcement go on behind it)",
            registry=r,
        )
        self.publish_s = Counter(
            "asymptote_learner_publish_seconds",
            "Time spent digesting served versions, beside the next step",
            registry=r,
        )
        self.staleness = Gauge(
            "asymptote_learner_staleness_tokens",
            "Tokens of the last batch by staleness (learner version minus token version)",
            ["versions_behind"],
            registry=r,
        )
        self._step_gauges: dict[str, Gauge] = {}

    def record_step(self, metrics: dict[str, float]) -> None:
        self.staleness.clear()
        for key, value in metrics.items():
            if "/" not in key and key != "loss":
                continue  # step, version and counters have their own series
            if key.startswith("staleness/hist/"):
                self.staleness.labels(key.rsplit("/", 1)[1]).set(value)
                continue
            name = "asymptote_learner_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            gauge = self._step_gauges.get(name)
            if gauge is None:
                gauge = self._step_gauges[name] = Gauge(name, f"Learner step metric {key}", registry=self.registry)
            gauge.set(value)
