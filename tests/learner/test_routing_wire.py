"""A mixture of experts' routing on the wire, from a rollout group into the learner's batch.

Routing travels compact (asymptote.routing): ids in the smallest dtype, the
MoE layers' columns only, the prompt's rows once per group and each
completion's own rows. The groups here carry the tiny Qwen3-MoE's own
routing of their tokens; collate lays it out where pack puts the tokens,
so replaying it leaves the learner's own top-k everywhere (no decision
differs). Routing that does not fit its tokens, names an expert past the
layout's, is of another model's layout, or is missing while replay is on,
is refused in one line naming the group; the size bound the broker checks
NATS against counts the routing.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from asymptote import routing as wire
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, PayloadError
from asymptote.jetstream.preflight import MessageSize, check_max_payload
from asymptote.messages import GROUP_BYTES_PER_TOKEN, GROUP_OVERHEAD_BYTES, decode_group, max_group_bytes
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import PolicyForward
from services.learner.routing import MoeLayout, RouterReplay, RouterReport
from services.learner.trainer import Trainer, collate
from services.local.stack import routing_bytes_per_token
from tests.helpers.badinput import BAD_INPUTS

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import batch

LAYOUT = wire.layout(num_moe_layers=2, top_k=2, num_experts=8)
"""The tiny Qwen3-MoE's: 3 layers, the first dense, top-2 of 8 experts."""


def own_rows(model: PreTrainedModel, groups: list[rollout_pb2.RolloutGroup]) -> torch.Tensor:
    """[N, L + T, MoE layers, k] the experts the model picks for each row's tokens (nothing replayed)."""
    model = copy.deepcopy(model)
    report = RouterReport(keep_own=True)
    inputs = collate(groups, pad_id=0)
    with torch.no_grad():
        PolicyForward(model, replay=RouterReplay.install(model))(inputs.batch, inputs.temperature, report)
    assert report.own is not None
    return report.own


def with_routing(model: PreTrainedModel, groups: list[rollout_pb2.RolloutGroup]) -> list[rollout_pb2.RolloutGroup]:
    """The groups with their tokens' own routing, as a generator sends it: the prompt's rows once (from the
    group's first row), each completion's rows for all its tokens but the last."""
    own = own_rows(model, groups).numpy()
    width = own.shape[1]
    out, row = [], 0
    for g in groups:
        g = copy.deepcopy(g)
        prompt_len = width - max(len(c.token_ids) for gg in groups for c in gg.completions)
        start = prompt_len - len(g.prompt_token_ids)
        g.routing.CopyFrom(LAYOUT)
        g.prompt_routing = wire.encode_rows(own[row, start:prompt_len], LAYOUT)
        for c in g.completions:
            c.routing = wire.encode_rows(own[row, prompt_len : prompt_len + len(c.token_ids) - 1], LAYOUT)
            row += 1
        out.append(g)
    return out


def test_routing_travels_compact_and_collate_lays_it_out_where_the_tokens_are(moe_loaded: PreTrainedModel) -> None:
    plain = batch(random.Random(3), 0, 5)
    groups = with_routing(moe_loaded, plain)
    for g, p in zip(groups, plain, strict=True):
        # The prompt's rows once, each completion's own: 4 bytes a token (2 MoE layers x top-2, uint8).
        rows = len(g.prompt_token_ids) + sum(len(c.token_ids) - 1 for c in g.completions)
        extra = len(g.SerializeToString()) - len(p.SerializeToString())
        assert rows * 4 <= extra <= rows * 4 + 8 + 3 * len(g.completions) + 4
        assert decode_group(g.SerializeToString()) == g
    layout = MoeLayout((1, 2), num_experts=8, top_k=2)
    inputs = collate(groups, pad_id=0, routing=layout)
    b = inputs.batch
    assert b.routing is not None and b.routed is not None and b.routing.dtype == torch.uint8
    own = own_rows(moe_loaded, plain)
    # Recorded exactly where the tokens are: the real prompt and completion tokens, all but each row's last.
    last = b.attention_mask.shape[1] - 1 - b.attention_mask.flip(1).argmax(1)
    expected = b.attention_mask.bool().clone()
    expected[torch.arange(len(last)), last] = False
    assert torch.equal(b.routed, expected)
    assert torch.equal(b.routing[b.routed], own[b.routed].to(torch.uint8))
    assert not b.routing[~b.routed].any()
    # Replayed, it is the learner's own routing: no decision differs.
    trainer = Trainer(copy.deepcopy(moe_loaded), LossSettings(), OptimizerSettings(), packing=False)
    metrics = trainer.step(trainer.check_routing(inputs), learner_version=0)
    assert metrics["moe/routing_differs_frac"] == 0.0
    # Another group's routing does differ (the metric counts what replay changes).
    swapped = [copy.deepcopy(g) for g in groups]
    for g in swapped:
        for c in g.completions:
            ids = np.frombuffer(c.routing, np.uint8).reshape(-1, 2, 2)
            c.routing = wire.encode_rows((ids + 1) % 8, LAYOUT)
    moved = Trainer(copy.deepcopy(moe_loaded), LossSettings(), OptimizerSettings(), packing=False)
    assert moved.step(collate(swapped, pad_id=0, routing=layout), learner_version=0)["moe/routing_differs_frac"] > 0.3
    # Replay off: the routing the groups carry is left out.
    assert collate(groups, pad_id=0).batch.routing is None


def test_ids_take_the_smallest_dtype() -> None:
    assert wire.routing_dtype(8) == wire.routing_dtype(256) == rollout_pb2.ROUTING_DTYPE_UINT8
    assert wire.routing_dtype(257) == wire.routing_dtype(65536) == rollout_pb2.ROUTING_DTYPE_UINT16
    with pytest.raises(ValueError, match="65537 experts: more than 65536 do not fit any routing dtype"):
        wire.routing_dtype(65537)
    assert wire.bytes_per_token(LAYOUT) == 4
    assert wire.bytes_per_token(wire.layout(48, 8, 128)) == 384  # Qwen3-30B-A3B
    assert wire.bytes_per_token(wire.layout(4, 2, 300)) == 16
    rows = np.array([[[299, 0]]] * 3)
    assert np.array_equal(np.frombuffer(wire.encode_rows(rows, wire.layout(1, 2, 300)), "<u2"), rows.reshape(-1))


def refused(group: rollout_pb2.RolloutGroup, what: str, match: str) -> None:
    with BAD_INPUTS.trying("rollout group routing", what), pytest.raises(PayloadError, match=match) as caught:
        decode_group(group.SerializeToString())
    assert "\n" not in str(caught.value)


def test_routing_that_does_not_fit_its_tokens_is_refused_naming_the_group(moe_loaded: PreTrainedModel) -> None:
    (good,) = with_routing(moe_loaded, batch(random.Random(4), 0, 1))
    gid = good.group_id
    longest = max(range(len(good.completions)), key=lambda i: len(good.completions[i].token_ids))

    def bad(**change: object) -> rollout_pb2.RolloutGroup:
        g = copy.deepcopy(good)
        for field, value in change.items():
            if field == "completion":
                g.completions[longest].routing = value  # type: ignore[assignment]
            elif field == "dtype":
                g.routing.dtype = value  # type: ignore[assignment]
            else:
                setattr(g, field, value)
        return g

    c = good.completions[longest].routing
    refused(bad(completion=c[:-4]), "one row short", rf"group {gid} completion {longest}: \d+ routing bytes, not")
    refused(bad(completion=c + b"\0"), "a partial row", rf"group {gid} completion {longest}: .*\(4 bytes a token\)")
    refused(bad(prompt_routing=good.prompt_routing[4:]), "prompt rows short", rf"group {gid} prompt: ")
    refused(bad(completion=b"\x08" + c[1:]), "expert 8 of 8", rf"group {gid} completion {longest}: .*expert 8 of 8")
    refused(bad(dtype=7), "unknown dtype", rf"group {gid}: unknown routing dtype 7 \(accepted: uint8, uint16\)")
    stripped = copy.deepcopy(good)
    stripped.ClearField("routing")
    refused(stripped, "rows without a layout", rf"group {gid}: routing rows without a routing layout")
    narrow = copy.deepcopy(good)
    narrow.routing.num_experts = 300
    refused(narrow, "uint8 for 300 experts", rf"group {gid}: routing in uint8 cannot name 300 experts")


def test_routing_of_another_model_or_none_is_refused_by_collate_naming_the_group(moe_loaded: PreTrainedModel) -> None:
    groups = with_routing(moe_loaded, batch(random.Random(5), 0, 3))
    layout = MoeLayout((1, 2), num_experts=8, top_k=2)
    other = MoeLayout((1, 2, 3), num_experts=8, top_k=2)
    with BAD_INPUTS.trying("learner batch", "routing of another layout"), pytest.raises(PayloadError) as caught:
        collate(groups, pad_id=0, routing=other)
    assert str(caught.value) == (
        f"group {groups[0].group_id}: routing of 2 MoE layers x top-2 of 8 experts, the model has 3 x top-2 of 8"
    )
    missing = [*groups[:2], batch(random.Random(5), 0, 3)[2]]
    with BAD_INPUTS.trying("learner batch", "a group without routing"), pytest.raises(PayloadError) as caught:
        collate(missing, pad_id=0, routing=layout)
    assert str(caught.value).startswith(f"group {missing[2].group_id} carries no routing, but the model is a mixture")


def test_the_size_bound_counts_routing_and_a_group_too_large_is_refused_by_name(moe_dir: Path) -> None:
    # The stack tells the broker the model's routing bytes: 2 MoE layers x top-2 x uint8.
    assert routing_bytes_per_token(moe_dir) == 4
    assert wire.model_layout(json.loads((moe_dir / "config.json").read_text())) == LAYOUT
    assert wire.model_layout({"num_hidden_layers": 2, "intermediate_size": 64}) is None  # dense
    # A worst-case group with routing serializes within the bound, and to most of it.
    rng = random.Random(6)
    group_size, max_tokens, prompt_len = 4, 2000, 300
    g = rollout_pb2.RolloutGroup(
        group_id="g", prompt_token_ids=[rng.randrange(2**20, 2**21) for _ in range(prompt_len)]
    )
    g.routing.CopyFrom(LAYOUT)
    g.prompt_routing = bytes(4 * prompt_len)
    for _ in range(group_size):
        g.completions.add(
            token_ids=[rng.randrange(2**20, 2**21) for _ in range(max_tokens)],
            logprobs=[-1.0] * max_tokens,
            loss_mask=[1] * max_tokens,
            text="x" * 8 * max_tokens,
            routing=bytes(4 * max_tokens),
        )
    bound = max_group_bytes(group_size, max_tokens, prompt_len, routing_bytes_per_token=4)
    assert 0.99 * (bound - GROUP_OVERHEAD_BYTES) < g.ByteSize() <= bound  # the overhead is a fixed 64 KiB
    # Qwen3-30B-A3B (48 MoE layers x top-8, uint8): 384 routing bytes a token beside the other 16, so a group
    # of 16 x 4096 tokens is over the rollouts stream's 8 MiB, and the broker refuses to start in one line.
    per_token = wire.bytes_per_token(wire.layout(48, 8, 128))
    assert per_token / GROUP_BYTES_PER_TOKEN == 24
    need = MessageSize(max_group_bytes(16, 4096, 1000, per_token), "a rollout group of 16 x 4096 tokens", "s")
    with pytest.raises(ConfigError, match=r"over the rollouts stream's 8.00 MiB message limit"):
        check_max_payload(64 * 1024 * 1024, need, "nats://x:4222")
    assert max_group_bytes(16, 1024, 1000, per_token) < 8 * 1024 * 1024  # 16 x 1024 fits
