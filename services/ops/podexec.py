"""A command run in a pod's container through the Kubernetes API's exec
stream, as ``kubectl exec`` and ``kubectl cp`` run theirs: its stdout read
as a byte stream while it runs, its stderr and exit status at the end.

The API server relays the stream to the node's kubelet, which starts the
process inside the container: nothing crosses the pod's network, so the
pod's NetworkPolicies neither allow nor block it (they govern traffic to and
from pod addresses, which the API server's service and pod proxy use). The
caller needs RBAC ``create`` on ``pods/exec`` in the namespace. This module
knows nothing of the chart or the services.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

STDOUT, STDERR, STATUS = 1, 2, 3
"""The exec stream's channels (the API's ``v4.channel.k8s.io`` protocol)."""
STDERR_KEPT_BYTES = 64 * 1024
"""The tail of a command's stderr kept for its error message."""


class ExecError(RuntimeError):
    """A command in a pod could not start, failed, or went quiet; the message names the pod and the command."""


class _Discard:
    """Stands in for the exec client's copy of everything a command printed (see ``PodCommand``)."""

    def write(self, _data: bytes) -> None:
        pass

    def getvalue(self) -> bytes:
        return b""


class PodCommand(io.RawIOBase):
    """A command running in a pod: ``read`` its stdout; ``wait`` for its end, ExecError unless it exited 0.

    ``idle_timeout_s``: how long a read waits for the next stdout bytes
    before giving up (ExecError), so a stuck command never hangs the caller.
    """

    def __init__(self, client: Any, what: str, idle_timeout_s: float) -> None:
        super().__init__()
        self._client = client
        self.what = what
        self._idle_timeout_s = idle_timeout_s
        self._pending = b""
        self._stderr = b""
        self._eof = False
        # The client keeps a copy of all stdout and stderr unless told otherwise, and the
        # kubernetes client's stream() cannot tell it: a model's gigabytes would pile up in memory.
        client._all = _Discard()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not self._pending and not self._eof:
            self._pending = self._next_stdout()
            self._eof = not self._pending
        n = min(len(view), len(self._pending))
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _next_stdout(self) -> bytes:
        """The next stdout bytes, b"" once the command's stream has ended."""
        from websocket import WebSocketConnectionClosedException

        deadline = time.monotonic() + self._idle_timeout_s
        while True:
            try:
                data = bytes(self._client.read_channel(STDOUT, timeout=min(1.0, self._idle_timeout_s)))
                self._keep_stderr()
            except WebSocketConnectionClosedException:
                # The connection went without a close frame: what was buffered is all there is.
                self._client._connected = False
                data = bytes(self._client.read_channel(STDOUT))
            if data or not self._client.is_open():
                return data
            if time.monotonic() >= deadline:
                self._client.close()
                raise ExecError(f"{self.what}: no output for {self._idle_timeout_s:g} s{self._stderr_tail()}")

    def _keep_stderr(self) -> None:
        if self._client._channels.get(STDERR):
            self._stderr = (self._stderr + bytes(self._client.read_channel(STDERR)))[-STDERR_KEPT_BYTES:]

    def _stderr_tail(self) -> str:
        lines = self._stderr.decode("utf-8", "replace").strip().splitlines()
        return f": {lines[-1]}" if lines else ""

    @property
    def stderr(self) -> str:
        return self._stderr.decode("utf-8", "replace")

    def wait(self) -> None:
        """Read the rest of stdout (discarded), then ExecError unless the command exited 0."""
        while self.read(1 << 20):
            pass
        self._keep_stderr()
        status = self._client.read_channel(STATUS)
        self._client.close()
        if not status:
            raise ExecError(f"{self.what}: the stream ended without the command's exit status")
        report = json.loads(status)
        if report.get("status") == "Success":
            return
        causes = (report.get("details") or {}).get("causes") or []
        codes = [c.get("message") for c in causes if c.get("reason") == "ExitCode"]
        if codes:
            raise ExecError(f"{self.what}: exited {codes[0]}{self._stderr_tail()}")
        raise ExecError(f"{self.what}: {report.get('message') or report}")


def open_exec(
    core: Any, namespace: str, pod: str, container: str, argv: list[str], idle_timeout_s: float = 60.0
) -> PodCommand:
    """Start ``argv`` in ``container`` of ``pod`` (a CoreV1Api client); ExecError if the API refuses."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.stream import stream

    program = argv[0] if len(argv) < 2 or argv[1].startswith("-") else f"{argv[0]} {argv[1]}"
    what = f"{program} in pod {pod} (container {container})"
    try:
        client = stream(
            core.connect_get_namespaced_pod_exec,
            pod,
            namespace,
            command=argv,
            container=container,
            stdin=False,
            stdout=True,
            stderr=True,
            tty=False,
            binary=True,
            _preload_content=False,
        )
    except ApiException as exc:
        # The API answers the upgrade with an HTTP status: e.g. 403 without RBAC on pods/exec.
        reason = str(exc.reason or exc).split(" -+-+- ")[0]
        hint = "; exec needs RBAC create on pods/exec" if "403" in reason else ""
        raise ExecError(f"{what}: {reason}{hint}") from exc
    return PodCommand(client, what, idle_timeout_s)


def run_in_pod(
    core: Any, namespace: str, pod: str, container: str, argv: list[str], idle_timeout_s: float = 60.0
) -> bytes:
    """``argv``'s whole stdout (for small outputs); ExecError unless it exited 0."""
    command = open_exec(core, namespace, pod, container, argv, idle_timeout_s)
    out = command.read()
    command.wait()
    return out or b""
