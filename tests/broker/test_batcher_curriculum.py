"""Batcher admission/batching and the curriculum, in plain asyncio (no NATS).

The batcher only needs messages with ack/nak/in_progress (``Ackable``), so
a recording fake stands in for JetStream messages here; the real thing is
exercised in tests/integration.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.messages import decode_group, validate_group
from asymptote.tasks import ArithmeticSettings, Problem
from services.broker.batcher import Batcher, is_zero_variance, pass_rate
from services.broker.config import BrokerConfig, ZeroVariance
from services.broker.curriculum import Curriculum

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


@dataclass
class FakeMsg:
    """Records what the batcher did with a message."""

    name: str
    calls: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.calls.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.calls.append("nak")

    async def in_progress(self) -> None:
        self.calls.append("in_progress")

    @property
    def acked(self) -> bool:
        return "ack" in self.calls


def make_group(
    group_id: str, rewards: Sequence[float], min_version: int = 0, num_tokens: int = 3
) -> rollout_pb2.RolloutGroup:
    completions = [
        rollout_pb2.Completion(
            token_ids=list(range(3, 3 + num_tokens)),
            logprobs=[-0.5] * num_tokens,
            version_spans=[rollout_pb2.VersionSpan(version=min_version, start=0, end=num_tokens)],
            reward=r,
        )
        for r in rewards
    ]
    return rollout_pb2.RolloutGroup(
        group_id=group_id,
        prompt_token_ids=[1, 5, 6],
        completions=completions,
        min_version=min_version,
        max_version=min_version,
    )


async def admit(
    batcher: Batcher, group_id: str, rewards: Sequence[float] = (0.0, 1.0), min_version: int = 0
) -> tuple[FakeMsg, str | None]:
    msg = FakeMsg(group_id)
    reason = await batcher.admit(make_group(group_id, rewards, min_version), msg)
    return msg, reason


def ids(items: Sequence[object]) -> list[str]:
    return [h.group.group_id for h in items]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------


@pytest.mark.parametrize("rewards", [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (-1.0, -1.0, -1.0), (0.5, 0.5, 0.5)])
async def test_zero_variance_groups_are_acked_and_counted(rewards: tuple[float, ...]) -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8, zero_variance="refill")
    msg, reason = await admit(batcher, "zv", rewards)
    assert reason == "zero_variance"
    assert msg.calls == ["ack"]  # accounted for: never redelivered
    assert batcher.dropped == Counter(zero_variance=1)
    assert not batcher.ready and batcher.num_received == 1
    assert batcher.take_counters() == Counter(zero_variance=1)
    assert batcher.take_counters() == Counter()  # reset after each take


async def test_interrupted_and_truncated_completions_are_counted_before_any_filter() -> None:
    batcher = Batcher(batch_prompts=1, max_staleness_versions=2, zero_variance="refill")  # both filters drop
    await batcher.set_learner_version(10)
    flags = {  # group id: (rewards, interrupted, truncated) of its completions
        "kept": ((0.0, 1.0, 1.0), (True, False, True), (True, False, False)),
        "flat": ((0.0, 0.0), (True, True), (True, True)),  # all truncated: dropped as zero variance
        "stale": ((0.0, 1.0), (False, False), (False, True)),
    }
    for gid, (rewards, interrupted, truncated) in flags.items():
        g = make_group(gid, rewards, min_version=5 if gid == "stale" else 10)
        for c, i, t in zip(g.completions, interrupted, truncated):
            c.interrupted, c.truncated = i, t
        await batcher.admit(g, FakeMsg(gid))
    # A redelivery of a held group is not new data: not counted again.
    await batcher.admit(make_group("kept", (0.0, 1.0, 1.0)), FakeMsg("kept-copy"))
    assert batcher.take_counters() == Counter(zero_variance=1, stale=1)
    expected = Counter(completions=7, interrupted=4, truncated=4)
    assert batcher.take_rollout_counts() == expected
    assert batcher.rollouts == expected
    assert batcher.take_rollout_counts() == Counter()  # reset after each take, the total kept


@pytest.mark.parametrize("rewards", [(0.0, 1.0), (-1.0, 1.0), (1.0, 1.0, 0.0), (0.25, 0.5)])
async def test_groups_with_signal_are_held_unacked(rewards: tuple[float, ...]) -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8)
    msg, reason = await admit(batcher, "g", rewards)
    assert reason is None
    assert msg.calls == []
    assert ids(batcher.ready) == ["g"]
    assert batcher.num_held == 1


@pytest.mark.parametrize("mode", ["drop", "keep"])
async def test_zero_variance_drop_and_keep_batch_flat_groups_in_arrival_order(mode: ZeroVariance) -> None:
    """drop and keep: flat groups are held and batched like informative ones; nothing is dropped here."""
    batcher = Batcher(batch_prompts=3, max_staleness_versions=8, zero_variance=mode)
    msgs = [
        (await admit(batcher, gid, rewards))[0]
        for gid, rewards in (("a", (0.0, 0.0)), ("b", (0.0, 1.0)), ("c", (1.0, 1.0)))
    ]
    assert all(m.calls == [] for m in msgs)
    assert batcher.dropped == Counter()
    handed = await batcher.next_batch(learner_version=0, num_groups=3, timeout_s=1.0)
    assert handed is not None
    assert ids(handed.items) == ["a", "b", "c"]
    header = batcher.header(handed)
    assert (header.num_groups, header.num_zero_variance) == (3, 0)
    assert header.keep_zero_variance == (mode == "keep")


async def test_zero_variance_refill_fills_the_batch_with_informative_groups() -> None:
    """refill: flat groups are acked and counted on arrival; the batch waits for B informative ones."""
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8, zero_variance="refill")
    msgs = {
        gid: (await admit(batcher, gid, rewards))[0]
        for gid, rewards in (("a", (0.0, 0.0)), ("b", (0.0, 1.0)), ("c", (1.0, 1.0)), ("d", (1.0, 0.0)))
    }
    assert [gid for gid, m in msgs.items() if m.acked] == ["a", "c"]
    handed = await batcher.next_batch(learner_version=0, num_groups=2, timeout_s=1.0)
    assert handed is not None
    assert ids(handed.items) == ["b", "d"]
    header = batcher.header(handed)
    assert (header.num_groups, header.num_zero_variance, header.keep_zero_variance) == (2, 2, False)


def test_zero_variance_defaults_to_drop() -> None:
    """ScaleRL's semantics by default: a step takes the next B groups, flat ones included."""
    assert Batcher(batch_prompts=1, max_staleness_versions=0).zero_variance == "drop"
    assert BrokerConfig().zero_variance == "drop"


async def test_stale_groups_are_dropped_on_arrival() -> None:
    batcher = Batcher(batch_prompts=1, max_staleness_versions=4)
    await batcher.set_learner_version(10)
    fresh, reason_fresh = await admit(batcher, "at-bound", min_version=6)  # 10 - 6 = 4: allowed
    stale, reason_stale = await admit(batcher, "stale", min_version=5)  # 10 - 5 = 5 > 4
    assert (reason_fresh, reason_stale) == (None, "stale")
    assert fresh.calls == [] and stale.calls == ["ack"]
    assert batcher.dropped == Counter(stale=1)
    assert ids(batcher.ready) == ["at-bound"]


async def test_groups_going_stale_in_the_buffer_are_dropped() -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=2)
    old, _ = await admit(batcher, "old", min_version=1)
    new, _ = await admit(batcher, "new", min_version=3)
    newer, _ = await admit(batcher, "newer", min_version=4)
    # Learner at 4: "old" is 3 versions behind (> 2) and goes; the other two make a batch.
    batch = await batcher.next_batch(learner_version=4, num_groups=2, timeout_s=1.0)
    assert batch is not None
    assert ids(batch.items) == ["new", "newer"]
    assert old.calls == ["ack"] and new.calls == [] and newer.calls == []
    assert batcher.dropped == Counter(stale=1)
    assert batcher.take_counters() == Counter(stale=1)


async def test_learner_version_never_goes_back() -> None:
    batcher = Batcher(batch_prompts=1, max_staleness_versions=0)
    await batcher.set_learner_version(5)
    await batcher.set_learner_version(3)
    assert batcher.learner_version == 5


# --------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------


async def test_next_batch_times_out_with_none() -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8)
    await admit(batcher, "only")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await batcher.next_batch(learner_version=0, num_groups=2, timeout_s=0.05) is None
    assert 0.04 <= loop.time() - started < 5.0  # returned at its timeout, not at the next admit
    assert ids(batcher.ready) == ["only"]  # nothing taken
    assert batcher.handed_out == {}


async def test_next_batch_returns_once_enough_arrive() -> None:
    batcher = Batcher(batch_prompts=3, max_staleness_versions=8, zero_variance="refill")
    waiter = asyncio.create_task(batcher.next_batch(learner_version=0, num_groups=3, timeout_s=5.0))
    msgs = []
    for i in range(4):
        if i < 3:  # g3 follows g2 without yielding: the batch must still be g0-g2
            await asyncio.sleep(0.01)  # pacing: let the waiter run (and return, were it wrong); no event
            assert not waiter.done()
        msg, _ = await admit(batcher, f"g{i}")
        msgs.append(msg)
        if i == 0:
            await admit(batcher, "zv", (1.0, 1.0))  # filtered: does not count towards the batch
    batch = await asyncio.wait_for(waiter, 1.0)
    assert batch is not None
    assert ids(batch.items) == ["g0", "g1", "g2"]
    assert ids(batcher.ready) == ["g3"]
    assert batcher.handed_out == {batch.batch_id: batch}
    assert batcher.num_served == 3 and batcher.num_held == 4
    assert all(m.calls == [] for m in msgs)  # nothing acked before the learner says so


async def test_ack_acks_only_that_batch_and_reports_unknown_ids() -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8)
    msgs = [(await admit(batcher, f"g{i}"))[0] for i in range(4)]
    b1 = await batcher.next_batch(0, 2, 1.0)
    b2 = await batcher.next_batch(0, 2, 1.0)
    assert b1 is not None and b2 is not None and b1.batch_id != b2.batch_id
    num, unknown = await batcher.ack([(b2.batch_id, (), ()), ("no-such-batch", (), ())])
    assert (num, unknown) == (2, ["no-such-batch"])
    assert [m.acked for m in msgs] == [False, False, True, True]
    assert batcher.num_trained == 2
    # Acking twice: the second time the id is unknown and nothing is re-acked.
    assert await batcher.ack([(b2.batch_id, (), ())]) == (0, [b2.batch_id])
    assert [m.calls.count("ack") for m in msgs] == [0, 0, 1, 1]
    assert await batcher.ack([(b1.batch_id, (), ())]) == (2, [])
    assert all(m.calls == ["ack"] for m in msgs)
    assert batcher.num_held == 0 and batcher.num_trained == 4


async def test_release_puts_batches_back_at_the_front_in_order() -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8)
    msgs = [(await admit(batcher, f"g{i}"))[0] for i in range(5)]
    b1 = await batcher.next_batch(0, 2, 1.0)
    b2 = await batcher.next_batch(0, 2, 1.0)
    assert b1 is not None and b2 is not None
    assert ids(batcher.ready) == ["g4"]
    assert await batcher.release() == 4
    assert ids(batcher.ready) == ["g0", "g1", "g2", "g3", "g4"]
    assert batcher.handed_out == {}
    assert all(m.calls == [] for m in msgs)  # released, not acked or nak'ed
    # The next batches are the same groups again, and the old ids are gone.
    again = await batcher.next_batch(0, 2, 1.0)
    assert again is not None and ids(again.items) == ["g0", "g1"]
    assert await batcher.ack([(b1.batch_id, (), ())]) == (0, [b1.batch_id])


async def test_release_selected_batches_and_expired_ones() -> None:
    batcher = Batcher(batch_prompts=2, max_staleness_versions=8)
    for i in range(6):
        await admit(batcher, f"g{i}")
    b1, b2, b3 = [await batcher.next_batch(0, 2, 1.0) for _ in range(3)]
    assert b1 is not None and b2 is not None and b3 is not None
    # Released in the order asked for, ahead of anything waiting.
    assert await batcher.release([b3.batch_id, "unknown", b1.batch_id]) == 4
    assert ids(batcher.ready) == ["g4", "g5", "g0", "g1"]
    assert list(batcher.handed_out) == [b2.batch_id]
    assert await batcher.release_expired(max_age_s=60.0) == 0
    b2.handed_s -= 120.0
    assert await batcher.release_expired(max_age_s=60.0) == 2
    assert ids(batcher.ready) == ["g2", "g3", "g4", "g5", "g0", "g1"]


async def test_released_groups_can_go_stale() -> None:
    batcher = Batcher(batch_prompts=1, max_staleness_versions=1)
    msg, _ = await admit(batcher, "g", min_version=0)
    batch = await batcher.next_batch(1, 1, 1.0)
    assert batch is not None
    await batcher.release([batch.batch_id])
    assert await batcher.next_batch(learner_version=2, num_groups=1, timeout_s=0.01) is None
    assert msg.calls == ["ack"] and batcher.dropped == Counter(stale=1)


async def test_heartbeat_touches_every_held_message_and_survives_failures() -> None:
    class Flaky(FakeMsg):
        async def in_progress(self) -> None:
            raise ConnectionError("nats down")

    batcher = Batcher(batch_prompts=1, max_staleness_versions=8, zero_variance="refill")
    ready, _ = await admit(batcher, "ready")
    flaky = Flaky("flaky")
    await batcher.admit(make_group("flaky", (0.0, 1.0)), flaky)
    handed = FakeMsg("handed")
    await batcher.admit(make_group("handed", (0.0, 1.0)), handed)
    batch = await batcher.next_batch(0, 2, 1.0)
    assert batch is not None and ids(batch.items) == ["ready", "flaky"]
    zv, _ = await admit(batcher, "zv", (1.0, 1.0))
    await batcher.heartbeat()
    assert ready.calls == ["in_progress"] and handed.calls == ["in_progress"]
    assert zv.calls == ["ack"]  # dropped messages are not held


# --------------------------------------------------------------------------
# validate_group
# --------------------------------------------------------------------------


def test_valid_group_passes_and_helpers() -> None:
    g = make_group("ok", (1.0, 0.0, 1.0, -1.0))
    validate_group(g)
    assert not is_zero_variance(g)
    assert pass_rate(g) == 0.5
    assert is_zero_variance(make_group("zv", (-1.0, -1.0)))


SPANS: dict[str, list[tuple[int, int, int]]] = {  # (version, start, end) for 3 tokens
    "span gap": [(0, 0, 1), (1, 2, 3)],
    "span overlap": [(0, 0, 2), (1, 1, 3)],
    "empty span": [(0, 0, 0), (1, 0, 3)],
    "spans short": [(0, 0, 2)],
    "spans long": [(0, 0, 4)],
}


def _broken(kind: str) -> rollout_pb2.RolloutGroup:
    g = make_group("bad", (0.0, 1.0), num_tokens=3)
    c = g.completions[1]
    if kind == "no completions":
        del g.completions[:]
    elif kind == "no group id":
        g.group_id = ""
    elif kind == "no prompt":
        del g.prompt_token_ids[:]
    elif kind == "no tokens":
        del c.token_ids[:], c.logprobs[:], c.version_spans[:]
    elif kind == "logprob count":
        c.logprobs.append(-0.1)
    elif kind == "positive logprob":
        c.logprobs[2] = 0.01
    elif kind == "nan logprob":
        c.logprobs[0] = math.nan
    elif kind == "inf logprob":
        c.logprobs[0] = -math.inf
    elif kind == "nan reward":
        c.reward = math.nan
    elif kind == "inf reward":
        c.reward = math.inf
    elif kind == "loss mask length":
        c.loss_mask.extend([1] * 5)
    elif kind in SPANS:
        del c.version_spans[:]
        c.version_spans.extend(rollout_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in SPANS[kind])
    else:
        raise AssertionError(kind)
    return g


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("no completions", "bad: no completions"),
        ("no group id", "no group_id"),
        ("no prompt", "no prompt tokens"),
        ("no tokens", "completion 1: no tokens"),
        ("logprob count", "completion 1: 4 logprobs for 3 tokens"),
        ("positive logprob", "completion 1: logprobs must be finite and <= 0"),
        ("nan logprob", "completion 1: logprobs must be finite and <= 0"),
        ("inf logprob", "completion 1: logprobs must be finite and <= 0"),
        ("nan reward", "completion 1: reward is not finite"),
        ("inf reward", "completion 1: reward is not finite"),
        ("loss mask length", "completion 1: loss_mask length 5 != 3"),
        ("span gap", "version spans must tile the tokens"),
        ("span overlap", "version spans must tile the tokens"),
        ("empty span", "version spans must tile the tokens"),
        ("spans short", "version spans cover 2 of 3 tokens"),
        ("spans long", "version spans cover 4 of 3 tokens"),
    ],
)
def test_validate_group_rejects(kind: str, match: str) -> None:
    g = _broken(kind)
    with pytest.raises(PayloadError, match=match):
        validate_group(g)
    # From its bytes (the log-probs checked on the wire first), the same error names the same completion.
    with pytest.raises(PayloadError, match=match):
        decode_group(g.SerializeToString())


# --------------------------------------------------------------------------
# Curriculum
# --------------------------------------------------------------------------

PROBLEMS = [Problem(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(12)]


def draw(c: Curriculum, n: int) -> list[tuple[str, int, int]]:
    out = []
    for _ in range(n):
        problem, epoch, position = c.next()
        out.append((problem.prompt_id, epoch, position))
    return out


def test_order_is_deterministic_per_seed_and_epochs_wrap() -> None:
    a = draw(Curriculum(PROBLEMS, seed=1, retire_at=0.9), 36)
    b = draw(Curriculum(PROBLEMS, seed=1, retire_at=0.9), 36)
    other = draw(Curriculum(PROBLEMS, seed=2, retire_at=0.9), 36)
    assert a == b
    assert [p for p, _, _ in a] != [p for p, _, _ in other]
    all_ids = sorted(p.prompt_id for p in PROBLEMS)
    for epoch in range(3):
        chunk = a[12 * epoch : 12 * (epoch + 1)]
        assert sorted(p for p, _, _ in chunk) == all_ids  # each epoch is a permutation
        assert [(e, pos) for _, e, pos in chunk] == [(epoch, i) for i in range(12)]
    # Epochs are reshuffled, not repeated.
    assert [p for p, _, _ in a[:12]] != [p for p, _, _ in a[12:24]]
    state = Curriculum(PROBLEMS, seed=1, retire_at=0.9)
    draw(state, 13)
    assert (state.state.epoch, state.state.cursor, state.state.num_issued) == (1, 1, 13)


def test_no_positive_resampling_from_the_next_epoch_on() -> None:
    order0 = [p for p, _, _ in draw(Curriculum(PROBLEMS, seed=5, retire_at=0.9), 12)]
    c = Curriculum(PROBLEMS, seed=5, retire_at=0.9)
    assert [p for p, _, _ in draw(c, 6)] == order0[:6]
    c.record(order0[0], 1.0)
    c.record(order0[1], 0.9)  # exactly the threshold retires
    c.record(order0[2], 0.89)  # just below does not
    c.record(order0[3], 0.95)
    c.record(order0[3], 0.5)  # the latest observation counts
    c.record(order0[8], 1.0)  # not issued yet in this epoch
    assert c.num_retired == 3
    # The current epoch is unaffected, including the prompt not issued yet.
    assert draw(c, 6) == [(p, 0, i) for i, p in enumerate(order0[6:], start=6)]
    epoch1 = draw(c, 9)
    assert [(e, pos) for _, e, pos in epoch1] == [(1, i) for i in range(9)]
    retired = {order0[0], order0[1], order0[8]}
    assert sorted(p for p, _, _ in epoch1) == sorted(p.prompt_id for p in PROBLEMS if p.prompt_id not in retired)
    assert draw(c, 1)[0][1:] == (2, 0)  # 9 eligible prompts: epoch 1 was 9 long


def test_prompt_retired_during_an_epoch_is_still_issued_in_it() -> None:
    twin = Curriculum(PROBLEMS, seed=5, retire_at=0.9)
    draw(twin, 12)
    order1 = [p for p, _, _ in draw(twin, 12)]
    c = Curriculum(PROBLEMS, seed=5, retire_at=0.9)
    draw(c, 12)  # epoch 0
    assert [p for p, _, _ in draw(c, 2)] == order1[:2]  # epoch 1 began with every prompt eligible
    c.record(order1[7], 1.0)
    c.record(order1[0], 1.0)
    assert [p for p, _, _ in draw(c, 10)] == order1[2:]
    epoch2 = draw(c, 10)
    assert {e for _, e, _ in epoch2} == {2}
    assert sorted(p for p, _, _ in epoch2) == sorted(set(order1) - {order1[0], order1[7]})


def test_every_prompt_retired_ends_the_run() -> None:
    c = Curriculum(PROBLEMS[:3], seed=0, retire_at=0.9)
    for problem, _, _ in [c.next() for _ in range(3)]:
        c.record(problem.prompt_id, 1.0)
    with pytest.raises(RuntimeError, match="every train prompt is retired"):
        c.next()
    with pytest.raises(ValueError, match="train split is empty"):
        Curriculum([], seed=0, retire_at=0.9)


def run_with_results(c: Curriculum, num: int, in_flight: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Issue ``num`` prompts; each result arrives three tasks later, some of them solved.

    Which prompts are solved changes with the epoch, so prompts retire in
    the middle of epochs, after that epoch's order was fixed.
    """
    out = []
    for _ in range(num):
        problem, epoch, position = c.next()
        out.append((problem.prompt_id, epoch, position))
        in_flight.append((problem.prompt_id, epoch))
        if len(in_flight) > 3:
            done, done_epoch = in_flight.pop(0)
            c.record(done, 1.0 if (7 * int(done[1:]) + done_epoch) % 4 == 0 else 0.5)
    return out


@pytest.mark.parametrize("stop_after", [0, 5, 12, 13, 17, 20, 30])
def test_state_round_trip_resumes_exactly(stop_after: int) -> None:
    """A broker restarted from the serialized state issues exactly what the old one would have."""
    expected = run_with_results(Curriculum(PROBLEMS, seed=9, retire_at=0.9), 40, [])
    assert len({e for _, e, _ in expected}) >= 3  # the run crosses epochs with retired prompts

    in_flight: list[tuple[str, int]] = []
    original = Curriculum(PROBLEMS, seed=9, retire_at=0.9)
    before = run_with_results(original, stop_after, in_flight)
    saved = original.state.SerializeToString()
    # The seed comes from the state, not the argument.
    resumed = Curriculum(PROBLEMS, seed=123, retire_at=0.9, state=rollout_pb2.CurriculumState.FromString(saved))
    assert resumed.state == original.state
    after = run_with_results(resumed, 40 - stop_after, in_flight)
    assert before + after == expected
    assert resumed.state.num_issued == 40


def test_outstanding_limit_follows_consumption_and_k() -> None:
    from asymptote.jetstream.names import Names
    from services.broker.metrics import BrokerMetrics
    from services.broker.pipeline import BrokerPipeline

    config = BrokerConfig(
        task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2), batch_prompts=16, max_staleness_versions=8
    )
    p = BrokerPipeline(config, None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    assert p.outstanding_limit() == 32  # nothing measured yet: two batches
    p.consume_rate, p.issue_latency_s = 40.0, 1.0  # Little's law: 40 groups in the pipeline
    p._flow_at = None
    assert p.outstanding_limit() == 50 + 16  # ceil(1.25 * 40 * 1.0) + one batch in hand
    p.consume_rate, p.issue_latency_s = 1000.0, 5.0
    assert p.outstanding_limit() == 16 * 9  # never more than k + 1 batches ahead
    p.consume_rate, p.issue_latency_s = 0.1, 0.1
    assert p.outstanding_limit() == 17  # ceil(0.0125) + one batch
    sync = BrokerPipeline(config.model_copy(update={"mode": "sync"}), None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    sync.consume_rate, sync.issue_latency_s = 1000.0, 5.0
    assert sync.outstanding_limit() == 16


@dataclass
class SeqMsg(FakeMsg):
    seq: int = 0


async def test_a_redelivery_replaces_the_held_handle_and_a_second_copy_is_a_duplicate() -> None:
    batcher = Batcher(batch_prompts=1, max_staleness_versions=8, stream_seq=lambda m: m.seq)  # type: ignore[attr-defined]
    first = SeqMsg("g", seq=7)
    assert await batcher.admit(make_group("g", (0.0, 1.0)), first) is None
    redelivered = SeqMsg("g", seq=7)
    assert await batcher.admit(make_group("g", (0.0, 1.0)), redelivered) is None
    copy = SeqMsg("g", seq=9)
    assert await batcher.admit(make_group("g", (0.0, 1.0)), copy) == "duplicate"
    assert copy.acked and not first.acked and not redelivered.acked
    assert ids(batcher.ready) == ["g"] and batcher.num_received == 1
    assert batcher.dropped == {"duplicate": 1}
    batch = await batcher.next_batch(0, 1, 1.0)
    assert batch is not None and batch.items[0].msg is redelivered  # the live handle is acked later
    # A copy of a task the ledger says has ended is never held.
    ended = SeqMsg("e", seq=11)
    assert await batcher.admit(make_group("e", (0.0, 1.0)), ended, ended=True) == "duplicate"
    assert ended.acked and batcher.dropped == {"duplicate": 2} and "e" not in ids(batcher.ready)


async def test_learner_pace_leaves_out_its_wait_for_data(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.broker import batcher as batcher_module

    now = [100.0]
    monkeypatch.setattr(batcher_module.time, "monotonic", lambda: now[0])
    batcher = Batcher(batch_prompts=4, max_staleness_versions=8)
    for i in range(4):
        await admit(batcher, f"g{i}")
    assert await batcher.next_batch(0, 4, 1.0) is not None and batcher.learner_pace is None
    now[0] += 0.5  # the learner trains for half a second, then asks again
    assert await batcher.next_batch(0, 4, 0.0) is None  # and waits for data: that does not count
    assert batcher.learner_pace == pytest.approx(8.0)  # 4 groups / 0.5 s
    for i in range(4, 8):
        await admit(batcher, f"g{i}")
    now[0] += 30.0  # starved meanwhile: the wait is not the learner's pace
    assert await batcher.next_batch(0, 4, 1.0) is not None
    assert batcher.learner_pace == pytest.approx(8.0)
    now[0] += 0.25
    await batcher.next_batch(0, 4, 0.0)
    assert batcher.learner_pace == pytest.approx(0.8 * 8.0 + 0.2 * 16.0)


def test_outstanding_limit_follows_the_learners_pace_not_what_it_got() -> None:
    from asymptote.jetstream.names import Names
    from services.broker.metrics import BrokerMetrics
    from services.broker.pipeline import BrokerPipeline

    config = BrokerConfig(
        task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2), batch_prompts=16, max_staleness_versions=8
    )
    p = BrokerPipeline(config, None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    p.issue_latency_s = 1.0
    p.batcher.learner_pace = 40.0
    assert p.outstanding_limit() == 50 + 16 and p.consume_rate == 40.0
    p.batcher.learner_pace = 1000.0  # a learner far faster than generation: k + 1 batches, no more
    assert p.outstanding_limit() == 16 * 9


def test_train_tasks_wait_for_the_version_that_keeps_them_within_k() -> None:
    """PipelineRL-k: a task whose group would be trained more than k versions after a generator's
    version names the version to wait for; the learner's advance lowers it."""
    from asymptote.jetstream.names import Names
    from services.broker.metrics import BrokerMetrics
    from services.broker.pipeline import BrokerPipeline

    config = BrokerConfig(
        task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2), batch_prompts=4, max_staleness_versions=2
    )
    p = BrokerPipeline(config, None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    p.batcher.learner_version = 10
    # Batches 0..2 ahead are trained at versions 10..12: any version from 8..10 on keeps them within k = 2.
    assert [p.start_version(ahead) for ahead in (0, 3, 4, 8, 11, 12, 15)] == [8, 8, 9, 10, 10, 11, 11]
    p.batcher.learner_version = 11  # the learner took a batch: the same position needs one version more
    assert p.start_version(12) == 12
    p.batcher.learner_version = 0
    assert p.start_version(5) == 0  # never below version 0
    sync = BrokerPipeline(config.model_copy(update={"mode": "sync"}), None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    sync.batcher.learner_version = 10
    assert sync.start_version(40) == 10  # synchronous mode: the learner's current version
