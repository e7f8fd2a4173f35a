"""DAPO's overlong reward shaping: a length penalty instead of interruptions.

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


def shape_overlong(group: rollout_pb2.RolloutGroup, max_tokens: int, cache_tokens: int) -> None:
    """Add each completion's overlong penalty to its reward, in place."""
    for c in group.completions:
        c.reward += overlong_penalty(len(c.token_ids), max_tokens, cache_tokens)
