"""Every JetStream stream, subject, durable consumer and KV bucket of a run, and their declarations.

The one place these are named and configured. Every service calls
:func:`ensure_streams` at start; declarations are idempotent, so start order
does not matter. A ``prefix`` namespaces one run so several runs (or tests)
can share a NATS server. Connecting is in :mod:`asymptote.jetstream.connect`,
the hot publish and fetch paths in :mod:`~asymptote.jetstream.publish` and
:mod:`~asymptote.jetstream.pull`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.kv import KeyValue

DEDUP_WINDOW_S = 600.0
"""JetStream duplicate window: a group re-published within it is dropped."""
ROLLOUT_MAX_BYTES = 8 * 1024 * 1024
"""The rollouts stream's largest message (a group); NATS's max_payload must be at least the run's largest
group too (asymptote.jetstream.preflight checks both at the broker's start)."""


@dataclass(frozen=True)
class Names:
    """Every stream, subject, durable consumer and KV bucket of one run."""

    prefix: str = "asy"
    replicas: int = 1
    """JetStream replicas of every stream and KV bucket declared here (3 on a 3-node cluster)."""

    # Streams
    @property
    def tasks_stream(self) -> str:
        return f"{self.prefix.upper()}_TASKS"

    @property
    def rollouts_stream(self) -> str:
        return f"{self.prefix.upper()}_ROLLOUTS"

    @property
    def evals_stream(self) -> str:
        return f"{self.prefix.upper()}_EVALS"

    @property
    def telemetry_stream(self) -> str:
        return f"{self.prefix.upper()}_TELEMETRY"

    @property
    def deadletter_stream(self) -> str:
        return f"{self.prefix.upper()}_DEADLETTER"

    @property
    def ledger_stream(self) -> str:
        return f"{self.prefix.upper()}_LEDGER"

    # Subjects
    @property
    def train_tasks(self) -> str:
        return f"{self.prefix}.tasks.train"

    @property
    def eval_tasks(self) -> str:
        return f"{self.prefix}.tasks.eval"

    @property
    def all_tasks(self) -> str:
        return f"{self.prefix}.tasks.>"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}.rollouts"

    @property
    def eval_results(self) -> str:
        return f"{self.prefix}.evals.results"

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}.telemetry.compute"

    def deadletter(self, source: str) -> str:
        return f"{self.prefix}.deadletter.{source}"

    def ledger(self, part: str) -> str:
        return f"{self.prefix}.ledger.{part}"

    @property
    def ledger_entries(self) -> str:
        """Where the broker stores its ``LedgerBatch`` messages."""
        return self.ledger("entries")

    # Durable consumers (one per consuming role and subject; generators share theirs)
    @property
    def generators_consumer(self) -> str:
        """Train tasks (``train_tasks``), shared by every generator."""
        return "generators-train"

    @property
    def generators_eval_consumer(self) -> str:
        """Eval tasks (``eval_tasks``), shared by every generator and served before train tasks,
        so an eval round never waits in the queue behind train tasks."""
        return "generators-eval"

    retired_consumers: tuple[str, ...] = ("generators",)
    """Durable consumers of earlier releases on the task stream (one for both kinds of task):
    removed at a generator's start, since their filter overlaps the two above."""

    @property
    def broker_consumer(self) -> str:
        return "broker"

    @property
    def fitter_evals_consumer(self) -> str:
        return "fitter-evals"

    @property
    def fitter_telemetry_consumer(self) -> str:
        return "fitter-telemetry"

    # Key-value buckets
    @property
    def policy_bucket(self) -> str:
        return f"{self.prefix}-policy"

    @property
    def curriculum_bucket(self) -> str:
        return f"{self.prefix}-curriculum"

    @property
    def evals_bucket(self) -> str:
        """The fitter's run-level state the other services read: the best held-out round."""
        return f"{self.prefix}-evals"

    policy_key: str = "current"
    best_round_key: str = "best"


def stream_configs(names: Names) -> list[StreamConfig]:
    """The configuration of every stream of the run under ``names``."""
    dedup = DEDUP_WINDOW_S
    configs = [
        # Work queue: each task is leased by exactly one generator and
        # removed once acked (after its group is stored).
        StreamConfig(
            name=names.tasks_stream,
            subjects=[names.train_tasks, names.eval_tasks],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
        ),
        # Work queue too: a group stays until the learner's checkpoint
        # holds it and the broker acks it.
        StreamConfig(
            name=names.rollouts_stream,
            subjects=[names.rollouts],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
            max_msg_size=ROLLOUT_MAX_BYTES,
        ),
        StreamConfig(
            name=names.evals_stream,
            subjects=[names.eval_results],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
        ),
        StreamConfig(
            name=names.telemetry_stream,
            subjects=[names.telemetry],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=7 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
        # Every issued train task's fate (asymptote.ledger); kept, never consumed away.
        StreamConfig(
            name=names.ledger_stream,
            subjects=[names.ledger("*")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=dedup,
            max_age=30 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=names.deadletter_stream,
            subjects=[names.deadletter("*")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
    ]
    for config in configs:
        config.num_replicas = names.replicas
    return configs


async def ensure_streams(js: JetStreamContext, names: Names) -> None:
    """Declare every stream (idempotent; updates a stream whose config drifted)."""
    for config in stream_configs(names):
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


async def ensure_bucket(js: JetStreamContext, bucket: str, history: int = 1, replicas: int = 1) -> KeyValue:
    """The KV bucket, created (file-backed, keeping ``history`` values a key, on ``replicas``
    servers) if it does not exist."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:  # create it; a racing creator's bucket is as good
        try:
            return await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE, replicas=replicas)
            )
        except BadRequestError:
            return await js.key_value(bucket)
