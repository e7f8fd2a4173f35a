"""Decoding and validating the payloads that travel over NATS.

Owns what each message must hold to be taken: one function per message type
turns a payload into its protobuf or raises :class:`PayloadError` naming the
first thing wrong (undecodable bytes name the expected type). Every consumer
decodes through here, so a producer and its consumers agree on one
contract; what a consumer does with a refused message (dead-letter it, see
:mod:`asymptote.jetstream.deadletter`, or ignore it) stays with the
consumer. Pure functions: no I/O, no NATS.
"""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np
from google.protobuf.message import Message

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.routing import check_rows

M = TypeVar("M", bound=Message)

MAX_NUM_SAMPLES = 1024
"""Completions a task may ask for."""
MAX_TOKENS = 1_000_000
"""Tokens a task may ask a completion to run to."""
TELEMETRY_SERVICES = ("generator", "learner")
"""The services that report compute telemetry."""

# A rollout group's bytes on the wire, per completion token (rollout.proto's Completion), at most:
TOKEN_ID_BYTES = 3
"""token_ids, packed varints: 3 bytes hold any id below 2**21, more than any vocabulary in use."""
LOGPROB_BYTES = 4
"""logprobs, packed float32."""
LOSS_MASK_BYTES = 1
"""loss_mask, packed varints of 0 or 1 (sent under interruption length control)."""
TEXT_BYTES_PER_TOKEN = 8
"""text, the completion in UTF-8: 3-5 bytes a token on average in English, math and code; twice that
leaves room for long whitespace and non-Latin tokens."""
GROUP_BYTES_PER_TOKEN = TOKEN_ID_BYTES + LOGPROB_BYTES + LOSS_MASK_BYTES + TEXT_BYTES_PER_TOKEN
"""16 bytes a completion token."""
COMPLETION_OVERHEAD_BYTES = 256
"""A completion's own fields beside its tokens: reward, flags, finish reason, a few version spans."""
GROUP_OVERHEAD_BYTES = 64 * 1024
"""A group's fields beside its completions and prompt (ids, timings, the task's reference), the chat
template around the prompt, and the message's headers."""


def max_group_bytes(group_size: int, max_tokens: int, prompt_bytes: int, routing_bytes_per_token: int = 0) -> int:
    """The most bytes a serialized ``RolloutGroup`` of ``group_size`` completions of at most ``max_tokens``
    tokens can take, for a prompt of ``prompt_bytes`` UTF-8 bytes (its text in the task, and at most one
    token id of TOKEN_ID_BYTES per byte in prompt_token_ids).

    ``routing_bytes_per_token``: an MoE model's routing (``asymptote.routing.bytes_per_token``; 0 without):
    a row per completion token, and the prompt's rows once for the group."""
    per_completion = max_tokens * (GROUP_BYTES_PER_TOKEN + routing_bytes_per_token) + COMPLETION_OVERHEAD_BYTES
    per_prompt_byte = 1 + TOKEN_ID_BYTES + routing_bytes_per_token
    return group_size * per_completion + prompt_bytes * per_prompt_byte + GROUP_OVERHEAD_BYTES


def decode(message_type: type[M], data: bytes) -> M:
    """Decode one protobuf message; PayloadError names the type on failure."""
    try:
        return message_type.FromString(data)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise PayloadError(f"undecodable {message_type.DESCRIPTOR.name}: {exc}") from exc


def decode_task(data: bytes) -> rollout_pb2.GenerationTask:
    """A generation task with an id, a prompt, a known kind and sampling in range."""
    task = decode(rollout_pb2.GenerationTask, data)
    if not task.task_id or not task.prompt:
        raise PayloadError("task has no task_id or prompt")
    if task.kind not in (rollout_pb2.TASK_KIND_TRAIN, rollout_pb2.TASK_KIND_EVAL):
        raise PayloadError(f"task {task.task_id}: unknown kind {task.kind}")
    s = task.sampling
    if not 1 <= s.num_samples <= MAX_NUM_SAMPLES or not 1 <= s.max_tokens <= MAX_TOKENS or not s.temperature > 0:
        raise PayloadError(
            f"task {task.task_id}: sampling out of range (num_samples {s.num_samples}, "
            f"max_tokens {s.max_tokens}, temperature {s.temperature})"
        )
    return task


def decode_group(data: bytes) -> rollout_pb2.RolloutGroup:
    """A rollout group that passes :func:`validate_group`."""
    group = decode(rollout_pb2.RolloutGroup, data)
    validate_group(group, data)
    return group


def validate_group(group: rollout_pb2.RolloutGroup, data: bytes | None = None) -> None:
    """Raise PayloadError naming what is wrong with a group (its shape first, then its log-prob values).

    A group has an id and completions; each completion has a prompt (its
    own ``prompt_token_ids``, else the group's), tokens, one finite
    log-probability <= 0 per token, a loss mask (if any), version spans (if
    any) that cover its tokens in the loss exactly (an injected token, out
    of the loss, may be uncovered), and a finite reward. A completion that
    continues the episode of the one before it (``continues_episode``) has
    that one's reward, and the first completion continues none. Routing,
    when the group carries it, has one row per token of its layout
    (``asymptote.routing.check_rows``).

    ``data``: the bytes ``group`` was parsed from, if at hand. Its
    log-probs are then checked all at once on the wire (see
    :func:`logprobs_in_range`); one completion at a time otherwise, or
    when that check fails, to name the completion.
    """
    group_id = group.group_id
    if not group_id:
        raise PayloadError("rollout group has no group_id")
    completions = group.completions
    if not completions:
        raise PayloadError(f"group {group_id}: no completions")
    has_prompt = bool(group.prompt_token_ids)
    # Every field access on a protobuf message costs a wrapper: each is read once.
    num_logprobs = 0
    previous_reward = math.nan
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if n == 0:
            raise PayloadError(f"group {group_id} completion {i}: no tokens")
        if not has_prompt and not c.prompt_token_ids:
            raise PayloadError(f"group {group_id} completion {i}: no prompt tokens (neither its own nor the group's)")
        reward = c.reward
        if c.continues_episode and not reward == previous_reward:
            raise PayloadError(
                f"group {group_id} completion {i}: continues an episode, but "
                + ("it is the first completion" if i == 0 else f"its reward {reward} is not the episode's")
            )
        previous_reward = reward
        num = len(c.logprobs)
        if num != n:
            raise PayloadError(f"group {group_id} completion {i}: {num} logprobs for {n} tokens")
        num_logprobs += n
        num_mask = len(c.loss_mask)
        if num_mask and num_mask != n:
            raise PayloadError(f"group {group_id} completion {i}: loss_mask length {num_mask} != {n}")
        if not math.isfinite(reward):
            raise PayloadError(f"group {group_id} completion {i}: reward is not finite")
        spans = c.version_spans
        if spans:
            if len(spans) == 1 and not num_mask:
                # The common case, one version for every token: it tiles them iff it is [0, n).
                span = spans[0]
                if span.start == 0 and span.end == n:
                    continue
            _check_spans(c, n, f"group {group_id} completion {i}")
    check_rows(group)
    if data is not None and logprobs_in_range(group, data, num_logprobs):
        return
    for i, c in enumerate(completions):
        # One conversion to a list: min, max and sum then run in C (over the
        # protobuf container each element would be fetched through Python).
        logprobs = list(c.logprobs)
        # A NaN anywhere makes the sum NaN (and min/max unreliable), so the sum is checked first.
        total = sum(logprobs)
        if math.isnan(total) or not (-math.inf < min(logprobs) and max(logprobs) <= 0.0):
            raise PayloadError(f"group {group_id} completion {i}: logprobs must be finite and <= 0")


def logprobs_in_range(group: rollout_pb2.RolloutGroup, data: bytes, num_logprobs: int | None = None) -> bool:
    """Whether every log-prob of ``group`` (parsed from ``data``) is finite and <= 0, read in one numpy pass.

    ``data`` is parsed again as :class:`RolloutGroupLogprobRuns`, which
    holds every packed run of log-probs in the group as its little-endian
    float32 bytes. False when any is out of range, and also when the bytes
    do not account for every log-prob ``group`` holds (``num_logprobs``,
    counted here if not given; a writer may legally send a repeated float
    unpacked, which the view does not see): the caller then checks them
    one completion at a time.
    """
    if num_logprobs is None:
        num_logprobs = sum(len(c.logprobs) for c in group.completions)
    raw = b"".join(rollout_pb2.RolloutGroupLogprobRuns.FromString(data).completions.logprobs)
    if len(raw) != 4 * num_logprobs or not raw:
        return False
    values = np.frombuffer(raw, dtype="<f4")
    # min and max carry a NaN through; every comparison with it is false.
    return bool(-np.inf < values.min() and values.max() <= 0.0)


def _check_spans(c: rollout_pb2.Completion, n: int, where: str) -> None:
    """Spans in order, non-empty, within the tokens, leaving uncovered only tokens out of the loss.

    A generator leaves the tokens it injected (the interruption phrase) out
    of both: no policy sampled them.
    """
    mask = list(c.loss_mask)

    def in_loss(start: int, end: int) -> bool:
        return any(mask[start:end]) if mask else end > start

    covered = 0
    for span in c.version_spans:
        if span.start < covered or span.end <= span.start:
            raise PayloadError(f"{where}: version spans must tile the tokens (in order, non-empty, no overlap)")
        if in_loss(covered, min(span.start, n)):
            raise PayloadError(
                f"{where}: version spans must tile the tokens in the loss: [{covered}, {span.start}) is uncovered"
            )
        covered = span.end
    if covered > n or in_loss(covered, n):
        raise PayloadError(f"{where}: version spans cover {covered} of {n} tokens")


def decode_eval_result(data: bytes) -> rollout_pb2.EvalResult:
    """An eval result with its round, task and samples, no more correct than sampled."""
    result = decode(rollout_pb2.EvalResult, data)
    if not result.eval_id or not result.task_id or result.num_samples == 0:
        raise PayloadError("eval result lacks eval_id, task_id or samples")
    if result.num_correct > result.num_samples or result.eval_num_prompts == 0:
        raise PayloadError(
            f"eval result {result.task_id}: {result.num_correct} correct of {result.num_samples} "
            f"samples, {result.eval_num_prompts} prompts in the round"
        )
    return result


def decode_telemetry(data: bytes) -> rollout_pb2.ComputeTelemetry:
    """A compute telemetry sample from a known service and instance, its counters finite and >= 0."""
    t = decode(rollout_pb2.ComputeTelemetry, data)
    if not t.service or not t.instance_id:
        raise PayloadError("compute telemetry lacks service or instance_id")
    if t.service not in TELEMETRY_SERVICES:
        raise PayloadError(f"compute telemetry from unknown service {t.service!r}; accepted: {TELEMETRY_SERVICES}")
    for name in (
        "device_seconds_total",
        "busy_seconds_total",
        "eval_device_seconds_total",
        "unix_s",
        "flops_total",
        "eval_flops_total",
    ):
        value = getattr(t, name)
        if not math.isfinite(value) or value < 0:
            raise PayloadError(f"compute telemetry {name} is {value}")
    if t.eval_device_seconds_total > t.device_seconds_total:
        raise PayloadError(
            f"compute telemetry eval_device_seconds_total {t.eval_device_seconds_total} exceeds "
            f"device_seconds_total {t.device_seconds_total}"
        )
    if t.eval_flops_total > t.flops_total:
        raise PayloadError(
            f"compute telemetry eval_flops_total {t.eval_flops_total:g} exceeds flops_total {t.flops_total:g}"
        )
    return t


def decode_policy(data: bytes) -> rollout_pb2.PolicyVersion:
    """A policy version announcement that says where its weights are and their digest."""
    policy = decode(rollout_pb2.PolicyVersion, data)
    if not policy.weights_endpoint or not policy.digest:
        raise PayloadError(f"policy version {policy.version} lacks weights_endpoint or digest")
    return policy


def decode_best_round(data: bytes) -> rollout_pb2.BestRound:
    """The fitter's best held-out round: a pass rate in [0, 1] of at least one round."""
    best = decode(rollout_pb2.BestRound, data)
    if not 0.0 <= best.pass_rate <= 1.0 or best.num_rounds < 1:
        raise PayloadError(
            f"best round of version {best.policy_version}: pass rate {best.pass_rate} of "
            f"{best.num_rounds} rounds; accepted: a pass rate in [0, 1] of at least one round"
        )
    return best


def decode_ledger_batch(data: bytes) -> rollout_pb2.LedgerBatch:
    """A batch of ledger entries (written by this project's services only, so decoded without further checks)."""
    return decode(rollout_pb2.LedgerBatch, data)
