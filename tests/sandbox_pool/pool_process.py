"""A real ``asymptote sandbox-pool`` process on loopback, for the tests: start, wait ready, read metrics, stop."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from asymptote.contracts.v1 import sandbox_pb2_grpc
from asymptote.lifecycle import die_with_parent
from asymptote.nats_local import free_port
from asymptote.sandbox import PoolClientSettings
from tests.helpers.waiting import wait_until

START_TIMEOUT_S = 60.0
"""The self-test and imports on a loaded 2-core machine."""


@dataclass
class PoolProcess:
    popen: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def client_settings(self) -> PoolClientSettings:
        return PoolClientSettings(endpoint=self.endpoint, queue_wait_s=30.0)

    def stub(self) -> tuple[grpc.Channel, sandbox_pb2_grpc.SandboxPoolStub]:
        """A raw stub (no retries): each status as the pool answers it."""
        channel = grpc.insecure_channel(self.endpoint)
        return channel, sandbox_pb2_grpc.SandboxPoolStub(channel)

    def readyz(self) -> int:
        """/readyz's status, 0 when the HTTP server does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2.0) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5.0) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def spawn(folder: Path, grpc_port: int, http_port: int, config: dict[str, Any]) -> PoolProcess:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sandbox-pool.yaml"
    full = {"grpc": {"port": grpc_port}, "http": {"port": http_port}, "log_format": "text", **config}
    path.write_text(yaml.safe_dump(full))
    log_path = folder / f"sandbox-pool-{grpc_port}.log"
    with log_path.open("ab") as fh:
        popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "sandbox-pool", "--config", str(path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
    return PoolProcess(popen, grpc_port, http_port, log_path)


def wait_ready(pool: PoolProcess) -> None:
    def ready() -> bool:
        if pool.popen.poll() is not None:
            raise AssertionError(f"the sandbox pool exited with {pool.popen.returncode}:\n{pool.log()}")
        return pool.readyz() == 200

    wait_until(ready, START_TIMEOUT_S, "the sandbox pool to be ready")


def stop(pool: PoolProcess) -> None:
    if pool.popen.poll() is None:
        pool.popen.terminate()
        try:
            pool.popen.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            pool.popen.kill()
            pool.popen.wait()


@contextmanager
def running_pool(folder: Path, **config: Any) -> Iterator[PoolProcess]:
    """A ready pool with ``config`` over the defaults; stopped on leaving."""
    pool = spawn(folder, free_port(), free_port(), config)
    try:
        wait_ready(pool)
        yield pool
    finally:
        stop(pool)
