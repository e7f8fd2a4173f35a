"""``asymptote kube``: operate a run deployed with the Helm chart.

- ``status``: the release's pods by component (readiness, restarts), each
  generator's loaded policy version and the learner's, and the latest
  projection (A, B, C_mid with their intervals);
- ``scale POOL N``: sets a generator pool's replicas through the scale
  subresource of its Deployment, or of its StatefulSet for a pool on a
  weight fan-out tree (refused while an autoscaler owns the count, unless
  ``--force``);
- ``fetch RELEASE --to DIR``: the run's eval.jsonl, fit.json, curve.png,
  metrics.jsonl and, with ``--model``, an exported model (services/ops/kube_fetch.py);
- ``health HOST:PORT ...``: the standard gRPC health check of each endpoint
  (what the chart's ``helm test`` pod runs), over TLS (and mTLS) with
  ``--ca-file`` (and ``--cert-file``/``--key-file``), as the services dial.

``status``, ``scale`` and ``fetch`` talk to the Kubernetes API with the
official client (a kubeconfig, or the pod's service account in a cluster).
``status`` reads each service's ``/metrics`` from inside its pod, by a
command exec'd there (services/ops/podexec.py) that asks ``127.0.0.1``: the chart's
NetworkPolicies admit the metrics port only from Prometheus, so the API
server's pod and service proxy, which dials the pod's address, is refused,
while an exec never crosses the pod network. It needs RBAC ``create`` on
``pods/exec``, and no port-forward. ``health`` needs only gRPC, so it runs
from the slim images. This module knows the chart's labels, not the
services' internals.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asymptote.cli_args import ArgumentParser
from asymptote.config import TlsSettings
from asymptote.errors import ConfigError
from services.ops.labels import POOL_LABEL, release_selector

COMPONENTS = ("broker", "generator", "learner", "fitter")


@dataclass
class PodStatus:
    component: str
    name: str
    phase: str
    ready: bool
    containers_ready: str
    """Ready containers over all containers, e.g. "1/1"."""
    restarts: int
    node: str
    policy_version: int | None = None
    """The policy version a generator has loaded (or the learner's own); None if unknown."""
    metrics_error: str | None = None


@dataclass
class Projection:
    run: str
    fit_ok: bool
    num_points: int
    last_pass_rate: float
    params: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """name -> (value, low, high) for a, b, c_mid; empty until a fit succeeds."""
    projected: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(target compute, pass rate, low, high), by target compute."""


@dataclass
class ReleaseStatus:
    release: str
    namespace: str
    pods: list[PodStatus]
    projection: Projection | None
    projection_error: str | None = None


# -- reading the cluster --------------------------------------------------


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = samples.get(name)
    return values[0][1] if values else None


def projection_from_metrics(text: str) -> Projection | None:
    """The fitter's projection gauges (services/fitter/metrics.py); None if it exports none yet."""
    samples = metric_samples(text)
    ok = samples.get("asymptote_fitter_fit_ok")
    if not ok:
        return None
    labels, value = ok[0]
    projection = Projection(
        run=labels.get("run", ""),
        fit_ok=value == 1.0,
        num_points=int(_one(samples, "asymptote_fitter_points") or 0),
        last_pass_rate=_one(samples, "asymptote_fitter_last_pass_rate") or 0.0,
    )
    for name in ("a", "b", "c_mid"):
        mid, low, high = (_one(samples, f"asymptote_fitter_{name}{suffix}") for suffix in ("", "_low", "_high"))
        if mid is not None and low is not None and high is not None:
            projection.params[name] = (mid, low, high)
    by_compute: dict[float, dict[str, float]] = {}
    for labels, value in samples.get("asymptote_fitter_projected_pass_rate", []):
        by_compute.setdefault(float(labels["compute"]), {})[labels["bound"]] = value
    projection.projected = [
        (compute, b["mid"], b["low"], b["high"])
        for compute, b in sorted(by_compute.items())
        if {"mid", "low", "high"} <= b.keys()
    ]
    return projection


READ_METRICS = (
    "import sys, urllib.request; "
    "sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read())"
)
"""Prints the body of a URL: run by the pod's own Python (every image runs the services on one)."""


def metrics_command(port: int, timeout_s: float) -> list[str]:
    """What ``status`` runs in a pod to read its service's /metrics over the pod's loopback."""
    return ["python3", "-c", READ_METRICS, f"http://127.0.0.1:{port}/metrics", f"{timeout_s:g}"]


def _http_port(pod: Any) -> tuple[str, int] | None:
    """(container, port) of the pod's container serving ``http``, the port of /metrics."""
    for container in pod.spec.containers or []:
        for port in container.ports or []:
            if port.name == "http":
                return str(container.name), int(port.container_port)
    return None


def read_metrics(core: Any, namespace: str, pod: Any, timeout_s: float) -> str:
    """A pod's /metrics text, read inside the pod; ExecError (or LookupError: no http port) if it cannot be."""
    from services.ops.podexec import run_in_pod

    where = _http_port(pod)
    if where is None:
        raise LookupError(f"pod {pod.metadata.name} has no container port named http")
    container, port = where
    argv = metrics_command(port, timeout_s)
    return run_in_pod(core, namespace, pod.metadata.name, container, argv, timeout_s + 5.0).decode()


def _pod_status(pod: Any) -> PodStatus:
    labels = pod.metadata.labels or {}
    statuses = pod.status.container_statuses or []
    ready_conditions = [c for c in (pod.status.conditions or []) if c.type == "Ready"]
    return PodStatus(
        component=labels.get("app.kubernetes.io/component", "?"),
        name=pod.metadata.name,
        phase=pod.status.phase or "Unknown",
        ready=bool(ready_conditions and ready_conditions[0].status == "True"),
        containers_ready=f"{sum(1 for s in statuses if s.ready)}/{len(pod.spec.containers or [])}",
        restarts=sum(int(s.restart_count or 0) for s in statuses),
        node=pod.spec.node_name or "",
    )


def collect_status(core: Any, namespace: str, release: str, timeout_s: float = 10.0) -> ReleaseStatus:
    """Pods, policy versions and the projection of ``release`` (a CoreV1Api client).

    Each /metrics is read in turn: the kubernetes client's exec stream swaps
    a method of the shared API client while it opens, so two at once would race.
    """
    from services.ops.podexec import ExecError

    pods = core.list_namespaced_pod(namespace, label_selector=release_selector(release)).items
    order = {c: i for i, c in enumerate(COMPONENTS)}
    gauge = {"generator": "asymptote_generator_policy_version", "learner": "asymptote_learner_policy_version"}
    out: list[PodStatus] = []
    fitters: list[Any] = []
    for pod in pods:
        status = _pod_status(pod)
        if status.component not in order:
            continue  # e.g. the helm test pod
        if status.component == "fitter" and status.phase == "Running":
            fitters.append(pod)
        if status.component in gauge and status.phase == "Running":
            # A monitoring read: a pod that cannot answer is shown as such, never fails the report.
            try:
                version = _one(metric_samples(read_metrics(core, namespace, pod, timeout_s)), gauge[status.component])
                status.policy_version = None if version is None else int(version)
            except (ExecError, LookupError, ValueError) as exc:
                status.metrics_error = str(exc)
        out.append(status)
    out.sort(key=lambda p: (order[p.component], p.name))

    projection, error = None, "no running fitter pod in this release"
    if fitters:
        try:
            projection = projection_from_metrics(read_metrics(core, namespace, fitters[0], timeout_s))
            error = "" if projection else "the fitter exports no projection yet"
        except (ExecError, LookupError, ValueError) as exc:
            error = str(exc)
    return ReleaseStatus(release, namespace, out, projection, error or None)


def _reason(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or str(exc)
    return f"{status} {reason}" if status else str(reason)


SCALE_API = {"Deployment": "deployment", "StatefulSet": "stateful_set"}
"""The workload kinds of a generator pool (a StatefulSet on a weight fan-out tree) and their client names."""


@dataclass
class Workload:
    kind: str
    name: str
    pool: str


def generator_workload(apps: Any, namespace: str, release: str, pool: str = "generators") -> Workload:
    """The Deployment or StatefulSet of generator pool ``pool``; "generators" names the release's only pool."""
    selector = release_selector(release, "generator")
    found = [
        Workload(kind, obj.metadata.name, (obj.metadata.labels or {}).get(POOL_LABEL, ""))
        for kind, listing in (
            ("Deployment", apps.list_namespaced_deployment),
            ("StatefulSet", apps.list_namespaced_stateful_set),
        )
        for obj in listing(namespace, label_selector=selector).items
    ]
    pools = sorted(f"{w.pool} ({w.kind})" for w in found if w.pool)
    matches = found if pool == "generators" else [w for w in found if w.pool == pool]
    if len(matches) != 1:
        raise LookupError(
            f"expected one generator Deployment or StatefulSet of release {release!r} in namespace {namespace!r} "
            f"for {pool!r}, found {len(matches)}; its pools: {', '.join(pools) or 'none named'}"
        )
    return matches[0]


def autoscalers_of(autoscaling: Any, namespace: str, workload: Workload) -> list[str]:
    """HPAs (KEDA's included) whose target is ``workload``."""
    hpas = autoscaling.list_namespaced_horizontal_pod_autoscaler(namespace).items
    return sorted(
        h.metadata.name
        for h in hpas
        if h.spec.scale_target_ref.kind == workload.kind and h.spec.scale_target_ref.name == workload.name
    )


def scale_generators(
    apps: Any, autoscaling: Any, namespace: str, release: str, replicas: int, force: bool, pool: str = "generators"
) -> str:
    """Set a generator pool's replicas (scale subresource); returns what was done."""
    workload = generator_workload(apps, namespace, release, pool)
    owners = autoscalers_of(autoscaling, namespace, workload)
    if owners and not force:
        raise PermissionError(
            f"{workload.kind} {workload.name} is scaled by {', '.join(owners)}: it would undo this. Change the "
            "chart's autoscaling.minReplicas/maxReplicas (of generator or the pool), or pass --force"
        )
    api = SCALE_API[workload.kind]
    before = getattr(apps, f"read_namespaced_{api}_scale")(workload.name, namespace).spec.replicas
    body = {"spec": {"replicas": replicas}}
    scale = getattr(apps, f"patch_namespaced_{api}_scale")(workload.name, namespace, body)
    return f"{workload.kind.lower()}/{workload.name}: replicas {before} -> {scale.spec.replicas}"


# -- output ----------------------------------------------------------------


def format_status(status: ReleaseStatus) -> str:
    lines = [f"release {status.release} in namespace {status.namespace}", ""]
    header = ("COMPONENT", "POD", "READY", "STATUS", "RESTARTS", "POLICY VERSION", "NODE")
    rows = [header]
    for p in status.pods:
        version = (
            ""
            if p.component not in ("generator", "learner")
            else (str(p.policy_version) if p.policy_version is not None else f"? ({p.metrics_error or 'not exported'})")
        )
        rows.append((p.component, p.name, p.containers_ready, p.phase, str(p.restarts), version, p.node))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if not status.pods:
        lines.append("(no pods)")
    lines.append("")
    pr = status.projection
    if pr is None:
        lines.append(f"projection: unavailable ({status.projection_error})")
        return "\n".join(lines)
    lines.append(
        f"projection (run {pr.run}): latest fit {'ok' if pr.fit_ok else 'refused'}, {pr.num_points} points, "
        f"last held-out pass rate {pr.last_pass_rate:.3f}"
    )
    units = {"a": "", "b": "", "c_mid": " accelerator-s"}
    for name, (mid, low, high) in pr.params.items():
        lines.append(f"  {name:<6}{mid:.4g} [{low:.4g}, {high:.4g}]{units[name]}")
    for compute, mid, low, high in pr.projected:
        lines.append(f"  at {compute:.4g} accelerator-s: pass rate {mid:.3f} [{low:.3f}, {high:.3f}]")
    return "\n".join(lines)


# -- gRPC health -------------------------------------------------------------


def check_health(targets: list[str], timeout_s: float, tls: TlsSettings | None = None) -> dict[str, str]:
    """The gRPC health status of each ``host:port`` ("SERVING", or what went wrong).

    With ``tls`` turning TLS on for clients (a CA, or a client certificate
    for mTLS) every target is dialled with TLS, as the services dial each other.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from asymptote.rpc import channel_credentials

    credentials = channel_credentials(tls) if tls is not None and tls.client_enabled else None
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls is not None and tls.server_name else []

    def open_channel(target: str) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(target)
        return grpc.secure_channel(target, credentials, options=options)

    results: dict[str, str] = {}
    for target in targets:
        with open_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
                )
                results[target] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                results[target] = f"{exc.code().name}: {exc.details()}"
    return results


# -- command line ----------------------------------------------------------


def _clients(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from kubernetes import client, config

    if args.kubeconfig is None and args.context is None and _in_cluster():
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=args.kubeconfig, context=args.context)
    return client.CoreV1Api(), client.AppsV1Api(), client.AutoscalingV2Api()


def _in_cluster() -> bool:
    import os

    return "KUBERNETES_SERVICE_HOST" in os.environ


def _current_namespace(args: argparse.Namespace) -> str:
    if args.namespace:
        return str(args.namespace)
    from kubernetes import config

    try:
        _, context = config.list_kube_config_contexts(config_file=args.kubeconfig)
        return str(context["context"].get("namespace") or "default")
    except config.ConfigException:
        return "default"


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="asymptote kube", description="Operate a run deployed with the Helm chart.")
    sub = parser.add_subparsers(dest="command", required=True)

    def cluster_args(p: argparse.ArgumentParser, release_flag: bool = True) -> None:
        if release_flag:
            p.add_argument("--release", default="asymptote", help="Helm release name (default: asymptote)")
        p.add_argument("--namespace", "-n", help="namespace (default: the kubeconfig context's)")
        p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
        p.add_argument("--context", help="kubeconfig context")

    status = sub.add_parser("status", help="pods by component, policy versions, the latest projection")
    cluster_args(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout-s", type=float, default=10.0, help="seconds to wait for each pod's /metrics")
    scale = sub.add_parser("scale", help="set the number of generators of a pool (Deployment or StatefulSet)")
    scale.add_argument("target", help='a generator pool\'s name, or "generators" for the only pool')
    scale.add_argument("replicas", type=int)
    scale.add_argument("--force", action="store_true", help="scale even while an autoscaler owns the count")
    cluster_args(scale)
    fetch = sub.add_parser(
        "fetch", help="copy eval.jsonl, fit.json, curve.png, metrics.jsonl (and an exported model) out of the cluster"
    )
    fetch.add_argument("release", metavar="RELEASE", help="the Helm release")
    fetch.add_argument("--to", type=Path, required=True, help="local directory to copy into (created if missing)")
    fetch.add_argument(
        "--model",
        action="store_true",
        help="also run asymptote export in learner pod 0 and copy the model directory to DIR/model",
    )
    fetch.add_argument("--step", type=int, help="with --model: the checkpoint holding this step (default: newest)")
    fetch.add_argument(
        "--timeout-s", type=float, default=120.0, help="give up on a copy that sends nothing for this many seconds"
    )
    cluster_args(fetch, release_flag=False)
    health = sub.add_parser("health", help="gRPC health check of each HOST:PORT (the helm test)")
    health.add_argument("targets", nargs="+", metavar="HOST:PORT")
    health.add_argument("--timeout-s", type=float, default=10.0)
    health.add_argument("--ca-file", type=Path, help="CA (PEM) that verifies the servers; dials TLS")
    health.add_argument("--cert-file", type=Path, help="client certificate (PEM) for servers requiring one (mTLS)")
    health.add_argument("--key-file", type=Path, help="private key (PEM) of --cert-file")
    health.add_argument("--server-name", help="name expected in the servers' certificates instead of HOST")
    return parser


_TLS_FLAGS = ("ca_file", "cert_file", "key_file", "server_name")


def _health_tls(args: argparse.Namespace) -> TlsSettings:
    """The health check's TLS flags as a service's grpc_tls section, validated the same way."""
    from pydantic import ValidationError

    try:
        return TlsSettings(**{name: getattr(args, name) for name in _TLS_FLAGS})
    except ValidationError as exc:
        raise ConfigError("; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())) from exc


def _as_flags(message: str) -> str:
    """A grpc_tls error message in the health command's flag names."""
    for name in _TLS_FLAGS:
        message = message.replace(f"grpc_tls.{name}", name).replace(name, "--" + name.replace("_", "-"))
    return message


def _check_health_args(args: argparse.Namespace) -> None:
    """ConfigError naming the argument when ``--timeout-s`` or a HOST:PORT target is malformed."""
    if not math.isfinite(args.timeout_s) or args.timeout_s <= 0:
        raise ConfigError(f"--timeout-s: must be a number of seconds > 0, got {args.timeout_s}")
    for target in args.targets:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"HOST:PORT {target!r}: expected a host and a port from 1 to 65535")


def _cluster_args_problem(args: argparse.Namespace) -> str:
    """What is wrong with a cluster subcommand's arguments, naming the argument; "" when nothing is."""
    if args.command == "scale" and args.replicas < 0:
        return f"replicas must be >= 0, got {args.replicas}"
    timeout_s = getattr(args, "timeout_s", 1.0)
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        return f"--timeout-s: must be a number of seconds > 0, got {timeout_s}"
    if args.command == "fetch":
        if args.step is not None and not args.model:
            return "--step: applies only with --model (the checkpoint to export)"
        if args.step is not None and args.step < 0:
            return f"--step: must be >= 0, got {args.step}"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "health":
        try:
            _check_health_args(args)
            results = check_health(args.targets, args.timeout_s, _health_tls(args))
        except ConfigError as exc:
            print(f"asymptote kube health: {_as_flags(str(exc))}", file=sys.stderr)
            return 2
        for target, result in results.items():
            print(f"{target}: {result}")
        return 0 if all(r == "SERVING" for r in results.values()) else 1
    problem = _cluster_args_problem(args)
    if problem:
        print(f"asymptote kube {args.command}: {problem}", file=sys.stderr)
        return 2

    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    from services.ops.podexec import ExecError

    try:
        core, apps, autoscaling = _clients(args)
        namespace = _current_namespace(args)
        if args.command == "status":
            status = collect_status(core, namespace, args.release, args.timeout_s)
            print(json.dumps(asdict(status), indent=2) if args.json else format_status(status))
        elif args.command == "fetch":
            from services.ops.kube_fetch import fetch, format_fetched

            fetched = fetch(core, namespace, args.release, args.to, args.model, args.step, args.timeout_s)
            print(format_fetched(fetched))
        else:
            print(scale_generators(apps, autoscaling, namespace, args.release, args.replicas, args.force, args.target))
            print(
                "warning: the next helm upgrade sets it back to the pool's replicas in the values; "
                "change generatorPools[].replicas to keep it",
                file=sys.stderr,
            )
    except ConfigError as exc:
        print(f"asymptote kube {args.command}: {exc}", file=sys.stderr)
        return 2
    except (LookupError, PermissionError, ExecError) as exc:
        print(f"asymptote kube {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ApiException, ConfigException, HTTPError) as exc:
        print(f"asymptote kube {args.command}: cannot reach the Kubernetes API: {_reason(exc)}", file=sys.stderr)
        return 2
    return 0
