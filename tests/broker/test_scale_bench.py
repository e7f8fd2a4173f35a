"""The data-plane load simulator: a small point of the sweep, and chaos under load (slow).

Both run the real thing (one nats-server, one broker process, simulated
generators and learner over NATS and gRPC) and assert what must hold
whatever the machine's speed: groups flow, the ledger audit finds nothing
lost and nothing trained twice, the report files are written, and after a
third of the generators and the broker die the learner is back within the
bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asymptote.nats_local import NatsServer, nats_server
from benchmarks.dataplane import LoadShape
from benchmarks.scale import PLOT_FILE, RECOVERY_BOUND_S, REPORT_FILE, TABLE_FILE, bench_scale, run_chaos

SMALL = LoadShape(completion_tokens=32, batch_prompts=16, inflight_per_generator=4, generate_s=0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with nats_server(Path(tmp_path_factory.mktemp("nats"))) as s:
        yield s


def test_a_small_point_flows_loses_nothing_and_writes_its_report(tmp_path: Path) -> None:
    report = bench_scale(tmp_path, generators=[4], shape=SMALL, warmup_s=2.0, window_s=3.0, chaos=False)
    (row,) = report["rows"]
    assert row["generators"] == 4 and row["groups_per_s"] > 0 and row["steps"] > 0
    assert row["lost"] == 0 and row["trained_twice"] == 0
    assert row["audit"]["ok"] and row["audit"]["trained"] >= row["steps"] * SMALL.batch_prompts
    assert 0.0 <= row["learner_wait_fraction"] <= 1.0
    assert row["next_batch_p50_ms"] <= row["next_batch_p99_ms"]
    assert row["offered_groups_per_s"] == pytest.approx(4 * 4 / 0.1)
    for name in ("broker", "nats", "simulator"):
        assert row["processes"][name]["cpu_cores"] > 0 and row["processes"][name]["peak_rss_mb"] > 0
    written = json.loads((tmp_path / REPORT_FILE).read_text())
    assert written["rows"][0]["groups_per_s"] == row["groups_per_s"]
    table = (tmp_path / TABLE_FILE).read_text()
    assert any(line.startswith("| 4 | 160 |") for line in table.splitlines())
    assert (tmp_path / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
async def test_chaos_under_load_loses_nothing_and_recovers_within_the_bound(server: NatsServer, tmp_path: Path) -> None:
    result = await run_chaos(server, tmp_path, SMALL, num_generators=64)
    assert result["generators_killed"] == 21
    assert result["lost"] == 0 and result["trained_twice"] == 0, result["audit"]["examples"]
    assert result["audit"]["ok"]
    assert result["recovery_s"] is not None and result["recovery_s"] <= RECOVERY_BOUND_S, result
    # The dead generators' leases came back to the others.
    assert result["redelivered_tasks"] > 0
