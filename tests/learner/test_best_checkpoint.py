"""Which checkpoints pruning keeps: the newest, and the best held-out round's.

The rule (``checkpoint.kept_versions``) and the best round (``best_round``)
with numbers; ``prune`` on checkpoint folders, with the ``BEST`` mark moved
when a better round supersedes; a restarted learner's checkpointer that has
not read the best yet prunes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asymptote.best_round import best_round, read_eval_rows
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.messages import decode_best_round
from services.learner import checkpoint
from services.learner.checkpoint import Checkpointer, Meta, kept_versions, prune


def test_the_newest_and_the_best_round_s_checkpoint_are_kept() -> None:
    demo = list(range(10, 301, 10))
    # The demo's run: eval every 20 versions, a checkpoint every 10, the best round at 260.
    assert kept_versions(demo, 2, None) == {290, 300}
    assert kept_versions(demo, 2, 260) == {260, 290, 300}
    # The best among the newest costs nothing more.
    assert kept_versions(demo, 2, 300) == {290, 300}
    # No checkpoint at the round's version (a restart moved versions past steps): the newest before it.
    assert kept_versions([96, 106, 116, 126], 1, 120) == {116, 126}
    # R0's round (version 0) has no checkpoint before it: the newest alone.
    assert kept_versions([10, 20, 30], 1, 0) == {30}
    assert kept_versions([], 2, 10) == set()


def test_the_best_round_is_the_highest_pass_rate_and_the_earliest_of_equals() -> None:
    rows = [{"policy_version": v, "pass_rate": r} for v, r in [(0, 0.2), (20, 0.55), (40, 0.5), (60, 0.55)]]
    assert best_round(rows) == rollout_pb2.BestRound(policy_version=20, pass_rate=0.55, num_rounds=4)
    assert best_round(rows[:1]) == rollout_pb2.BestRound(policy_version=0, pass_rate=0.2, num_rounds=1)
    assert best_round([]) is None
    # A mixture: a version's score is its sub-tasks' mean, over versions every sub-task reported.
    mixed = [
        {"policy_version": 0, "pass_rate": 0.1, "task": "math"},
        {"policy_version": 0, "pass_rate": 0.3, "task": "code"},
        {"policy_version": 20, "pass_rate": 0.9, "task": "math"},
        {"policy_version": 20, "pass_rate": 0.1, "task": "code"},  # mean 0.5
        {"policy_version": 40, "pass_rate": 0.6, "task": "math"},
        {"policy_version": 40, "pass_rate": 0.6, "task": "code"},  # mean 0.6
        {"policy_version": 60, "pass_rate": 1.0, "task": "math"},  # code has not reported
    ]
    best = best_round(mixed)
    assert best is not None and (best.policy_version, best.num_rounds) == (40, 3)
    assert best.pass_rate == pytest.approx(0.6)


def test_an_eval_log_cut_short_is_read_to_its_last_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"policy_version": 0, "pass_rate": 0.2}\n{"policy_version": 20, "pass_rate": 0.4}\n{"policy_v')
    assert [r["policy_version"] for r in read_eval_rows(path)] == [0, 20]
    assert read_eval_rows(tmp_path / "absent.jsonl") == []


def test_a_best_round_entry_out_of_range_is_refused() -> None:
    for bad in (rollout_pb2.BestRound(pass_rate=1.5, num_rounds=1), rollout_pb2.BestRound(pass_rate=0.5)):
        with pytest.raises(PayloadError, match="accepted: a pass rate in"):
            decode_best_round(bad.SerializeToString())


def folders(root: Path, *versions: int) -> None:
    for v in versions:
        (checkpoint.final_path(root, v)).mkdir(parents=True)
        (checkpoint.final_path(root, v) / "DONE").touch()


def present(root: Path) -> list[int]:
    return [checkpoint.version_of(p) for p in checkpoint.committed(root)]


def mark(version: int, pass_rate: float, num_rounds: int) -> dict[str, float]:
    return {"policy_version": version, "pass_rate": pass_rate, "num_rounds": num_rounds}


def test_prune_marks_the_best_and_deletes_the_one_it_supersedes(tmp_path: Path) -> None:
    folders(tmp_path, 10, 20, 30, 40)
    prune(tmp_path, 1, rollout_pb2.BestRound(policy_version=20, pass_rate=0.5, num_rounds=3))
    assert present(tmp_path) == [20, 40]
    assert checkpoint.best_mark(checkpoint.final_path(tmp_path, 20)) == mark(20, 0.5, 3)
    # A round at 45 scores higher: its stand-in is 40 (the newest before it), and 20 goes.
    folders(tmp_path, 50)
    prune(tmp_path, 1, rollout_pb2.BestRound(policy_version=45, pass_rate=0.6, num_rounds=4))
    assert present(tmp_path) == [40, 50]
    assert checkpoint.best_mark(checkpoint.final_path(tmp_path, 40)) == mark(45, 0.6, 4)
    # The best is the newest: the mark moves there, 40 goes.
    folders(tmp_path, 60)
    prune(tmp_path, 2, rollout_pb2.BestRound(policy_version=60, pass_rate=0.7, num_rounds=5))
    assert present(tmp_path) == [50, 60]
    assert checkpoint.best_mark(checkpoint.final_path(tmp_path, 50)) is None
    assert checkpoint.best_mark(checkpoint.final_path(tmp_path, 60)) is not None


def save(writer: Checkpointer, version: int) -> Path | None:
    """A checkpoint of one small tensor at ``version``, committed (and pruned) as the learner's rank 0 does."""
    writer.begin(
        version,
        {"model": {"w": torch.full((2,), float(version))}},
        Meta(version, version, 0, [], {}, True, 1, "single"),
    )
    return writer.finish()


def test_a_restarted_learner_prunes_nothing_until_it_has_read_the_best(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first = Checkpointer(root, keep=1, distributed=False, rank=0, keep_best=True)
    first.set_best(rollout_pb2.BestRound(policy_version=10, pass_rate=0.5, num_rounds=2))
    for v in (10, 20, 30):
        save(first, v)
    assert present(root) == [10, 30]
    # The restarted learner has not read the fitter's entry yet (NATS unreachable): it deletes nothing.
    restarted = Checkpointer(root, keep=1, distributed=False, rank=0, keep_best=True)
    save(restarted, 40)
    assert present(root) == [10, 30, 40]
    restarted.set_best(rollout_pb2.BestRound(policy_version=10, pass_rate=0.5, num_rounds=4))
    save(restarted, 50)
    assert present(root) == [10, 50]
    assert json.loads((checkpoint.final_path(root, 10) / checkpoint.BEST).read_text())["num_rounds"] == 4
    # Without keep_best the newest alone, as before.
    plain = Checkpointer(root, keep=1, distributed=False, rank=0)
    save(plain, 60)
    assert present(root) == [60]
