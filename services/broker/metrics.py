"""The broker's Prometheus metrics (one registry per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BrokerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.groups_received = Counter("asymptote_broker_groups_received", "Rollout groups received", registry=r)
        self.groups_dropped = Counter(
            "asymptote_broker_groups_dropped", "Groups kept out of the loss, by reason", ["reason"], registry=r
        )
        self.completions_received = Counter(
            "asymptote_broker_completions_received",
            "Completions of the train groups received, before any filter, by outcome "
            "(all, interrupted: thinking budget reached, truncated: length cap reached)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("all", "interrupted", "truncated"):  # at 0 from the start, so the shares always exist
            self.completions_received.labels(outcome)
        self.groups_served = Counter("asymptote_broker_groups_served", "Groups handed to the learner", registry=r)
        self.groups_trained = Counter("asymptote_broker_groups_trained", "Groups acked by the learner", registry=r)
        self.tasks_issued = Counter("asymptote_broker_tasks_issued", "Generation tasks issued", ["kind"], registry=r)
        self.deadlettered = Counter("asymptote_broker_deadlettered", "Messages dead-lettered", ["source"], registry=r)
        self.deadlettered.labels("rollouts")  # at 0 from the start, so the first one shows in a rate
        self.ready_groups = Gauge("asymptote_broker_ready_groups", "Groups waiting for the learner", registry=r)
        self.handed_out_groups = Gauge(
            "asymptote_broker_handed_out_groups", "Groups handed out, not yet acked", registry=r
        )
        self.pending_tasks = Gauge(
            "asymptote_broker_pending_tasks", "Train tasks queued or being generated", registry=r
        )
        self.learner_version = Gauge("asymptote_broker_learner_version", "Learner policy version", registry=r)
        self.epoch = Gauge("asymptote_broker_curriculum_epoch", "Curriculum epoch", registry=r)
        self.retired_prompts = Gauge(
            "asymptote_broker_retired_prompts", "Prompts retired by No-Positive-Resampling", registry=r
        )
        self.outstanding_limit = Gauge(
            "asymptote_broker_outstanding_limit",
            "Train tasks queued or generating plus groups waiting that the broker allows (back-pressure)",
            registry=r,
        )
        self.desired_generators = Gauge(
            "asymptote_broker_desired_generators", "Generator replicas the pipeline wants (autoscaling)", registry=r
        )
