"""``asymptote sandbox-pool`` over real gRPC on loopback, with the real sandbox.

One pool process for the module (two programs at once, one more queued,
small caps): the same RunResult as the local sandbox on the same
programs; each kind of bad input refused with its code and a message
naming the field, the service still serving after; the concurrency cap
measured from inside the programs (their own start and end times) and the
queue limit's RESOURCE_EXHAUSTED; refusals and outcomes counted in
/metrics.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pool_process import PoolProcess, running_pool

from asymptote.contracts.v1 import sandbox_pb2
from asymptote.sandbox import Limits, RunResult, SandboxSettings, sandbox_for
from asymptote.sandbox.remote import PoolSandbox, SandboxPoolError, limits_to_proto
from tests.helpers.waiting import wait_until

CONFIG = {
    "max_concurrent_runs": 2,
    "max_queued_runs": 1,
    "max_program_bytes": 8192,
    "max_stdin_bytes": 4096,
    "max_limits": {"timeout_s": 20.0, "memory_mib": 2048, "output_bytes": 1 << 20},
}
LIMITS = Limits(timeout_s=5.0, memory_mib=512, output_bytes=1 << 16)

PROGRAMS: dict[str, tuple[str, bytes, Limits]] = {
    "prints": ("print('hello', 6 * 7)", b"", LIMITS),
    "echoes stdin": ("import sys\nprint(sys.stdin.read().upper(), end='')", b"two words\n", LIMITS),
    "exits 3": ("import sys\nsys.exit(3)", b"", LIMITS),
    "raises": ("raise ValueError('boom')", b"", LIMITS),
    "killed by a signal": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", b"", LIMITS),
    "loops past its deadline": ("while True:\n    pass", b"", Limits(timeout_s=0.5)),
    "floods stdout": ("import sys\nsys.stdout.write('x' * 2_000_000)", b"", LIMITS),
    "reads a host file": ("print(open('/etc/shadow').read())", b"", LIMITS),
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    with running_pool(tmp_path_factory.mktemp("pool"), **CONFIG) as p:
        yield p


def _same(local: RunResult, remote: RunResult) -> dict[str, object]:
    """The fields of two results that differ (time aside; the bytes written by a program killed mid-write)."""
    fields = ["backend", "exit_code", "signal", "killed", "stdout", "stderr"]
    if local.killed is None:
        fields.append("stdout_bytes")
    return {f: (getattr(local, f), getattr(remote, f)) for f in fields if getattr(local, f) != getattr(remote, f)}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_same_result_as_the_local_sandbox(pool: PoolProcess, name: str) -> None:
    program, stdin, limits = PROGRAMS[name]
    local = sandbox_for(SandboxSettings()).run(program, stdin, limits)
    remote = PoolSandbox(pool.client_settings).run(program, stdin, limits)
    assert _same(local, remote) == {}
    assert remote.time_s > 0.0


def test_outcomes_as_expected(pool: PoolProcess) -> None:
    client = PoolSandbox(pool.client_settings)
    assert client.name == sandbox_for(SandboxSettings()).name
    ok = client.run(*PROGRAMS["prints"])
    assert (ok.exit_code, ok.stdout) == (0, b"hello 42\n")
    timeout = client.run(*PROGRAMS["loops past its deadline"])
    assert timeout.killed == "timeout"
    assert 0.5 <= timeout.time_s < 0.5 + 1.0  # the deadline kept (the runner's kill, not the client's)
    flood = client.run(*PROGRAMS["floods stdout"])
    assert flood.killed == "output_limit"
    assert len(flood.stdout) == 1 << 16 and flood.stdout_bytes > 1 << 16


def _run(pool: PoolProcess, request: sandbox_pb2.RunRequest) -> grpc.RpcError:
    channel, stub = pool.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Run(request, timeout=30.0)
    return caught.value


@pytest.mark.parametrize(
    ("request_fields", "reason", "needle"),
    [
        ({"program": "#" * 9000}, "program_too_large", "program is 9000 bytes, above max_program_bytes 8192"),
        (
            {"program": "pass", "stdin": b"x" * 5000},
            "stdin_too_large",
            "stdin is 5000 bytes, above max_stdin_bytes 4096",
        ),
        (
            {"program": "pass", "limits": sandbox_pb2.SandboxLimits(memory_mib=4096)},
            "above_cap",
            "limits.memory_mib is 4096, above this pool's cap of 2048 (max_limits.memory_mib)",
        ),
        (
            {"program": "pass", "limits": sandbox_pb2.SandboxLimits(timeout_s=-1.0)},
            "bad_limits",
            "limits.timeout_s: Input should be greater than 0",
        ),
        (
            {"program": "pass", "limits": sandbox_pb2.SandboxLimits(memory_mib=10)},
            "bad_limits",
            "limits.memory_mib: Input should be greater than or equal to 64",
        ),
    ],
)
def test_bad_input_refused_and_still_serving(
    pool: PoolProcess, request_fields: dict[str, object], reason: str, needle: str
) -> None:
    before = pool.sample("asymptote_sandbox_pool_refusals_total", reason=reason)
    error = _run(pool, sandbox_pb2.RunRequest(**request_fields))  # type: ignore[arg-type]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (error.details() or "")
    assert pool.sample("asymptote_sandbox_pool_refusals_total", reason=reason) == before + 1
    ok = PoolSandbox(pool.client_settings).run("print(1)", b"", LIMITS)
    assert (ok.exit_code, ok.stdout) == (0, b"1\n")


def test_malformed_message_refused_and_still_serving(pool: PoolProcess) -> None:
    channel = grpc.insecure_channel(pool.endpoint)
    with channel:
        raw = channel.unary_unary("/asymptote.contracts.v1.SandboxPool/Run")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff\xff\x0f not protobuf", timeout=10.0)
    # gRPC's own answer to a request its deserializer refuses: the servicer never sees it.
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "Error parsing message with type 'asymptote.contracts.v1.RunRequest'" in (caught.value.details() or "")
    assert pool.popen.poll() is None
    ok = PoolSandbox(pool.client_settings).run("print(2)", b"", LIMITS)
    assert ok.stdout == b"2\n"


def test_client_raises_on_refusal_without_retrying(pool: PoolProcess) -> None:
    with pytest.raises(SandboxPoolError, match=r"INVALID_ARGUMENT: program is 9000 bytes"):
        PoolSandbox(pool.client_settings).run("#" * 9000, b"", LIMITS)


TIMED = """
import json, time
start = time.monotonic()
time.sleep({sleep_s})
print(json.dumps([start, time.monotonic()]))
"""


def test_concurrency_cap_and_queue_limit(pool: PoolProcess) -> None:
    """Two run at once (measured from inside), one waits, and a fourth finds the queue full."""
    results: list[RunResult] = []
    lock = threading.Lock()

    def call() -> None:
        result = PoolSandbox(pool.client_settings).run(TIMED.format(sleep_s=2.0), b"", LIMITS)
        with lock:
            results.append(result)

    waited_before = pool.sample("asymptote_sandbox_pool_wait_seconds_sum")
    full_before = pool.sample("asymptote_sandbox_pool_refusals_total", reason="queue_full")
    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(
        lambda: (
            pool.sample("asymptote_sandbox_pool_queued") == 1 and pool.sample("asymptote_sandbox_pool_running") == 2
        ),
        20.0,
        "two runs running and one queued",
    )
    error = _run(pool, sandbox_pb2.RunRequest(program="pass", limits=limits_to_proto(LIMITS)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 runs running and 1 queued" in (error.details() or "")
    assert pool.sample("asymptote_sandbox_pool_refusals_total", reason="queue_full") == full_before + 1
    for t in threads:
        t.join(timeout=30.0)
    assert [r.exit_code for r in results] == [0, 0, 0]
    spans = sorted(tuple(json.loads(r.stdout)) for r in results)
    # At most two at once: the third started only after one of the first two had ended.
    overlap = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert overlap == 2
    assert spans[2][0] >= min(spans[0][1], spans[1][1])
    waited = pool.sample("asymptote_sandbox_pool_wait_seconds_sum") - waited_before
    assert waited >= 1.5, f"the queued run waited {waited:.2f}s for a slot"


def test_metrics_count_outcomes(pool: PoolProcess) -> None:
    backend = PoolSandbox(pool.client_settings).name
    before = {
        o: pool.sample("asymptote_sandbox_pool_runs_total", backend=backend, outcome=o) for o in ("ok", "exit_nonzero")
    }
    count_before = pool.sample("asymptote_sandbox_pool_run_seconds_count")
    client = PoolSandbox(pool.client_settings)
    client.run(*PROGRAMS["prints"])
    client.run(*PROGRAMS["exits 3"])
    client.run(*PROGRAMS["exits 3"])
    assert pool.sample("asymptote_sandbox_pool_runs_total", backend=backend, outcome="ok") == before["ok"] + 1
    assert (
        pool.sample("asymptote_sandbox_pool_runs_total", backend=backend, outcome="exit_nonzero")
        == before["exit_nonzero"] + 2
    )
    assert pool.sample("asymptote_sandbox_pool_run_seconds_count") == count_before + 3
    assert pool.sample("asymptote_sandbox_pool_backend", backend=backend) == 1.0


def test_describe(pool: PoolProcess) -> None:
    info = PoolSandbox(pool.client_settings).describe()
    assert (info.max_concurrent_runs, info.max_queued_runs, info.max_program_bytes, info.max_runs) == (2, 1, 8192, 0)
    assert info.max_limits.memory_mib == 2048
    assert info.default_limits.timeout_s == 10.0


def test_bad_config_exits_2(tmp_path: Path) -> None:
    """Default limits above the caps: one line naming them, exit 2, before anything listens."""
    import subprocess
    import sys

    path = tmp_path / "pool.yaml"
    path.write_text("sandbox: {limits: {memory_mib: 4096}}\nmax_limits: {memory_mib: 2048}\n")
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "sandbox-pool", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "memory_mib is 4096, above this pool's cap of 2048" in done.stderr
