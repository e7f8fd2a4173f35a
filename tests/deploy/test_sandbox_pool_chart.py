"""The sandbox pool in the chart: rendered only when enabled, locked down, and the generators pointed at it.

Rendered with the real Helm SDK: with sandboxPool on, a Deployment, a
Service, a PodDisruptionBudget and a NetworkPolicy that denies all egress
(DNS included) and admits gRPC only from the generators and the helm
test; no service-account token, a read-only root, every capability
dropped, RuntimeDefault seccomp, non-root, the runtime class from its
value; the pool's config loads with SandboxPoolConfig and the
generators' with GeneratorConfig, naming the pool's Service. Off (the
default), none of it exists and the generators run programs nowhere else.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import yaml
from chart_render import CHART, NAMESPACE, RELEASE, VALUE_SETS, Rendered, parse_manifests, render, with_images
from test_chart_contents import PODS, allowed

from services.generator.config import GeneratorConfig
from services.sandbox_pool.config import SandboxPoolConfig

NAME = f"{RELEASE}-asymptote-sandbox-pool"
SELECTOR = {"app.kubernetes.io/name": "asymptote", "app.kubernetes.io/instance": RELEASE}


def of(rendered: Rendered, name: str) -> list[dict[str, Any]]:
    return [o for o in rendered.objects if o["metadata"]["name"] == name]


def config(rendered: Rendered, name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(rendered.get("ConfigMap", name)["data"]["config.yaml"])
    return loaded


def generator_configs(rendered: Rendered) -> list[GeneratorConfig]:
    return [
        GeneratorConfig.model_validate(config(rendered, f"{RELEASE}-asymptote-generator-{pool}"))
        for pool in rendered.pools()
    ]


def test_off_by_default() -> None:
    for value_set in ("defaults", "grpc-mtls-cert-manager"):
        rendered = render(value_set)
        assert of(rendered, NAME) == []
        assert all(g.sandbox_pool is None for g in generator_configs(rendered))
        policy = rendered.get("NetworkPolicy", f"{RELEASE}-asymptote-generator")
        assert "sandbox-pool" not in yaml.safe_dump(policy)


def test_pod_is_locked_down() -> None:
    rendered = render("sandbox-pool-gvisor")
    assert sorted(o["kind"] for o in of(rendered, NAME)) == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
    ]
    deployment = rendered.get("Deployment", NAME)
    assert deployment["spec"]["replicas"] == 3
    spec = deployment["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["runAsNonRoot"] is True
    assert container["args"] == ["sandbox-pool", "--config", "/etc/asymptote/config/config.yaml"]
    assert container["image"].startswith("registry.example/asymptote-sandbox-pool@sha256:")
    assert set(container["resources"]) == {"requests", "limits"}
    assert {e["name"] for e in container.get("env", [])} == {"HOME"}  # nothing of the run's secrets


def test_egress_denied_and_ingress_only_from_generators() -> None:
    rendered = render("sandbox-pool-gvisor")
    policy = rendered.get("NetworkPolicy", NAME)["spec"]
    assert policy["podSelector"]["matchLabels"] == {**SELECTOR, "app.kubernetes.io/component": "sandbox-pool"}
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []  # no rule: no egress at all, DNS included
    grpc_rule, metrics_rule = policy["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in grpc_rule["from"]] == [
        "generator",
        "health-test",
    ]
    assert all(set(peer) == {"podSelector"} for peer in grpc_rule["from"])  # this release's pods, no namespaces
    assert metrics_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # Who may open a connection to whom, as the release's policies decide together.
    callers = {src for src in PODS if allowed(rendered, src, "sandbox-pool", 50091, "grpc")}
    assert callers == {"generator", "health-test"}
    ports = {"broker": 50051, "generator": 50061, "learner": 50071, "fitter": 50081}
    assert not [dst for dst, port in ports.items() if allowed(rendered, "sandbox-pool", dst, port, "grpc")]
    assert not [dst for dst in ports if allowed(rendered, "sandbox-pool", dst, 4222, "nats")]
    # The generators may reach it, on its gRPC port only.
    egress = rendered.get("NetworkPolicy", f"{RELEASE}-asymptote-generator")["spec"]["egress"]
    to_pool = [r for r in egress if any("sandbox-pool" in yaml.safe_dump(p) for p in r.get("to", []))]
    assert [r["ports"] for r in to_pool] == [[{"port": 50091, "protocol": "TCP"}]]


def test_configs_point_the_generators_at_the_pool() -> None:
    rendered = render("sandbox-pool-gvisor")
    pool = SandboxPoolConfig.model_validate(config(rendered, NAME))
    assert (pool.grpc.host, pool.grpc.port, pool.http.port) == ("0.0.0.0", 50091, 9105)
    assert (pool.max_concurrent_runs, pool.max_runs, pool.log_format) == (8, 5000, "json")
    assert pool.sandbox.unsafe_no_sandbox  # under gVisor no backend passes: the runtime class is the boundary
    assert pool.grpc_tls.require_client_cert and pool.grpc_tls.cert_file is not None
    endpoint = f"{NAME}.{NAMESPACE}.svc:50091"
    generators = generator_configs(rendered)
    assert generators
    for g in generators:
        assert g.sandbox_pool is not None
        assert g.sandbox_pool.endpoint == endpoint
        assert g.sandbox_pool.tls.ca_file is not None and g.sandbox_pool.tls.cert_file is not None
        assert g.task.verifier.kind == "code"  # type: ignore[union-attr]  # the task is the broker's, unchanged
        assert g.task.verifier.sandbox.pool is None  # type: ignore[union-attr]
    service = rendered.get("Service", NAME)
    assert service["spec"]["clusterIP"] == "None"  # headless: the clients spread calls over every pod
    assert service["spec"]["selector"] == {**SELECTOR, "app.kubernetes.io/component": "sandbox-pool"}
    assert [p["port"] for p in service["spec"]["ports"]] == [50091, 9105]
    (check,) = rendered.get("Pod", f"{RELEASE}-asymptote-health-test")["spec"]["containers"]
    assert endpoint in check["args"]
    assert f"{NAME}.{NAMESPACE}.svc" in rendered.get("Certificate", f"{RELEASE}-asymptote-grpc-tls")["spec"]["dnsNames"]


def test_runtime_class_and_security_contexts_follow_the_values() -> None:
    values = {
        **VALUE_SETS["defaults"],
        "sandboxPool": {
            "enabled": True,
            "runtimeClassName": "kata-qemu",
            "podSecurityContext": {
                "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/asymptote-sandbox.json"}
            },
        },
    }
    with helm.Chart.load(CHART) as chart:
        rendered = parse_manifests(chart.render(with_images(values), name=RELEASE, namespace=NAMESPACE))
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == NAME]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "kata-qemu"
    assert spec["securityContext"]["seccompProfile"]["type"] == "Localhost"
    assert spec["securityContext"]["runAsNonRoot"] is True  # the rest of the chart's context kept
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    no_class = {**VALUE_SETS["defaults"], "sandboxPool": {"enabled": True}}
    with helm.Chart.load(CHART) as chart:
        rendered = parse_manifests(chart.render(with_images(no_class), name=RELEASE, namespace=NAMESPACE))
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == NAME]
    assert "runtimeClassName" not in deployment["spec"]["template"]["spec"]


def test_notes_warn_of_a_runtime_class_under_which_no_backend_may_pass() -> None:
    """A pool under a runtime class becomes ready only if a backend passes there (under gVisor none
    does, and the pods exit 2): the notes say so, and what to set, unless unsafe_no_sandbox is set."""

    def notes(pool: dict[str, Any]) -> str:
        with helm.Chart.load(CHART) as chart:
            files = chart.render(with_images({"sandboxPool": pool}), name=RELEASE, namespace=NAMESPACE)
        return files["asymptote/templates/NOTES.txt"]

    warned = notes({"enabled": True, "runtimeClassName": "gvisor"})
    assert "The sandbox pool runs under runtime class gvisor" in warned
    assert "set sandboxPool.config.sandbox.unsafe_no_sandbox: true" in warned
    assert f"kubectl logs deploy/{NAME} --namespace {NAMESPACE}" in warned
    for quiet in (
        {"enabled": True, "runtimeClassName": "gvisor", "config": {"sandbox": {"unsafe_no_sandbox": True}}},
        {"enabled": True},  # the node's runtime: Landlock or bubblewrap, as the docs give them
        {"enabled": False, "runtimeClassName": "gvisor"},
    ):
        assert "runtime class" not in notes(quiet), quiet
    assert "runtime class" not in render("sandbox-pool-gvisor").files["asymptote/templates/NOTES.txt"]
