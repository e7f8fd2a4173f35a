"""Length shaping of rewards: what a truncated completion earns, and DAPO's overlong penalty.

A completion cut at the length cap (``truncated``: no end of sequence) earns
``truncated_reward`` whatever its verifier says: a policy that writes a
right answer and then runs on to the cap must not score like one that
stopped, or not stopping costs nothing and the truncation rate climbs (the
mark of an unstable run in ScaleRL, arXiv 2510.13786, where failed runs
reached 10-15%). Kimi k1.5 and Magistral give such completions no reward;
DAPO masks them from the loss (overlong filtering), which removes the
signal instead of giving one.

Soft overlong punishment (DAPO, arXiv 2503.14476, eq. 13): a completion of
L tokens, with the length cap L_max and a punishment interval of L_cache
tokens before it, gets ``0`` while L <= L_max - L_cache, ``(L_max - L_cache
- L) / L_cache`` (falling linearly from 0 to -1) while L_max - L_cache < L
<= L_max, and ``-1`` beyond. The penalty is added to the verifier's reward.
"""

from __future__ import annotations

from asymptote.contracts.v1 import rollout_pb2


def overlong_penalty(length: int, max_tokens: int, cache_tokens: int) -> float:
    """The penalty of a completion of ``length`` tokens (``max_tokens`` = L_max, ``cache_tokens`` = L_cache)."""
    start = max_tokens - cache_tokens
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / cache_tokens
    return -1.0


def score_truncated(group: rollout_pb2.RolloutGroup, reward: float) -> bool:
    """Set the reward of each of the group's truncated completions to ``reward``, in place; whether any was."""
    cut = [c for c in group.completions if c.truncated]
    for c in cut:
        c.reward = reward
    return bool(cut)


def shape_overlong(group: rollout_pb2.RolloutGroup, max_tokens: int, cache_tokens: int) -> None:
    """Add each completion's overlong penalty to its reward, in place."""
    for c in group.completions:
        c.reward += overlong_penalty(len(c.token_ids), max_tokens, cache_tokens)
