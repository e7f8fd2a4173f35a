"""The broker benchmark in quick mode: a well-formed figure whose counts add up.

Runs the real thing (nats-server, the broker as its own process, fake
generators and a fake learner over gRPC) and checks the figure's structure
and arithmetic, never its timing targets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.broker import bench_broker


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if text in args:
            found.append(args)
    return found


def test_quick_broker_bench_counts_every_group(tmp_path: Path) -> None:
    fig = bench_broker(quick=True, workdir=tmp_path)
    r = fig.details
    assert fig.name == "broker_groups_per_s_vs_raw_nats" and fig.unit == "groups/s"
    assert all(isinstance(text, str) and text for text in (fig.baseline, fig.measured, fig.target))
    assert fig.value is not None and fig.ratio is not None
    for key, x in {"groups_per_s": fig.value, "raw_groups_per_s": r["raw_groups_per_s"], "ratio": fig.ratio}.items():
        assert math.isfinite(x) and x > 0, key
    assert math.isfinite(r["window_s"]) and r["window_s"] > 0
    assert all(math.isfinite(x) and x > 0 for x in r["raw_groups_per_s_each"])
    assert fig.ratio == pytest.approx(fig.value / r["raw_groups_per_s"], rel=1e-9)
    assert fig.value == pytest.approx(r["groups"] / r["window_s"], rel=1e-9)
    assert fig.met == (fig.ratio >= 0.5 and fig.value >= 5000)

    # Quick mode: one broker run between two raw runs, whose mean is its baseline.
    assert len(r["rounds"]) == 1 and len(r["raw_groups_per_s_each"]) == 2
    assert r["raw_groups_per_s"] == pytest.approx(sum(r["raw_groups_per_s_each"]) / 2, rel=1e-9)
    assert r["rounds"][0]["ratio"] == fig.ratio
    # CPU per group of every process, and the cores the target rate would take at that cost.
    assert set(r["cpu_us_per_group"]) == {"broker", "nats-server", "harness"}
    assert set(r["raw_cpu_us_per_group"]) == {"nats-server", "harness"}
    for cpu in (r["cpu_us_per_group"], r["raw_cpu_us_per_group"]):
        assert all(math.isfinite(us) and us > 0 for us in cpu.values()), cpu
    # The relay run: the same message work with no broker logic, measured the same way.
    relay = r["rounds"][0]
    assert math.isfinite(relay["relay_groups_per_s"]) and relay["relay_groups_per_s"] > 0
    assert r["relay_groups_per_s"] == relay["relay_groups_per_s"]
    assert set(r["relay_cpu_us_per_group"]) == {"relay", "nats-server", "harness"}
    assert all(math.isfinite(us) and us > 0 for us in r["relay_cpu_us_per_group"].values())
    assert f"{r['relay_groups_per_s']:,.0f} groups/s" in fig.measured
    assert 0 < relay["tasks_per_fetch"] <= 64
    assert r["cores_at_target"] == pytest.approx(5000 * sum(r["cpu_us_per_group"].values()) / 1e6, rel=1e-9)
    assert f"{r['cores_at_target']:.1f} cores" in fig.measured

    # The window holds exactly the groups asked for; the learner trained every
    # group it was served (warm-up included), none was filtered or duplicated.
    assert r["groups"] == 800 and r["batch_prompts"] == 16
    delivered = r["groups"] + r["warmup_groups"]
    assert r["warmup_groups"] % r["batch_prompts"] == 0
    assert r["groups_served"] == r["groups_trained"] == delivered
    assert sum(r["groups_dropped"].values()) == 0 and r["generator_duplicates"] == 0
    assert r["groups_admitted"] == r["groups_received"] >= delivered
    assert r["tasks_issued"] >= r["generator_groups_published"] >= r["groups_received"]

    # Nothing it started outlives it: neither the broker, the relay nor nats-server.
    assert processes_mentioning(str(tmp_path)) == []
    assert processes_mentioning("-m benchmarks.relay --nats") == []
