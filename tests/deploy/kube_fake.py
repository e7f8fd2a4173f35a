"""A stand-in for the Kubernetes API server, for ``asymptote kube`` tests.

No API server can run on these machines, so a loopback HTTP server replays
responses recorded in the API's JSON format (tests/deploy/kube_api/) to the
real ``kubernetes`` client, and plays the parts of a cluster the CLI drives:

- **exec** (``pods/<pod>/exec``), over the API's WebSocket channel protocol
  (``v4.channel.k8s.io``: a channel byte before each frame, 1 stdout, 2
  stderr, 3 the exit status as a ``Status``). Each recorded pod is a folder
  standing for its run volume and, for a service that answers, a loopback
  HTTP server for its ``/metrics``: the command the CLI sends is run for
  real with the pod's paths and port mapped onto those, so a wrong path, a
  wrong port or a command that fails shows up as it would in the pod.
  ``asymptote export`` is played (the folder it would write, or its
  one-line refusal), since a real one needs a real checkpoint;
- **the API server's pod and service proxy** (``.../proxy/...``), answered
  as the chart's own NetworkPolicies (rendered with the Helm SDK) decide:
  the API server is no pod, so a policy admits it only through a rule with
  no ``from`` or an ``ipBlock``; otherwise the proxy times out dialling the pod;
- **scale subresources** of Deployments and StatefulSets, which a PATCH changes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

RECORDED = Path(__file__).parent / "kube_api"
NS, RELEASE, FULL = "rl", "lab", "lab-asymptote"
RUN_DIR = "/var/lib/asymptote/run"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
FRAME_BYTES = 16 * 1024
"""stdout is sent in frames of this size, so a copy spans many frames as a real one does."""


@dataclass
class FakePod:
    """What stands behind one recorded pod: its run volume and its service's /metrics."""

    run_dir: Path | None = None
    metrics: str | None = None
    """The /metrics body its service serves on 127.0.0.1; None: nothing listens (connection refused)."""
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps of the learner's committed checkpoints, for the played ``asymptote export``."""


@dataclass
class FakeApi:
    """The fake's state: what it serves, and every request it was sent."""

    url: str = ""
    pods: dict[str, FakePod] = field(default_factory=dict)
    policies: list[dict[str, Any]] = field(default_factory=list)
    hpas: str = "hpas-none.json"
    statefulsets: str = "statefulsets-generator.json"
    replicas: dict[str, int] = field(default_factory=dict)
    """Workload path (.../deployments/<name>) -> replicas its scale subresource reports."""
    exec_forbidden: bool = False
    tar_override: bytes | None = None
    """Sent instead of the stdout of the next tar-writing command (a pod sending a hostile archive)."""
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    execs: list[tuple[str, str, list[str]]] = field(default_factory=list)
    """(pod, container, argv) of every exec, in order."""
    metrics_url: str = ""


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits_api_server(policies: list[dict[str, Any]], labels: dict[str, str], port_name: str, port: int) -> bool:
    """Whether the API server's proxy may dial ``port`` of a pod with ``labels`` under ``policies``."""
    isolating = [
        p
        for p in policies
        if selects(p["spec"]["podSelector"], labels) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (port_name, port) for p in ports):
                continue
            peers = rule.get("from")
            # The API server is no pod: pod and namespace selectors never match it; an ipBlock may.
            if not peers or any("ipBlock" in peer for peer in peers):
                return True
    return False


def recorded_pods() -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in json.loads((RECORDED / "pods.json").read_text())["items"]}


def _http_port(pod: dict[str, Any]) -> int:
    return next(
        int(port["containerPort"])
        for c in pod["spec"]["containers"]
        for port in c.get("ports", [])
        if port["name"] == "http"
    )


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    status |= {"message": message, "reason": reason, "code": code}
    if details:
        status["details"] = details
    return status


def _played_export(argv: list[str], pod: FakePod) -> tuple[int, bytes, bytes]:
    """``asymptote export RUN --to DIR [--step N]`` as the learner image runs it (services/cli.py)."""
    assert argv[:2] == ["asymptote", "export"] and argv[3] == "--to", argv
    run, to = Path(argv[2]), Path(argv[4])
    step = int(argv[6]) if argv[5:6] == ["--step"] else None
    assert run == pod.run_dir and to.parent == run, argv
    if step is not None and step not in pod.checkpoint_steps:
        return (
            2,
            b"",
            f"asymptote export: --step {step}: the run's checkpoints hold steps {pod.checkpoint_steps}\n".encode(),
        )
    if to.exists() and any(to.iterdir()):
        return 2, b"", f"asymptote export: --to {to}: exists and is not an empty directory\n".encode()
    chosen = step if step is not None else max(pod.checkpoint_steps)
    to.mkdir(parents=True, exist_ok=True)
    (to / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}))
    (to / "model.safetensors").write_bytes(bytes(range(256)) * 1200 + chosen.to_bytes(4, "little"))
    (to / "tokenizer.json").write_text('{"version": "1.0"}')
    (to / "asymptote-export.json").write_text(json.dumps({"checkpoint": f"ckpt-{chosen:08d}", "step": chosen}))
    return 0, f"{to}\n".encode(), b"INFO export: model.safetensors (1 of 1 shards)\n"


class _Handler(BaseHTTPRequestHandler):
    state: FakeApi

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, code: int, reason: str, message: str) -> None:
        self._send(code, json.dumps(_status(code, reason, message)))

    def _scale(self, workload: str) -> dict[str, Any]:
        scale = json.loads((RECORDED / "scale-generator.json").read_text())
        scale["metadata"]["name"] = workload.rsplit("/", 1)[1]
        scale["spec"]["replicas"] = scale["status"]["replicas"] = self.state.replicas.setdefault(workload, 2)
        return scale

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        state = self.state
        state.requests.append(("GET", path, query))
        base, apps = f"/api/v1/namespaces/{NS}", f"/apis/apps/v1/namespaces/{NS}"
        recorded = {
            f"{base}/pods": "pods.json",
            f"{base}/services": "services-fitter.json",
            f"{apps}/deployments": "deployments-generator.json",
            f"{apps}/statefulsets": state.statefulsets,
            f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers": state.hpas,
        }
        if path.startswith(f"{base}/pods/") and path.endswith("/exec"):
            return self._exec(path.split("/")[-2], query)
        if "/proxy/" in path or path.endswith("/proxy"):
            return self._proxy(path)
        if path in recorded:
            listing = json.loads((RECORDED / recorded[path]).read_text())
            wanted = dict(term.split("=", 1) for term in query.get("labelSelector", [""])[0].split(",") if term)
            listing["items"] = [
                o for o in listing["items"] if selects({"matchLabels": wanted}, o["metadata"]["labels"])
            ]
            return self._send(200, json.dumps(listing))
        if path.startswith(apps) and path.endswith("/scale"):
            return self._send(200, json.dumps(self._scale(path.removesuffix("/scale"))))
        self._fail(404, "NotFound", f"the server could not find the requested resource ({path})")

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path = unquote(urlsplit(self.path).path)
        self.state.requests.append(("PATCH", path, {"body": body, "content-type": self.headers["Content-Type"]}))
        if not (path.startswith(f"/apis/apps/v1/namespaces/{NS}/") and path.endswith("/scale")):
            return self._fail(404, "NotFound", path)
        workload = path.removesuffix("/scale")
        self._scale(workload)
        self.state.replicas[workload] = int(body["spec"]["replicas"])
        self._send(200, json.dumps(self._scale(workload)))

    # -- the API server's proxy, as the chart's NetworkPolicies let it through -----------------

    def _proxy(self, path: str) -> None:
        pods = recorded_pods()
        kind, target = path.split("/")[5:7]
        name, _, port = target.partition(":")
        if kind == "services":
            # The fitter's Service: its endpoint is the fitter's pod.
            name = next(n for n in pods if n.startswith(f"{FULL}-fitter-"))
            port = "http"
        pod = pods[name]
        number = _http_port(pod)
        if admits_api_server(self.state.policies, pod["metadata"]["labels"], port, number):
            body = self.state.pods[name].metrics if name in self.state.pods else None
            if body is not None:
                return self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")
        self._fail(
            503, "ServiceUnavailable", f"error trying to reach service: dial tcp 10.8.3.17:{number}: i/o timeout"
        )

    # -- exec over the WebSocket channel protocol -------------------------------------------

    def _exec(self, name: str, query: dict[str, list[str]]) -> None:
        state = self.state
        argv, container = query.get("command", []), query.get("container", [""])[0]
        pods = recorded_pods()
        if state.exec_forbidden:
            return self._fail(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: User "lab" cannot create resource "pods/exec" in the namespace "{NS}"',
            )
        if name not in pods:
            return self._fail(404, "NotFound", f'pods "{name}" not found')
        if container not in [c["name"] for c in pods[name]["spec"]["containers"]]:
            return self._fail(400, "BadRequest", f"container {container} is not valid for pod {name}")
        state.execs.append((name, container, argv))
        code, out, err = self._run(name, pods[name], argv)
        if state.tar_override is not None and argv[:2] == ["python3", "-c"] and "tarfile" in argv[2]:
            out, state.tar_override = state.tar_override, None

        key = self.headers["Sec-WebSocket-Key"]
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header(
            "Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        )
        self.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
        self.end_headers()
        for i in range(0, len(out), FRAME_BYTES):
            self._frame(b"\x01" + out[i : i + FRAME_BYTES])
        if err:
            self._frame(b"\x02" + err)
        if code == 0:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        else:
            status = _status(
                0,
                "NonZeroExitCode",
                f"command terminated with non-zero exit code: error executing command {argv}, exit code {code}",
                {"causes": [{"reason": "ExitCode", "message": str(code)}]},
            )
            status.pop("kind"), status.pop("apiVersion"), status.pop("code")
        self._frame(b"\x03" + json.dumps(status).encode())
        self._frame((1000).to_bytes(2, "big"), opcode=0x8)
        self._read_close()
        self.close_connection = True

    def _frame(self, payload: bytes, opcode: int = 0x2) -> None:
        n = len(payload)
        if n < 126:
            head = bytes([0x80 | opcode, n])
        elif n < 1 << 16:
            head = bytes([0x80 | opcode, 126]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x80 | opcode, 127]) + n.to_bytes(8, "big")
        self.wfile.write(head + payload)

    def _read_close(self) -> None:
        """Wait for the client's close frame (a client frame is masked), as a server does before hanging up."""
        self.connection.settimeout(10)
        try:
            head = self.rfile.read(2)
            if len(head) == 2:
                # A close frame's payload (a status code and a short reason) is under 126 bytes.
                self.rfile.read(4 + (head[1] & 0x7F))
        except OSError:
            pass

    def _run(self, name: str, recorded: dict[str, Any], argv: list[str]) -> tuple[int, bytes, bytes]:
        """``argv`` run as the pod would: its run volume and its service's port mapped onto local ones."""
        pod = self.state.pods.get(name, FakePod())
        if argv[:2] == ["asymptote", "export"]:
            argv = [a.replace(RUN_DIR, str(pod.run_dir)) for a in argv]
            return _played_export(argv, pod)
        port = _http_port(recorded)
        # Nothing listens on port 9 of the loopback: a service that does not answer.
        served = f"{self.state.metrics_url}/{name}/" if pod.metrics is not None else "http://127.0.0.1:9/"
        mapped = [
            a.replace(RUN_DIR, str(pod.run_dir) if pod.run_dir else "/nonexistent-run-volume").replace(
                f"http://127.0.0.1:{port}/", served
            )
            for a in argv
        ]
        if mapped[0] == "python3":
            mapped[0] = sys.executable
        try:
            done = subprocess.run(mapped, capture_output=True, timeout=60, env={**os.environ, "LC_ALL": "C"})
        except FileNotFoundError:
            return 126, b"", f'exec: "{argv[0]}": executable file not found in $PATH\n'.encode()
        return done.returncode, done.stdout, done.stderr


class _MetricsHandler(BaseHTTPRequestHandler):
    state: FakeApi

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        name, _, rest = self.path.strip("/").partition("/")
        pod = self.state.pods.get(name)
        if rest != "metrics" or pod is None or pod.metrics is None:
            self.send_error(404)
            return
        data = pod.metrics.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def fake_api(state: FakeApi) -> Iterator[FakeApi]:
    """Serve ``state`` on loopback ports until the block ends."""
    handler = type("Handler", (_Handler,), {"state": state})
    metrics_handler = type("MetricsHandler", (_MetricsHandler,), {"state": state})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler), ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler)]
    state.url = f"http://127.0.0.1:{servers[0].server_address[1]}"
    state.metrics_url = f"http://127.0.0.1:{servers[1].server_address[1]}"
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield state
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
