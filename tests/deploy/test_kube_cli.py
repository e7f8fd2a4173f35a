"""``asymptote kube`` against recorded Kubernetes API responses.

No API server runs on these machines, so a loopback HTTP server replays
responses in the API's JSON format (tests/deploy/kube_api/) to the real
`kubernetes` client, configured from a kubeconfig file as a user's would
be; the services' /metrics bodies behind the API server's proxy come from
the services' own metric definitions. ``kube health`` checks real gRPC
health servers, plaintext and with TLS and mTLS.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml
from grpc_health.v1 import health_pb2
from pki import health_server, service_tls, tls_secret
from prometheus_client import generate_latest

from asymptote.contracts.v1 import services_pb2
from services.cli import main as cli
from services.fitter.collector import Snapshot
from services.fitter.metrics import ProjectionCollector, registry_with
from services.generator.metrics import GeneratorMetrics
from services.learner.metrics import LearnerMetrics

RECORDED = Path(__file__).parent / "kube_api"
NS, RELEASE, FULL = "rl", "lab", "lab-asymptote"
SELECTOR = "app.kubernetes.io/instance=lab,app.kubernetes.io/part-of=asymptote"


def generator_metrics(version: int) -> str:
    metrics = GeneratorMetrics()
    metrics.policy_version.set(version)
    metrics.tokens.labels("train").inc(1234)
    return generate_latest(metrics.registry).decode()


def learner_metrics(version: int) -> str:
    metrics = LearnerMetrics()
    metrics.policy_version.set(version)
    metrics.record_step({"loss": 0.1, "is/capped_frac": 0.002})
    return generate_latest(metrics.registry).decode()


def fitter_metrics() -> str:
    interval = services_pb2.Interval
    fit = services_pb2.Projection(
        ok=True,
        a=0.612,
        b=1.9,
        c_mid=32000.0,
        r0=0.21,
        a_interval=interval(low=0.58, high=0.64),
        b_interval=interval(low=1.5, high=2.4),
        c_mid_interval=interval(low=25000.0, high=41000.0),
        num_points_used=11,
        rmse=0.008,
        fitted_unix_s=1.79e9,
        projections=[
            services_pb2.ProjectedValue(compute=96000.0, pass_rate=0.55, interval=interval(low=0.53, high=0.57)),
            services_pb2.ProjectedValue(compute=480000.0, pass_rate=0.6, interval=interval(low=0.57, high=0.63)),
        ],
    )
    snapshot = Snapshot(projection=fit, last_ok=fit, num_points=12, last_compute=48000.0, last_pass_rate=0.47)
    collector = ProjectionCollector("cispo-8b", lambda: snapshot, lambda: {"generator": 40000.0, "learner": 8000.0})
    return generate_latest(registry_with(collector)).decode()


@dataclass
class FakeApi:
    """Replays recorded responses; records every request it was sent."""

    url: str
    hpas: str = "hpas-none.json"
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    replicas: int = 2


@pytest.fixture
def api() -> Iterator[FakeApi]:
    state = FakeApi(url="")
    proxied = {
        f"/api/v1/namespaces/{NS}/pods/{FULL}-generator-6f7d9c8b5-x2kfp:9102/proxy/metrics": generator_metrics(41),
        f"/api/v1/namespaces/{NS}/pods/{FULL}-learner-0:9103/proxy/metrics": learner_metrics(42),
        f"/api/v1/namespaces/{NS}/services/{FULL}-fitter:http/proxy/metrics": fitter_metrics(),
    }
    recorded = {
        f"/api/v1/namespaces/{NS}/pods": "pods.json",
        f"/api/v1/namespaces/{NS}/services": "services-fitter.json",
        f"/apis/apps/v1/namespaces/{NS}/deployments": "deployments-generator.json",
    }
    scale_path = f"/apis/apps/v1/namespaces/{NS}/deployments/{FULL}-generator/scale"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str, message: str) -> None:
            self._send(
                code,
                json.dumps(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    }
                ),
            )

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            state.requests.append(("GET", path, query))
            if path in proxied:
                self._send(200, proxied[path], "text/plain; version=0.0.4; charset=utf-8")
            elif path.endswith("/proxy/metrics"):
                # The unready generator: the API server's proxy gets no answer from it.
                self._status(503, "ServiceUnavailable", "error trying to reach service: connection refused")
            elif path in recorded:
                self._send(200, (RECORDED / recorded[path]).read_text())
            elif path == f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers":
                self._send(200, (RECORDED / state.hpas).read_text())
            elif path == scale_path:
                scale = json.loads((RECORDED / "scale-generator.json").read_text())
                scale["spec"]["replicas"] = state.replicas
                self._send(200, json.dumps(scale))
            else:
                self._status(404, "NotFound", f"the server could not find the requested resource ({path})")

        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = unquote(urlsplit(self.path).path)
            state.requests.append(("PATCH", path, {"body": body, "content-type": self.headers["Content-Type"]}))
            if path != scale_path:
                return self._status(404, "NotFound", path)
            state.replicas = int(body["spec"]["replicas"])
            scale = json.loads((RECORDED / "scale-generator.json").read_text())
            scale["spec"]["replicas"] = state.replicas
            self._send(200, json.dumps(scale))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def kubeconfig(api: FakeApi, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "lab",
                "clusters": [{"name": "lab", "cluster": {"server": api.url}}],
                "users": [{"name": "lab", "user": {"token": "recorded"}}],
                "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab", "namespace": NS}}],
            }
        )
    )
    return path


def test_status_reports_pods_versions_and_projection(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["kube", "status", "--release", RELEASE, "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("broker", "generator", "learner", "fitter"))]
    # By component, in the pipeline's order; the completed helm test pod is not a service.
    assert [r[0] for r in rows] == ["broker", "generator", "generator", "learner", "fitter"]
    by_pod = {r[1]: r for r in rows}
    ready_gen = by_pod[f"{FULL}-generator-6f7d9c8b5-x2kfp"]
    assert ready_gen[2:6] == ["1/1", "Running", "0", "41"]
    unready = by_pod[f"{FULL}-generator-6f7d9c8b5-7hzrw"]
    assert unready[2:5] == ["0/1", "Running", "2"] and "503" in " ".join(unready[5:])
    assert by_pod[f"{FULL}-learner-0"][5] == "42"
    assert "projection (run cispo-8b): latest fit ok, 12 points, last held-out pass rate 0.470" in out
    assert "a     0.612 [0.58, 0.64]" in out
    assert "c_mid 3.2e+04 [2.5e+04, 4.1e+04] accelerator-s" in out
    assert "at 4.8e+05 accelerator-s: pass rate 0.600 [0.570, 0.630]" in out
    # The namespace came from the kubeconfig context; the pods were listed by the release's labels.
    gets = [(p, q) for m, p, q in api.requests if m == "GET"]
    assert (f"/api/v1/namespaces/{NS}/pods", {"labelSelector": [SELECTOR]}) in gets
    assert (
        f"/api/v1/namespaces/{NS}/services",
        {"labelSelector": [SELECTOR + ",app.kubernetes.io/component=fitter"]},
    ) in gets


def test_status_json(api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["kube", "status", "--release", RELEASE, "-n", NS, "--kubeconfig", str(kubeconfig), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    versions = {p["name"]: p["policy_version"] for p in report["pods"] if p["component"] == "generator"}
    assert versions == {f"{FULL}-generator-6f7d9c8b5-x2kfp": 41, f"{FULL}-generator-6f7d9c8b5-7hzrw": None}
    assert {p["component"]: p["ready"] for p in report["pods"] if p["component"] != "generator"} == {
        "broker": True,
        "learner": True,
        "fitter": True,
    }
    projection = report["projection"]
    assert projection["params"]["a"] == [0.612, 0.58, 0.64]
    assert projection["params"]["b"] == [1.9, 1.5, 2.4]
    assert projection["projected"] == [[96000.0, 0.55, 0.53, 0.57], [480000.0, 0.6, 0.57, 0.63]]


def test_scale_generators_uses_the_scale_subresource(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["kube", "scale", "generators", "5", "--release", RELEASE, "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"{FULL}-generator: replicas 2 -> 5"
    assert "next helm upgrade sets it back" in out.err and "generatorPools[].replicas" in out.err
    patches = [q for m, p, q in api.requests if m == "PATCH"]
    assert patches == [{"body": {"spec": {"replicas": 5}}, "content-type": "application/strategic-merge-patch+json"}]
    assert api.replicas == 5
    # A pool the release does not have is named back with the pools it has.
    args = ["kube", "scale", "a100", "3", "--release", RELEASE, "--kubeconfig", str(kubeconfig)]
    assert cli(args) == 1
    assert "for 'a100', found 0" in capsys.readouterr().err
    assert api.replicas == 5


def test_scale_refuses_while_an_autoscaler_owns_the_count(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.hpas = "hpas-keda.json"
    args = ["kube", "scale", "generators", "8", "--release", RELEASE, "--kubeconfig", str(kubeconfig)]
    assert cli(args) == 1
    assert f"scaled by keda-hpa-{FULL}-generator" in capsys.readouterr().err
    assert not [r for r in api.requests if r[0] == "PATCH"] and api.replicas == 2
    assert cli([*args, "--force"]) == 0 and api.replicas == 8


def test_unknown_release_and_unreachable_api(
    api: FakeApi, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli(
            [
                "kube",
                "scale",
                "generators",
                "1",
                "--release",
                "other",
                "-n",
                "elsewhere",
                "--kubeconfig",
                str(kubeconfig),
            ]
        )
        == 2
    )  # 404 from the API: not this namespace
    assert "cannot reach the Kubernetes API: 404" in capsys.readouterr().err
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(kubeconfig.read_text().replace(api.url, "http://127.0.0.1:9"))
    assert cli(["kube", "status", "--kubeconfig", str(dead)]) == 2
    assert "cannot reach the Kubernetes API" in capsys.readouterr().err
    assert cli(["kube", "scale", "generators", "-1", "--kubeconfig", str(kubeconfig)]) == 2


@pytest.fixture
def health_servers() -> Iterator[dict[str, str]]:
    with health_server() as serving, health_server(status=health_pb2.HealthCheckResponse.NOT_SERVING) as draining:
        yield {"serving": serving, "draining": draining}


def test_health_checks_every_target(health_servers: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    serving, draining = health_servers["serving"], health_servers["draining"]
    assert cli(["kube", "health", serving]) == 0
    assert capsys.readouterr().out.strip() == f"{serving}: SERVING"
    assert cli(["kube", "health", "--timeout-s", "2", serving, draining, "127.0.0.1:9"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{serving}: SERVING"
    assert lines[1] == f"{draining}: NOT_SERVING"
    assert lines[2].startswith("127.0.0.1:9: UNAVAILABLE")


def test_health_dials_tls_and_mtls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ca-file`` dials TLS and verifies the server; ``--cert-file``/``--key-file`` satisfy mTLS."""
    secret = tls_secret(tmp_path / "grpc-tls", ["localhost"])
    other = tls_secret(tmp_path / "other", ["localhost"], ca_name="another CA")
    ca, cert, key = (
        f"--{flag}={secret / name}"
        for flag, name in (("ca-file", "ca.crt"), ("cert-file", "tls.crt"), ("key-file", "tls.key"))
    )
    with (
        health_server(service_tls(secret, require_client_cert=False)) as tls,
        health_server(service_tls(secret, require_client_cert=True)) as mtls,
    ):
        assert cli(["kube", "health", ca, "--server-name=localhost", tls]) == 0
        assert capsys.readouterr().out.strip() == f"{tls}: SERVING"
        assert cli(["kube", "health", ca, cert, key, "--server-name=localhost", tls, mtls]) == 0
        assert capsys.readouterr().out.splitlines() == [f"{tls}: SERVING", f"{mtls}: SERVING"]
        refused = [
            ["--timeout-s=2", tls],  # plaintext against TLS
            ["--timeout-s=2", ca, "--server-name=localhost", mtls],  # no client certificate
            ["--timeout-s=2", f"--ca-file={other / 'ca.crt'}", "--server-name=localhost", tls],  # another CA
            ["--timeout-s=2", ca, "--server-name=broker.example", tls],  # a name the certificate lacks
        ]
        for args in refused:
            assert cli(["kube", "health", *args]) == 1, args
            assert capsys.readouterr().out.startswith(f"{args[-1]}: UNAVAILABLE"), args
    # Half-set or unreadable TLS flags stop the check, naming the flag.
    assert cli(["kube", "health", cert, tls]) == 2
    assert "--cert-file and --key-file go together" in capsys.readouterr().err
    assert cli(["kube", "health", f"--ca-file={tmp_path / 'missing.crt'}", tls]) == 2
    assert "--ca-file: cannot read" in capsys.readouterr().err
    assert cli(["kube", "health", "--server-name=localhost", tls]) == 2
    assert "--server-name applies only with TLS" in capsys.readouterr().err
