"""``asymptote kube`` against recorded Kubernetes API responses.

No Kubernetes API server can run on these machines, so a fake one
(tests/deploy/kube_fake.py) replays responses recorded in the API's JSON
format (tests/deploy/kube_api/: a release with a Deployment pool, ``a100``,
and a StatefulSet pool on a weight fan-out tree, ``h100``) to the real
``kubernetes`` client, configured from a kubeconfig file as a user's would
be. It serves exec over the API's WebSocket protocol by running the CLI's
commands against folders and loopback servers standing for the pods, and
answers the API server's proxy as the chart's own NetworkPolicies (rendered
with the Helm SDK) decide. The services' /metrics bodies come from the
services' own metric definitions. ``kube health`` checks real gRPC health
servers, plaintext and with TLS and mTLS.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import render
from grpc_health.v1 import health_pb2
from kube_fake import FULL, NS, RELEASE, RUN_DIR, FakeApi, FakePod, admits_api_server, fake_api, recorded_pods
from pki import health_server, service_tls, tls_secret
from prometheus_client import generate_latest

from asymptote.contracts.v1 import services_pb2
from services.cli import main as cli
from services.fitter.collector import Snapshot
from services.fitter.metrics import ProjectionCollector, registry_with
from services.generator.metrics import GeneratorMetrics
from services.learner.metrics import LearnerMetrics

SELECTOR = "app.kubernetes.io/instance=lab,app.kubernetes.io/part-of=asymptote"
A100_READY, A100_UNREADY = f"{FULL}-generator-a100-6f7d9c8b5-x2kfp", f"{FULL}-generator-a100-6f7d9c8b5-7hzrw"
FITTER, LEARNER = f"{FULL}-fitter-7b8f6d9c4-m4n8s", f"{FULL}-learner-0"
DEPLOYMENTS, STATEFULSETS = f"/apis/apps/v1/namespaces/{NS}/deployments", f"/apis/apps/v1/namespaces/{NS}/statefulsets"


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


# What the run has written to the fitter's and the learner's run volumes.
RUN_FILES: dict[str, dict[str, str | bytes]] = {
    "fitter": {
        "eval.jsonl": "".join(
            json.dumps({"step": s, "policy_version": s, "compute": 400.0 * s, "pass_rate": 0.2 + 0.002 * s}) + "\n"
            for s in range(0, 120, 10)
        ),
        "fit.json": json.dumps({"ok": True, "a": 0.612, "b": 1.9, "c_mid": 32000.0}),
        "curve.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40,
    },
    "learner": {"metrics.jsonl": "".join(json.dumps({"step": s, "loss": 0.1 / s}) + "\n" for s in range(1, 201))},
}


def write_run(run_dir: Path, files: dict[str, str | bytes]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = run_dir / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeApi]:
    write_run(tmp_path / "pods" / "fitter", RUN_FILES["fitter"])
    write_run(tmp_path / "pods" / "learner", RUN_FILES["learner"])
    state = FakeApi(
        pods={
            A100_READY: FakePod(metrics=generator_metrics(41)),
            A100_UNREADY: FakePod(),  # starting: nothing listens yet
            f"{FULL}-generator-h100-0": FakePod(metrics=generator_metrics(40)),
            f"{FULL}-generator-h100-1": FakePod(metrics=generator_metrics(39)),
            LEARNER: FakePod(
                run_dir=tmp_path / "pods" / "learner", metrics=learner_metrics(42), checkpoint_steps=[100, 200]
            ),
            FITTER: FakePod(run_dir=tmp_path / "pods" / "fitter", metrics=fitter_metrics()),
        },
        # The chart's NetworkPolicies for this release: two pools, one on a fan-out tree.
        policies=render("weight-fanout-tree").of_kind("NetworkPolicy"),
    )
    with fake_api(state):
        yield state


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


# -- status -------------------------------------------------------------------


def test_status_reports_pods_versions_and_projection(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["kube", "status", "--release", RELEASE, "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("broker", "generator", "learner", "fitter"))]
    # By component, in the pipeline's order; the completed helm test pod is not a service.
    assert [r[0] for r in rows] == ["broker", *["generator"] * 4, "learner", "fitter"]
    by_pod = {r[1]: r for r in rows}
    assert by_pod[A100_READY][2:6] == ["1/1", "Running", "0", "41"]
    # The StatefulSet pool's pods, by ordinal, each with its own version.
    assert by_pod[f"{FULL}-generator-h100-0"][5] == "40" and by_pod[f"{FULL}-generator-h100-1"][5] == "39"
    unready = by_pod[A100_UNREADY]
    assert unready[2:5] == ["0/1", "Running", "2"] and "Connection refused" in " ".join(unready[5:])
    assert by_pod[LEARNER][5] == "42"
    assert "projection (run cispo-8b): latest fit ok, 12 points, last held-out pass rate 0.470" in out
    assert "a     0.612 [0.58, 0.64]" in out
    assert "c_mid 3.2e+04 [2.5e+04, 4.1e+04] accelerator-s" in out
    assert "at 4.8e+05 accelerator-s: pass rate 0.600 [0.570, 0.630]" in out
    # The namespace came from the kubeconfig context; the pods were listed by the release's labels.
    gets = [(p, q) for m, p, q in api.requests if m == "GET"]
    assert (f"/api/v1/namespaces/{NS}/pods", {"labelSelector": [SELECTOR]}) in gets


def test_status_reads_metrics_inside_the_pods_which_the_chart_policy_allows(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The chart's NetworkPolicies refuse the API server's proxy on every service's metrics port,
    so status reads /metrics from inside each pod (exec), on the port the pod declares."""
    pods = recorded_pods()
    for name in (A100_READY, f"{FULL}-generator-h100-0", LEARNER, FITTER):
        labels = pods[name]["metadata"]["labels"]
        assert not admits_api_server(api.policies, labels, "http", 9102), name
    # The same policies with the API server's address range in metricsFrom would let it through:
    # the check above is about the chart's rules, not a fake that refuses everything.
    opened = render("weight-fanout-tree").of_kind("NetworkPolicy")
    for policy in opened:
        for rule in policy["spec"].get("ingress", []):
            if {"port": "http", "protocol": "TCP"} in rule.get("ports", []):
                rule["from"].append({"ipBlock": {"cidr": "172.16.0.0/12"}})
    assert admits_api_server(opened, pods[FITTER]["metadata"]["labels"], "http", 9104)

    assert cli(["kube", "status", "--release", RELEASE, "--kubeconfig", str(kubeconfig), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not [p for _, p, _ in api.requests if "/proxy" in p]
    execs = {pod: (container, argv) for pod, container, argv in api.execs}
    # One exec per running generator and learner, one for the fitter's projection; not the broker.
    assert sorted(execs) == sorted([*(n for n in pods if "-generator-" in n), LEARNER, FITTER])
    for pod, (container, argv) in execs.items():
        assert container == pods[pod]["spec"]["containers"][0]["name"]
        http = next(p["containerPort"] for p in pods[pod]["spec"]["containers"][0]["ports"] if p["name"] == "http")
        assert argv[0] == "python3" and argv[3] == f"http://127.0.0.1:{http}/metrics"
    versions = {p["name"]: p["policy_version"] for p in report["pods"] if p["component"] == "generator"}
    assert versions == {
        A100_READY: 41,
        A100_UNREADY: None,
        f"{FULL}-generator-h100-0": 40,
        f"{FULL}-generator-h100-1": 39,
    }
    assert report["projection"]["params"]["a"] == [0.612, 0.58, 0.64]
    assert report["projection"]["params"]["b"] == [1.9, 1.5, 2.4]
    assert report["projection"]["projected"] == [[96000.0, 0.55, 0.53, 0.57], [480000.0, 0.6, 0.57, 0.63]]


def test_status_without_exec_rights_says_so(api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> None:
    api.exec_forbidden = True
    assert cli(["kube", "status", "--release", RELEASE, "--kubeconfig", str(kubeconfig), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    errors = [p["metrics_error"] for p in report["pods"] if p["component"] in ("generator", "learner")]
    assert len(errors) == 5 and all("403" in e and "pods/exec" in e for e in errors)
    assert report["projection"] is None and "pods/exec" in report["projection_error"]


# -- scale --------------------------------------------------------------------


def patches(api: FakeApi) -> list[tuple[str, Any]]:
    return [(p, q) for m, p, q in api.requests if m == "PATCH"]


def test_scale_a_deployment_pool_and_a_statefulset_pool(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--release", RELEASE, "--kubeconfig", str(kubeconfig)]
    assert cli(["kube", "scale", "a100", "5", *base]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"deployment/{FULL}-generator-a100: replicas 2 -> 5"
    assert "next helm upgrade sets it back" in out.err and "generatorPools[].replicas" in out.err
    # The fan-out pool is a StatefulSet: its own scale subresource.
    assert cli(["kube", "scale", "h100", "4", *base]) == 0
    assert capsys.readouterr().out.strip() == f"statefulset/{FULL}-generator-h100: replicas 2 -> 4"
    merge = "application/strategic-merge-patch+json"
    assert patches(api) == [
        (f"{DEPLOYMENTS}/{FULL}-generator-a100/scale", {"body": {"spec": {"replicas": 5}}, "content-type": merge}),
        (f"{STATEFULSETS}/{FULL}-generator-h100/scale", {"body": {"spec": {"replicas": 4}}, "content-type": merge}),
    ]
    assert api.replicas == {f"{DEPLOYMENTS}/{FULL}-generator-a100": 5, f"{STATEFULSETS}/{FULL}-generator-h100": 4}
    # "generators" names the only pool; this release has two, named back with their kinds.
    assert cli(["kube", "scale", "generators", "3", *base]) == 1
    err = capsys.readouterr().err
    assert "found 2; its pools: a100 (Deployment), h100 (StatefulSet)" in err
    assert cli(["kube", "scale", "v100", "3", *base]) == 1
    assert "for 'v100', found 0" in capsys.readouterr().err
    assert len(patches(api)) == 2
    # With the fan-out pool gone, "generators" is the Deployment pool.
    api.statefulsets = "hpas-none.json"  # an empty list
    assert cli(["kube", "scale", "generators", "3", *base]) == 0
    assert capsys.readouterr().out.strip() == f"deployment/{FULL}-generator-a100: replicas 5 -> 3"


def test_scale_refuses_while_an_autoscaler_owns_the_count(
    api: FakeApi, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.hpas = "hpas-keda.json"  # KEDA scales the StatefulSet pool
    base = ["--release", RELEASE, "--kubeconfig", str(kubeconfig)]
    assert cli(["kube", "scale", "h100", "8", *base]) == 1
    assert f"StatefulSet {FULL}-generator-h100 is scaled by keda-hpa-{FULL}-generator-h100" in capsys.readouterr().err
    assert not patches(api)
    # The other pool has no autoscaler.
    assert cli(["kube", "scale", "a100", "3", *base]) == 0
    assert cli(["kube", "scale", "h100", "8", *base, "--force"]) == 0
    assert api.replicas[f"{STATEFULSETS}/{FULL}-generator-h100"] == 8


def test_unknown_release_and_unreachable_api(
    api: FakeApi, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = ["--release", "other", "-n", "elsewhere", "--kubeconfig", str(kubeconfig)]
    assert cli(["kube", "scale", "generators", "1", *elsewhere]) == 2  # 404 from the API: not this namespace
    assert "cannot reach the Kubernetes API: 404" in capsys.readouterr().err
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(kubeconfig.read_text().replace(api.url, "http://127.0.0.1:9"))
    assert cli(["kube", "status", "--kubeconfig", str(dead)]) == 2
    assert "cannot reach the Kubernetes API" in capsys.readouterr().err
    assert cli(["kube", "scale", "generators", "-1", "--kubeconfig", str(kubeconfig)]) == 2
    assert "replicas must be >= 0, got -1" in capsys.readouterr().err
    assert cli(["kube", "status", "--timeout-s", "0", "--kubeconfig", str(kubeconfig)]) == 2
    assert "--timeout-s: must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


# -- fetch --------------------------------------------------------------------


def fetch_args(kubeconfig: Path, to: Path, *more: str) -> list[str]:
    return ["kube", "fetch", RELEASE, "--to", str(to), "--kubeconfig", str(kubeconfig), *more]


def test_fetch_copies_the_run_files_byte_for_byte(
    api: FakeApi, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    to = tmp_path / "results"
    assert cli(fetch_args(kubeconfig, to)) == 0
    out = capsys.readouterr().out.splitlines()
    expected: dict[str, str | bytes] = {**RUN_FILES["fitter"], **RUN_FILES["learner"]}
    assert sorted(p.name for p in to.iterdir()) == sorted(expected)
    for name, content in expected.items():
        data = content if isinstance(content, bytes) else content.encode()
        assert (to / name).read_bytes() == data, name
        assert f"{to / name}  {len(data):,} bytes" in out
    # From the fitter's pod and learner pod 0, each in its own container, out of the chart's run volume.
    assert [(pod, container, argv[3:]) for pod, container, argv in api.execs] == [
        (FITTER, "fitter", [RUN_DIR, "eval.jsonl", "fit.json", "curve.png"]),
        (LEARNER, "learner", [RUN_DIR, "metrics.jsonl"]),
    ]
    # A file the run has not written yet is named, and the copy still succeeds; a second fetch refreshes.
    (api.pods[FITTER].run_dir / "curve.png").unlink()  # type: ignore[operator]
    (api.pods[FITTER].run_dir / "eval.jsonl").write_text("{}\n")  # type: ignore[operator]
    (to / "curve.png").unlink()
    assert cli(fetch_args(kubeconfig, to)) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"not written yet: curve.png (in pod {FITTER})" in out
    assert not (to / "curve.png").exists() and (to / "eval.jsonl").read_text() == "{}\n"
    assert not (to / ".fetch-tmp").exists()


def test_fetch_model_exports_in_the_learner_and_copies_it(
    api: FakeApi, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    to = tmp_path / "results"
    assert cli(fetch_args(kubeconfig, to, "--model")) == 0
    out = capsys.readouterr().out
    model = to / "model"
    assert sorted(p.name for p in model.iterdir()) == [
        "asymptote-export.json",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert json.loads((model / "asymptote-export.json").read_text())["step"] == 200  # the newest checkpoint
    weights = (model / "model.safetensors").read_bytes()
    assert len(weights) == 256 * 1200 + 4 and weights[-4:] == (200).to_bytes(4, "little")
    total = sum(p.stat().st_size for p in model.iterdir())
    assert f"{model}  {total:,} bytes" in out
    learner_execs = [argv for pod, _, argv in api.execs if pod == LEARNER]
    export_dir = f"{RUN_DIR}/.asymptote-fetch-export"
    # metrics.jsonl, then: clear a leftover export, export, copy it, remove it.
    assert [argv[:2] if argv[0] == "python3" else argv for argv in learner_execs] == [
        ["python3", "-c"],
        ["rm", "-rf", export_dir],
        ["asymptote", "export", RUN_DIR, "--to", export_dir],
        ["python3", "-c"],
        ["rm", "-rf", export_dir],
    ]
    assert learner_execs[0][3:] == [RUN_DIR, "metrics.jsonl"]
    assert learner_execs[3][3:] == [RUN_DIR, ".asymptote-fetch-export"]
    # The export does not stay on the learner's volume.
    assert not (api.pods[LEARNER].run_dir / ".asymptote-fetch-export").exists()  # type: ignore[operator]

    # A checkpoint the run does not hold: export's own one line, and the volume cleaned all the same.
    again = tmp_path / "again"
    assert cli(fetch_args(kubeconfig, again, "--model", "--step", "7")) == 1
    err = capsys.readouterr().err
    assert "asymptote export in pod lab-asymptote-learner-0 (container learner): exited 2" in err
    assert "--step 7: the run's checkpoints hold steps [100, 200]" in err
    assert [argv for pod, _, argv in api.execs if pod == LEARNER][-1] == ["rm", "-rf", export_dir]
    assert cli(fetch_args(kubeconfig, tmp_path / "third", "--model", "--step", "100")) == 0
    assert json.loads((tmp_path / "third" / "model" / "asymptote-export.json").read_text())["step"] == 100


def test_fetch_refuses_bad_arguments_and_hostile_archives(
    api: FakeApi, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    to = tmp_path / "results"
    assert cli(fetch_args(kubeconfig, to, "--step", "100")) == 2
    assert "--step: applies only with --model" in capsys.readouterr().err
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert cli(fetch_args(kubeconfig, a_file)) == 2
    assert f"--to {a_file}: exists and is not a directory" in capsys.readouterr().err
    (to / "model").mkdir(parents=True)
    (to / "model" / "config.json").write_text("{}")
    assert cli(fetch_args(kubeconfig, to, "--model")) == 2
    assert "model exists and is not empty" in capsys.readouterr().err
    assert not api.execs  # nothing ran in a pod for a refused command line

    # A pod that sends a member outside the destination: refused, nothing written outside.
    hostile = io.BytesIO()
    with tarfile.open(fileobj=hostile, mode="w") as tar:
        data = b"not yours"
        member = tarfile.TarInfo("../escaped.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    api.tar_override = hostile.getvalue()
    assert cli(fetch_args(kubeconfig, tmp_path / "safe")) == 1
    assert "sent no readable tar stream" in capsys.readouterr().err
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "safe" / "escaped.txt").exists()

    api.exec_forbidden = True
    assert cli(fetch_args(kubeconfig, tmp_path / "denied")) == 1
    assert "403" in (err := capsys.readouterr().err) and "RBAC create on pods/exec" in err


# -- health -------------------------------------------------------------------


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
