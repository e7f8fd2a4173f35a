"""PPO-off-policy-k: one generated batch, k optimizer steps on its mini-batches.

The baseline ScaleRL compares PipelineRL-k with: generators sample a batch
with the current policy, then the learner splits it into k mini-batches and
takes one optimizer step on each, in order; the generators wait for the
weights after the last step (the broker's synchronous mode), so every token
of a batch was sampled by the policy the batch was generated for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from services.learner.routing import MoeLayout
from services.learner.trainer import StepInputs, collate


def split_groups(groups: Sequence[rollout_pb2.RolloutGroup], k: int) -> list[list[rollout_pb2.RolloutGroup]]:
    """``groups`` in k contiguous parts of near-equal size (the first ones get the remainder)."""
    if not 1 <= k <= len(groups):
        raise ValueError(f"cannot split {len(groups)} groups into {k} mini-batches")
    size, extra = divmod(len(groups), k)
    parts, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        parts.append(list(groups[start:end]))
        start = end
    return parts


def collate_mini_batches(
    groups: Sequence[rollout_pb2.RolloutGroup],
    pad_id: int,
    header: services_pb2.BatchHeader | None,
    k: int,
    routing: MoeLayout | None = None,
) -> list[StepInputs]:
    """One StepInputs per mini-batch; each normalises its advantages and aggregates its loss on its own
    (``routing``: as ``collate`` takes it).

    The groups the broker dropped to refill the batch (zero_variance: refill) count as taken by the first.
    """
    refilled = header.num_zero_variance if header is not None else 0
    out = []
    for i, part in enumerate(split_groups(groups, k)):
        inputs = collate(part, pad_id, header, routing)
        out.append(dataclasses.replace(inputs, num_taken=len(part) + (refilled if i == 0 else 0)))
    return out
