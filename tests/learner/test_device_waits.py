"""A micro-batch's loss and its IS-ratio statistics never read a tensor's value back to the host.

On a GPU every such read (``float``, ``item``, ``tolist``, ``bool``) waits
for the device; the step reads its statistics once, after the last
micro-batch (``Trainer._scored_stats``). Here every loss of the recipe,
and the merge of micro-batches' statistics, run with those reads made to
raise; the values they give later, when read, are checked against the
plain computation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from services.learner.losses import RatioStats, aggregation_weights, policy_loss

READS = ("__float__", "__int__", "__bool__", "item", "tolist")


@contextlib.contextmanager
def no_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        raise AssertionError("a tensor's value was read back to the host")

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, refuse)
        yield


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 9
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    mask[0] = 0  # a completion with no loss tokens
    return {
        "logp": (-torch.rand(n, t, generator=g) * 3).requires_grad_(),
        "logp_gen": -torch.rand(n, t, generator=g) * 3,
        "advantages": torch.randn(n, generator=g),
        "mask": mask,
        "prompt_index": torch.tensor([0, 0, 1, 1, 2, 2]),
    }


@pytest.mark.parametrize(("name", "aggregation"), [("cispo", "prompt"), ("grpo", "sample"), ("dapo", "token"),
                                                   ("gspo", "sample")])  # fmt: skip
def test_losses_and_their_statistics_wait_for_nothing(
    monkeypatch: pytest.MonkeyPatch, name: str, aggregation: str
) -> None:
    parts = [batch(s) for s in (1, 2, 3)]
    # The aggregation's weights come from the whole batch, once a step, before its micro-batches (as the
    # trainer computes them): each micro-batch's loss is given its rows' share.
    weights = [
        aggregation_weights(mask=b["mask"], prompt_index=b["prompt_index"], aggregation=aggregation) for b in parts
    ]  # type: ignore[arg-type]
    with no_reads(monkeypatch):
        scored = [
            policy_loss(name=name, aggregation=aggregation, weights=w, **b)  # type: ignore[arg-type]
            for b, w in zip(parts, weights)
        ]
        merged = RatioStats.merge([stats for _, stats in scored])
        total = torch.stack([loss for loss, _ in scored]).sum()
        total.backward()
    # Read afterwards: the merged statistics are those of all the parts' loss tokens together.
    each = [stats for _, stats in scored]
    tokens = sum(float(s.tokens) for s in each)
    assert tokens == sum(float(b["mask"].sum()) for b in parts) > 0
    assert merged["is/capped_frac"] == pytest.approx(sum(s["is/capped_frac"] * float(s.tokens) for s in each) / tokens)
    assert merged["is/rho_max"] == max(s["is/rho_max"] for s in each)
    assert merged["is/rho_min"] == min(s["is/rho_min"] for s in each)
    assert math.isfinite(float(total)) and all(b["logp"].grad is not None for b in parts)


def test_statistics_of_no_loss_tokens_read_as_the_neutral_values() -> None:
    b = batch(4)
    b["mask"] = torch.zeros_like(b["mask"])
    _, stats = policy_loss(name="cispo", aggregation="prompt", **b)  # type: ignore[arg-type]
    assert dict(stats) == {"is/capped_frac": 0.0, "is/rho_max": 1.0, "is/rho_min": 1.0}
    assert float(stats.rho_max) == -math.inf and float(stats.rho_min) == math.inf  # merge-neutral
