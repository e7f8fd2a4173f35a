"""The generator's Prometheus metrics (one registry per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.generator.episode import END_REASONS

SWAP_REFUSALS = ("invalid", "staging", "unreachable")
"""Why a weight version was refused (``swapper.Swapper.update``): exported at 0 from the start."""
PAUSE_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)
"""Seconds: a swap's pause and the load inside it."""
PULL_KINDS = ("delta", "full", "fallback")
"""How a version was pulled (``weights.GrpcWeightSource``): rebuilt from a delta, whole (no base held, or
the source no longer holds it), or whole after a refused delta. Exported at 0 from the start."""


class GeneratorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("asymptote_generator_tokens", "Completion tokens generated", ["kind"], registry=r)
        self.groups = Counter("asymptote_generator_groups", "Groups published", ["kind"], registry=r)
        self.task_errors = Counter(
            "asymptote_generator_task_errors",
            "Tasks that failed and were handed back (by exception), or were dead-lettered (poison: undecodable; "
            "task_digest: another task's)",
            ["reason"],
            registry=r,
        )
        self.verdicts = Counter(
            "asymptote_generator_verdicts",
            "Completions scored by a dataset task's verifier, by reason (correct, wrong, no_answer, timeout, ...)",
            ["reason"],
            registry=r,
        )
        self.completions = Counter(
            "asymptote_generator_completions", "Completions generated, before any filter", ["kind"], registry=r
        )
        self.completions_interrupted = Counter(
            "asymptote_generator_completions_interrupted",
            "Completions that reached their thinking budget and got the interruption phrase",
            ["kind"],
            registry=r,
        )
        self.completions_truncated = Counter(
            "asymptote_generator_completions_truncated",
            "Completions cut by the length cap (the answer budget or max_tokens)",
            ["kind"],
            registry=r,
        )
        self.inflight_groups = Gauge("asymptote_generator_inflight_groups", "Groups being generated", registry=r)
        self.policy_version = Gauge("asymptote_generator_policy_version", "Loaded policy version", registry=r)
        self.swaps = Counter("asymptote_generator_swaps", "Weight versions loaded", registry=r)
        self.adapter_versions = Counter(
            "asymptote_generator_adapter_versions",
            "LoRA adapter versions loaded over the base (a LoRA run: every version loaded; else 0)",
            registry=r,
        )
        self.swap_held_s = Counter(
            "asymptote_generator_swap_held_seconds",
            "Time a newer weight version waited while an eval round was sampled at the current one",
            registry=r,
        )
        self.swaps_refused = Counter(
            "asymptote_generator_swaps_refused", "Weight versions refused", ["reason"], registry=r
        )
        # Known labels start at 0, so rates and alerts see the first refusal or poison task.
        for reason in SWAP_REFUSALS:
            self.swaps_refused.labels(reason)
        self.task_errors.labels("poison")
        self.task_errors.labels("task_digest")
        self.task_errors.labels("no_sequence")
        self.task_errors.labels("routing")
        self.swap_pause_s = Histogram(
            "asymptote_generator_swap_pause_seconds",
            "Generation stalled per swap (scheduler paused to resumed)",
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        self.swap_load_s = Histogram(
            "asymptote_generator_swap_load_seconds",
            "Of a swap's pause, the load into the model in the engine's workers",
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        self.swap_pull_s = Histogram(
            "asymptote_generator_swap_pull_seconds",
            "Time to pull and verify a version",
            buckets=(0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.swap_last_pause_s = Gauge(
            "asymptote_generator_swap_last_pause_seconds", "Generation stalled by the latest swap", registry=r
        )
        self.swap_bytes = Counter("asymptote_generator_swap_bytes", "Weight bytes pulled", registry=r)
        self.weight_pulls = Counter(
            "asymptote_generator_weight_pulls",
            "Weight versions pulled, by kind (delta, full, fallback)",
            ["kind"],
            registry=r,
        )
        self.weight_pull_bytes = Counter(
            "asymptote_generator_weight_pull_bytes", "Bytes received pulling weights, by kind", ["kind"], registry=r
        )
        for kind in PULL_KINDS:
            self.weight_pulls.labels(kind)
            self.weight_pull_bytes.labels(kind)
        self.weight_peer_failures = Counter(
            "asymptote_generator_weight_peer_failures",
            "Pulls from a peer in the fan-out tree that failed (dead, slow or bad bytes) and moved up the tree",
            registry=r,
        )
        self.weight_relay_bytes = Counter(
            "asymptote_generator_weight_relay_bytes",
            "Weight bytes sent to peers, by kind (delta, full)",
            ["kind"],
            registry=r,
        )
        self.episodes = Counter(
            "asymptote_generator_episodes",
            "Multi-turn episodes played, by kind and end reason (done, max_turns, max_tokens, env_*: the "
            "environment failed)",
            ["kind", "reason"],
            registry=r,
        )
        for reason in END_REASONS:
            self.episodes.labels("train", reason)
        self.episode_turns = Histogram(
            "asymptote_generator_episode_turns",
            "Model turns per multi-turn episode",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.tool_calls = Counter(
            "asymptote_generator_tool_calls", "Tool calls made by the model in multi-turn episodes", registry=r
        )
        self.tool_errors = Counter(
            "asymptote_generator_tool_errors",
            "Tool calls that failed: malformed, or reported failed by the environment",
            registry=r,
        )
        self.env_s = Counter(
            "asymptote_generator_environment_seconds",
            "Time multi-turn episodes waited for their environment (reset and steps)",
            registry=r,
        )
        self.env_tokens = Counter(
            "asymptote_generator_environment_tokens",
            "Environment tokens inserted into multi-turn sequences (out of the loss)",
            registry=r,
        )
        self.swap_carried = Counter(
            "asymptote_generator_swap_carried_sequences", "Sequences in flight across a swap", registry=r
        )
