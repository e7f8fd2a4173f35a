"""A pool recycles itself after ``max_runs``: not ready, new runs refused, the accepted ones finished, exit 0.

And a client call made while the pool is gone waits for the fresh process
that takes its place (as Kubernetes or the local stack starts one) and gets
its result.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
from pool_process import PoolProcess, running_pool, spawn, stop, wait_ready

from asymptote.contracts.v1 import sandbox_pb2
from asymptote.sandbox import Limits, RunResult
from asymptote.sandbox.remote import PoolSandbox
from tests.helpers.waiting import wait_until

LIMITS = Limits(timeout_s=10.0, memory_mib=512)
SLOW = "import time\ntime.sleep(1.5)\nprint('slow done')"


def test_recycles_after_max_runs(tmp_path: Path) -> None:
    with running_pool(tmp_path, max_runs=3) as pool:
        client = PoolSandbox(pool.client_settings)
        assert client.describe().max_runs == 3
        assert [client.run(f"print({i})", b"", LIMITS).stdout for i in range(2)] == [b"0\n", b"1\n"]
        assert pool.sample("asymptote_sandbox_pool_runs_left") == 1
        assert pool.popen.poll() is None

        last: list[RunResult] = []
        third = threading.Thread(target=lambda: last.append(client.run(SLOW, b"", LIMITS)))
        third.start()
        # The third run is accepted and running: the pool drains, so it is not ready and refuses new runs.
        wait_until(lambda: pool.readyz() == 503, 20.0, "the draining pool to report not ready")
        channel, stub = pool.stub()
        with channel:
            try:
                stub.Run(sandbox_pb2.RunRequest(program="print(4)"), timeout=10.0)
                raise AssertionError("a fourth run was accepted past max_runs")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert "draining" in (exc.details() or "")
        third.join(timeout=30.0)
        assert [r.stdout for r in last] == [b"slow done\n"]  # the accepted run finished
        assert wait_until(lambda: pool.popen.poll() is not None, 30.0, "the pool to exit") is not None
        assert pool.popen.returncode == 0
        assert "recycling after 3 runs" in pool.log()


def test_a_call_waits_for_the_fresh_process(tmp_path: Path) -> None:
    with running_pool(tmp_path / "first", max_runs=1) as first:
        client = PoolSandbox(first.client_settings)
        assert client.run("print('first')", b"", LIMITS).stdout == b"first\n"
        wait_until(lambda: first.popen.poll() is not None, 30.0, "the first pool to exit after its one run")
        assert first.popen.returncode == 0
        results: list[RunResult] = []
        waiting = threading.Thread(target=lambda: results.append(client.run("print('second')", b"", LIMITS)))
        waiting.start()  # no pool listens now: the call waits for one
        fresh: PoolProcess = spawn(tmp_path / "second", first.grpc_port, first.http_port, {"max_runs": 5})
        try:
            wait_ready(fresh)
            waiting.join(timeout=60.0)
            assert [r.stdout for r in results] == [b"second\n"]
            assert client.describe().num_runs == 1
        finally:
            stop(fresh)
