"""What the chart deploys: each service's config loads with the service's own
config model, the workloads sit on the right node pools with the probes,
volumes and security they need, gRPC runs over TLS from the mounted
certificate (the helm test too) whose names cover every host dialled,
generators scale on the broker's gauge, the network policies let exactly the
intended services talk, and the umbrella chart wires the services to the NATS
it installs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import (
    CHART,
    NAMESPACE,
    RELEASE,
    REPO,
    STACK_CHART,
    VALUE_SETS,
    Rendered,
    dashboard,
    parse_manifests,
    render,
    render_with,
    with_images,
)
from pki import health_server, service_tls, tls_secret
from pydantic import BaseModel

from asymptote.config import TlsSettings, load_config
from asymptote.jetstream.names import Names, stream_configs
from services.broker.config import BrokerConfig
from services.fitter.config import FitterConfig
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig, OptimizerSettings

MODELS: dict[str, type[BaseModel]] = {
    "broker": BrokerConfig,
    "generator": GeneratorConfig,
    "learner": LearnerConfig,
    "fitter": FitterConfig,
}
WORKLOAD_KIND = {"broker": "Deployment", "generator": "Deployment", "learner": "StatefulSet", "fitter": "Deployment"}
FULLNAME = f"{RELEASE}-asymptote"


def named(rendered: Rendered, component: str) -> str:
    """The name of a component's workload and ConfigMap: a generator's is its first pool's."""
    return f"generator-{rendered.pools()[0]}" if component == "generator" else component


def workload(rendered: Rendered, component: str) -> dict[str, Any]:
    return rendered.component(WORKLOAD_KIND[component], named(rendered, component))


def pod_spec(rendered: Rendered, component: str) -> dict[str, Any]:
    return dict(workload(rendered, component)["spec"]["template"]["spec"])


def pool_values(values: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """A generator pool's settings: the pool's keys over the shared generator ones (the chart merges config)."""
    pool = values["generatorPools"][index]
    merged = {**values["generator"], **pool}
    merged["config"] = values["generator"]["config"] | pool.get("config", {})
    merged["autoscaling"] = values["generator"]["autoscaling"] | pool.get("autoscaling", {})
    merged["gpus"] = pool.get("gpus", pool.get("tensorParallelSize", values["generator"]["gpus"]))
    return merged


def container(rendered: Rendered, component: str) -> dict[str, Any]:
    containers = pod_spec(rendered, component)["containers"]
    assert [c["name"] for c in containers] == [component]
    return dict(containers[0])


def secret_value(rendered: Rendered, ref: dict[str, str]) -> str:
    """A secretKeyRef's value: from the rendered Secret, or a stand-in for an existing one."""
    secrets = [s for s in rendered.of_kind("Secret") if s["metadata"]["name"] == ref["name"]]
    return str(secrets[0]["stringData"][ref["key"]]) if secrets else f"<{ref['name']}/{ref['key']}>"


def load_service_config(rendered: Rendered, component: str, tmp_path: Path) -> Any:
    """The service's config as the service itself loads it: the ConfigMap's file plus the pod's env."""
    config_map = rendered.component("ConfigMap", named(rendered, component))
    path = tmp_path / f"{component}.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    env = {}
    for var in container(rendered, component)["env"]:
        if "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = "0"  # the downward API's pod index, on pod 0
            continue
        env[var["name"]] = var["value"] if "value" in var else secret_value(rendered, var["valueFrom"]["secretKeyRef"])
    return load_config(MODELS[component], path, f"ASY_{component.upper()}", env)


def assert_given(actual: Any, given: Any, where: str) -> None:
    """Every key of the user's ``given`` value, recursively, is as given in ``actual`` (a config's JSON dump)."""
    if isinstance(given, dict):
        for key, value in given.items():
            assert_given(actual[key], value, f"{where}.{key}")
    else:
        assert actual == given, where


@pytest.mark.parametrize("component", sorted(MODELS))
def test_service_configs_load_with_the_services_models(
    rendered: Rendered, value_set: str, component: str, tmp_path: Path
) -> None:
    config = load_service_config(rendered, component, tmp_path)
    values = render_values(value_set)
    spec = pod_spec(rendered, component)
    ports = {p["name"]: p["containerPort"] for p in container(rendered, component)["ports"]}
    assert (config.grpc.host, config.grpc.port, config.http.host, config.http.port) == (
        "0.0.0.0",
        ports["grpc"],
        "0.0.0.0",
        ports["http"],
    )
    assert config.prefix == (values["run"]["prefix"] or RELEASE.replace("-", "_"))  # "" = the release's
    assert config.log_format == "json"
    assert config.nats.url == values["nats"]["url"]
    auth = values["nats"]["auth"]
    if auth.get("user") or auth.get("existingSecret"):
        assert config.nats.user and config.nats.password is not None
        if auth.get("user"):
            assert (config.nats.user, config.nats.password.get_secret_value()) == (auth["user"], auth["password"])
        # The password reaches the pod only through the Secret, never the ConfigMap.
        assert "password" not in rendered.component("ConfigMap", named(rendered, component))["data"]["config.yaml"]
    else:
        assert config.nats.user is None and config.nats.password is None
    mounts = {m["mountPath"] for m in container(rendered, component)["volumeMounts"]}
    if auth.get("credsSecret"):
        assert config.nats.creds_file is not None and config.nats.creds_file.parent.as_posix() in mounts
    if values["nats"]["tls"].get("caSecret"):
        assert config.nats.tls_ca_file is not None and config.nats.tls_ca_file.parent.as_posix() in mounts
    assert config.grpc_tls == expected_grpc_tls(rendered, container(rendered, component), spec, values)
    # The user's typed values arrive unchanged, however deep.
    dumped = config.model_dump(mode="json")
    typed = pool_values(values)["config"] if component == "generator" else values[component]["config"]
    for key, value in typed.items():
        assert_given(dumped[key], value, key)
    if component == "learner":
        broker_service = rendered.component("Service", "broker")
        host, port = config.broker_endpoint.rsplit(":", 1)
        assert host == f"{FULLNAME}-broker.{NAMESPACE}.svc"
        assert int(port) == next(p["port"] for p in broker_service["spec"]["ports"] if p["name"] == "grpc")
        assert config.advertise_host == f"{FULLNAME}-learner.{NAMESPACE}.svc"
        assert rendered.component("StatefulSet", "learner")["spec"]["serviceName"] == f"{FULLNAME}-learner-nodes"
        assert config.batch_prompts == load_service_config(rendered, "broker", tmp_path).batch_prompts
        assert config.run_dir.as_posix() in mounts and config.model_dir.as_posix() == values["model"]["path"]
        assert config.num_devices == values["learner"]["nodes"] * values["learner"]["gpusPerNode"]
    if component == "generator":
        assert config.engine.model_dir.as_posix() == values["model"]["path"]
        assert config.engine.model_dir.as_posix().startswith(values["model"]["cache"]["mountPath"] + "/")
        assert config.weights_dir.as_posix().startswith("/dev/shm")  # a memory-backed volume, below
        assert config.num_devices == pool_values(values)["gpus"]
        assert config.engine.tensor_parallel_size == pool_values(values)["gpus"]
    if component == "fitter":
        assert config.run_dir.as_posix() in mounts
        assert config.run_name == (values["run"]["name"] or RELEASE)
    assert spec["automountServiceAccountToken"] is False


def expected_grpc_tls(
    rendered: Rendered, main: dict[str, Any], spec: dict[str, Any], values: dict[str, Any]
) -> TlsSettings:
    """A service's grpc_tls under ``values``: off, or the files of grpcTls.secretName where ``main`` mounts it."""
    tls = values["grpcTls"]
    volumes = [v for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName") == tls["secretName"]]
    if not tls["enabled"]:
        assert not volumes and "grpc-tls" not in {m["name"] for m in main.get("volumeMounts", [])}
        return TlsSettings()
    (volume,) = volumes
    assert volume["secret"]["items"] == [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    folder = Path(mount["mountPath"])
    return TlsSettings(
        cert_file=folder / "tls.crt",
        key_file=folder / "tls.key",
        ca_file=folder / "ca.crt",
        require_client_cert=tls["requireClientCert"],
        server_name=tls["serverName"] or None,
    )


def render_values(value_set: str) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(VALUE_SETS[value_set])


def test_generators_run_on_gpu_pools(rendered: Rendered, value_set: str, tmp_path: Path) -> None:
    all_values = render_values(value_set)
    assert rendered.pools() == [p["name"] for p in all_values["generatorPools"]]
    for index, pool in enumerate(rendered.pools()):
        values = pool_values(all_values, index)
        tree = values["config"].get("fanout", {}).get("degree", 0) > 0  # a StatefulSet (test_weight_tree.py)
        deployment = rendered.component("StatefulSet" if tree else "Deployment", f"generator-{pool}")
        spec = deployment["spec"]["template"]["spec"]
        (main,) = spec["containers"]
        gpus, resource = values["gpus"], values["gpuResourceName"]
        assert main["resources"]["limits"][resource] == gpus == main["resources"]["requests"][resource]
        config = yaml.safe_load(rendered.component("ConfigMap", f"generator-{pool}")["data"]["config.yaml"])
        assert config["engine"]["tensor_parallel_size"] == config["num_devices"] == gpus
        assert spec["tolerations"] == values["tolerations"]
        # No required GPU-label affinity: without GPU Feature Discovery nothing would match it.
        assert spec.get("affinity", {}) == values["affinity"] == {}
        assert spec.get("nodeSelector", {}) == values["nodeSelector"]
        assert spec.get("runtimeClassName", "") == values["runtimeClassName"]
        assert spec.get("topologySpreadConstraints", []) == values["topologySpreadConstraints"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["asymptote.dev/generator-pool"] == pool
        assert values["podLabels"].items() <= pod_labels.items()
        assert deployment["spec"]["selector"]["matchLabels"]["asymptote.dev/generator-pool"] == pool
        assert deployment["spec"]["updateStrategy" if tree else "strategy"] == (
            {"type": "RollingUpdate"}
            if tree
            else {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        )
        # A vLLM engine takes minutes to load: the startup probe waits up to 15 of them.
        startup = main["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in main["volumeMounts"]}
        model_cache = volumes["model-cache"]
        if all_values["model"]["cache"]["existingClaim"]:
            assert model_cache["persistentVolumeClaim"] == {
                "claimName": all_values["model"]["cache"]["existingClaim"],
                "readOnly": True,
            }
            assert mounts["model-cache"]["readOnly"] is True
        else:
            assert "emptyDir" in model_cache
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"]["mountPath"] == "/dev/shm"
        for extra in values["extraVolumes"]:
            assert volumes[extra["name"]] == extra
        for extra in values["extraVolumeMounts"]:
            assert mounts[extra["name"]] == extra
        for env in values["extraEnv"]:
            assert env in main["env"]
        autoscaled = values["autoscaling"]["keda"]["enabled"] or values["autoscaling"]["hpa"]["enabled"]
        assert ("replicas" in deployment["spec"]) is not autoscaled
        if not autoscaled:
            assert deployment["spec"]["replicas"] == values["replicas"]
        pdb = rendered.component("PodDisruptionBudget", f"generator-{pool}")
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # One Service before every pool: Generate's clients reach them all.
    service = rendered.component("Service", "generator")
    assert "asymptote.dev/generator-pool" not in service["spec"]["selector"]


def generator_config(values: dict[str, Any]) -> dict[str, Any]:
    """The generator's config.yaml as the chart renders it under ``values``."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        files = chart.render(with_images(values), name=RELEASE, namespace=NAMESPACE)
    (config_map,) = [
        d for d in yaml.safe_load_all(files["asymptote/templates/generator.yaml"]) if d and d["kind"] == "ConfigMap"
    ]
    return dict(yaml.safe_load(config_map["data"]["config.yaml"]))


def test_tensor_parallelism_follows_the_generators_gpus() -> None:
    # Unset, it follows generator.gpus; set, the schema takes it and it must agree.
    assert generator_config({"generator": {"gpus": 4}})["engine"]["tensor_parallel_size"] == 4
    two = {"generator": {"gpus": 2, "config": {"engine": {"tensor_parallel_size": 2}}}}
    assert generator_config(two)["engine"]["tensor_parallel_size"] == 2
    with pytest.raises(helm.HelmRenderError) as caught:
        generator_config({"generator": {"gpus": 2, "config": {"engine": {"tensor_parallel_size": 1}}}})
    assert "generatorPools[main]: tensorParallelSize (1) must equal gpus (2)" in str(caught.value)


def test_the_learner_never_runs_twice(rendered: Rendered, value_set: str) -> None:
    learner = rendered.component("StatefulSet", "learner")
    assert learner["spec"]["replicas"] == render_values(value_set)["learner"]["nodes"]
    assert not [d for d in rendered.of_kind("Deployment") if "learner" in d["metadata"]["name"]]
    mounts = {m["name"]: m["mountPath"] for m in container(rendered, "learner")["volumeMounts"]}
    assert mounts["run"] == "/var/lib/asymptote/run"
    values = render_values(value_set)
    if values["learner"]["persistence"]["enabled"]:
        (claim,) = learner["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "run"
        # Unset, sized for the checkpoints kept (12 bytes a parameter: 6 x sizeGiB), the best held-out
        # round's and the one being written.
        config = values["learner"]["config"]
        kept = config["keep_checkpoints"] + int(config.get("keep_best_checkpoint", True))
        sized = f"{math.ceil(6 * values['model']['sizeGiB']) * (kept + 1) + 8}Gi"
        assert claim["spec"]["resources"]["requests"]["storage"] == (values["learner"]["persistence"]["size"] or sized)
        assert learner["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    per_node = render_values(value_set)["learner"]["gpusPerNode"]
    assert container(rendered, "learner")["resources"]["limits"]["nvidia.com/gpu"] == per_node


@pytest.mark.parametrize("component", ["broker", "fitter"])
def test_broker_and_fitter_are_single_cpu_pods(rendered: Rendered, component: str) -> None:
    deployment = rendered.component("Deployment", component)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    spec = pod_spec(rendered, component)
    # Any node: no affinity, and GPU nodes' taint tolerated (an all-GPU cluster taints every node).
    assert "affinity" not in spec
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nvidia.com/gpu" not in container(rendered, component)["resources"]["limits"]


@pytest.mark.parametrize("component", sorted(MODELS))
def test_pods_are_locked_down_and_probed(rendered: Rendered, component: str) -> None:
    workload_ = workload(rendered, component)
    spec = pod_spec(rendered, component)
    pool = {"asymptote.dev/generator-pool": rendered.pools()[0]} if component == "generator" else {}
    labels = workload_["metadata"]["labels"]
    assert labels == pool | {
        "app.kubernetes.io/name": "asymptote",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "asymptote",
        "app.kubernetes.io/version": "0.1.0",
        "app.kubernetes.io/managed-by": "Helm",
        "helm.sh/chart": "asymptote-0.1.0",
    }
    assert workload_["spec"]["template"]["metadata"]["labels"].items() >= labels.items()
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] >= 10000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert {"cpu", "memory"} <= c["resources"]["requests"].keys() and {"cpu", "memory"} <= c["resources"][
            "limits"
        ].keys()
    main = container(rendered, component)
    # Every pod answers for itself: on each learner pod its LOCAL_RANK 0 process serves /healthz and /readyz.
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # Writable places on the read-only root: /tmp (HOME) and, per service, its run or shm volume.
    assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"]
    assert {"name": "HOME", "value": "/tmp"} in main["env"]
    if component == "learner":
        assert main["command"] == ["torchrun"]
        assert main["args"][-5:] == ["-m", "services.cli", "learner", "--config", "/etc/asymptote/config/config.yaml"]
    else:
        assert main["args"] == [component, "--config", "/etc/asymptote/config/config.yaml"]
    # A config change rolls the pods.
    assert len(workload_["spec"]["template"]["metadata"]["annotations"]["checksum/config"]) == 64


def test_config_checksum_follows_the_config() -> None:
    a = render("defaults").component("Deployment", "broker")["spec"]["template"]["metadata"]["annotations"]
    with helm.Chart.load(CHART) as chart:
        files = chart.render(
            with_images({"broker": {"config": {"max_staleness_versions": 4}}}), name=RELEASE, namespace=NAMESPACE
        )
    broker = next(
        d for d in yaml.safe_load_all(files["asymptote/templates/broker.yaml"]) if d and d["kind"] == "Deployment"
    )
    assert broker["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != a["checksum/config"]


def test_generators_scale_on_the_brokers_gauge() -> None:
    keda = render("many-generators-keda").component("ScaledObject", "generator-main")["spec"]
    assert keda["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-generator-main",
    }
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (4, 64)
    (trigger,) = keda["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"] == (
        f'max(asymptote_broker_desired_generators{{namespace="{NAMESPACE}", service="{FULLNAME}-broker"}})'
    )
    assert trigger["metadata"]["threshold"] == "1"  # one generator per unit of the gauge
    assert (
        keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    )

    hpa = render("monitoring-hpa").component("HorizontalPodAutoscaler", "generator-main")["spec"]
    assert hpa["scaleTargetRef"]["name"] == f"{FULLNAME}-generator-main"
    (metric,) = hpa["metrics"]
    assert metric["external"]["metric"] == {
        "name": "asymptote_broker_desired_generators",
        "selector": {"matchLabels": {"namespace": NAMESPACE, "service": f"{FULLNAME}-broker"}},
    }
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1000m"}

    defaults = render("defaults")
    assert not defaults.of_kind("ScaledObject") and not defaults.of_kind("HorizontalPodAutoscaler")


def test_the_brokers_gauge_is_the_one_it_exports() -> None:
    from services.broker.metrics import BrokerMetrics

    names = {m.name for m in BrokerMetrics().registry.collect()}
    assert "asymptote_broker_desired_generators" in names


# -- network policies ----------------------------------------------------------

PODS = ("broker", "generator", "learner", "fitter", "health-test")


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    absent = [e["key"] for e in selector.get("matchExpressions", []) if e["operator"] == "DoesNotExist"]
    assert len(absent) == len(selector.get("matchExpressions", [])), selector
    matched = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    return matched and not any(k in labels for k in absent)


def _port_matches(rule_ports: list[dict[str, Any]] | None, port: int, port_name: str) -> bool:
    return not rule_ports or any(p["port"] in (port, port_name) for p in rule_ports)


def _peer_allows(peers: list[dict[str, Any]] | None, labels: dict[str, str]) -> bool:
    """A peer list admits a pod of this release (same namespace) when a podSelector-only peer selects it."""
    return peers is None or any(
        "podSelector" in p and "namespaceSelector" not in p and _selects(p["podSelector"], labels) for p in peers
    )


def allowed(rendered: Rendered, src: str, dst: str, port: int, port_name: str) -> bool:
    """Whether the release's NetworkPolicies let a ``src`` pod open ``port`` on a ``dst`` pod."""

    def labels(component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "asymptote",
            "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": component,
        }

    def policies_for(component: str, kind: str) -> list[dict[str, Any]]:
        return [
            p["spec"]
            for p in rendered.of_kind("NetworkPolicy")
            if _selects(p["spec"]["podSelector"], labels(component)) and kind in p["spec"]["policyTypes"]
        ]

    egress = policies_for(src, "Egress")
    ingress = policies_for(dst, "Ingress")
    assert egress and ingress, f"{src} or {dst} has no policy"
    out_ok = any(
        _port_matches(r.get("ports"), port, port_name) and _peer_allows(r.get("to"), labels(dst))
        for p in egress
        for r in p.get("egress", [])
    )
    in_ok = any(
        _port_matches(r.get("ports"), port, port_name) and _peer_allows(r.get("from"), labels(src))
        for p in ingress
        for r in p.get("ingress", [])
    )
    return out_ok and in_ok


def test_only_the_intended_services_talk(rendered: Rendered) -> None:
    values = {c: render("defaults").component("Service", c)["spec"]["ports"] for c in MODELS}
    grpc = {c: next(p["port"] for p in ports if p["name"] == "grpc") for c, ports in values.items()}
    http = {c: next(p["port"] for p in ports if p["name"] == "http") for c, ports in values.items()}
    talks = {
        (src, dst) for src in PODS for dst in MODELS if src != dst and allowed(rendered, src, dst, grpc[dst], "grpc")
    }
    assert talks == {
        ("learner", "broker"),
        ("generator", "learner"),
        ("health-test", "broker"),
        ("health-test", "generator"),
        ("health-test", "learner"),
        ("health-test", "fitter"),
    }
    # Nobody in the release scrapes or probes another's http port: that is for the monitoring namespace.
    assert not [(s, d) for s in PODS for d in MODELS if s != d and allowed(rendered, s, d, http[d], "http")]
    every_pod = {
        tuple(sorted(p["spec"]["podSelector"]["matchLabels"].items())) for p in rendered.of_kind("NetworkPolicy")
    }
    # The sandbox pool, when enabled, has its own (tests/deploy/test_sandbox_pool_chart.py).
    sandbox_pool = any(p["metadata"]["name"].endswith("-sandbox-pool") for p in rendered.of_kind("NetworkPolicy"))
    assert len(every_pod) == len(PODS) + sandbox_pool


def test_nats_and_metrics_peers_follow_the_values() -> None:
    policy = render("external-nats-credentials").component("NetworkPolicy", "broker")["spec"]
    nats_rule = next(r for r in policy["egress"] if {"port": 4222, "protocol": "TCP"} in r["ports"])
    assert nats_rule["to"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    metrics_rule = next(r for r in policy["ingress"] if r.get("ports") == [{"port": "http", "protocol": "TCP"}])
    # Prometheus pods of the monitoring namespace, by the Operator's or the community chart's labels.
    in_monitoring = {"matchExpressions": [{"key": NAMESPACE_NAME, "operator": "In", "values": ["monitoring"]}]}
    assert metrics_rule["from"] == [
        {"namespaceSelector": in_monitoring, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        {"namespaceSelector": in_monitoring, "podSelector": {"matchLabels": {"app": "prometheus"}}},
    ]
    # DNS to any address by default: a node-local DNS cache (169.254.20.10) is no pod a selector names.
    dns = policy["egress"][0]
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    with helm.Chart.load(CHART) as chart:
        narrowed = {"networkPolicy": {"dnsTo": [{"ipBlock": {"cidr": "169.254.20.10/32"}}]}}
        files = chart.render(with_images(narrowed), name=RELEASE, namespace=NAMESPACE)
    policies = [o for o in parse_manifests(files) if o["kind"] == "NetworkPolicy"]
    assert all(p["spec"]["egress"][0]["to"] == [{"ipBlock": {"cidr": "169.254.20.10/32"}}] for p in policies)


NAMESPACE_NAME = "kubernetes.io/metadata.name"
"""The label Kubernetes puts on every namespace, its name (GA since 1.22; the chart needs 1.28)."""
OPERATOR_PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus-stack-prometheus"}
COMMUNITY_PROMETHEUS = {"app": "prometheus", "component": "server"}
GRAFANA = {"app.kubernetes.io/name": "grafana"}


def _label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector, as the API server evaluates it."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, values = labels.get(e["key"]), e.get("values", [])
        met = {
            "In": value in values,
            "NotIn": value not in values,
            "Exists": e["key"] in labels,
            "DoesNotExist": e["key"] not in labels,
        }[e["operator"]]
        if not met:
            return False
    return True


def scrapers(rendered: Rendered, component: str, pods: dict[str, tuple[str, dict[str, str]]]) -> set[str]:
    """Which of ``pods`` (name -> (namespace, labels)) the component's policy lets open its http port."""
    policy = rendered.component("NetworkPolicy", component)["spec"]
    admitted = set()
    for rule in policy["ingress"]:
        if rule.get("ports") != [{"port": "http", "protocol": "TCP"}]:
            continue
        for name, (namespace, labels) in pods.items():
            for peer in rule["from"]:
                ns_ok = (
                    _label_selector_matches(peer["namespaceSelector"], {NAMESPACE_NAME: namespace})
                    if "namespaceSelector" in peer
                    else namespace == NAMESPACE
                )
                if "ipBlock" not in peer and ns_ok and _label_selector_matches(peer.get("podSelector", {}), labels):
                    admitted.add(name)
    return admitted


def test_only_prometheus_in_the_monitoring_namespace_scrapes_by_default(rendered: Rendered) -> None:
    """What docs/deploying.md's Security section promises: the metrics port admits Prometheus pods
    (the Operator's, or the community chart's) in `monitoring`; not the same pods elsewhere, nor
    another pod of `monitoring`. `networkPolicy.prometheusNamespaces` names other namespaces, and
    `metricsFrom` adds peers."""
    pods = {
        "operator-prometheus@monitoring": ("monitoring", OPERATOR_PROMETHEUS),
        "community-prometheus@monitoring": ("monitoring", COMMUNITY_PROMETHEUS),
        "grafana@monitoring": ("monitoring", GRAFANA),
        "operator-prometheus@observability": ("observability", OPERATOR_PROMETHEUS),
        "operator-prometheus@team-b": ("team-b", OPERATOR_PROMETHEUS),
        "prometheus-like@rl": (NAMESPACE, OPERATOR_PROMETHEUS),
    }
    for component in MODELS:
        assert scrapers(rendered, component, pods) == {
            "operator-prometheus@monitoring",
            "community-prometheus@monitoring",
        }
    elsewhere = render_with({"networkPolicy": {"prometheusNamespaces": ["observability", "team-b"]}})
    assert scrapers(elsewhere, "fitter", pods) == {
        "operator-prometheus@observability",
        "operator-prometheus@team-b",
    }
    extra = {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME: "monitoring"}},
        "podSelector": {"matchLabels": GRAFANA},
    }
    only_extra = render_with({"networkPolicy": {"prometheusNamespaces": [], "metricsFrom": [extra]}})
    assert scrapers(only_extra, "broker", pods) == {"grafana@monitoring"}
    closed = render_with({"networkPolicy": {"prometheusNamespaces": []}})
    ingress = closed.component("NetworkPolicy", "learner")["spec"]["ingress"]
    assert not [r for r in ingress if r.get("ports") == [{"port": "http", "protocol": "TCP"}]]


# -- helm test, monitoring, secrets ----------------------------------------------


def test_helm_test_checks_every_services_grpc_health(rendered: Rendered) -> None:
    pod = rendered.get("Pod", f"{FULLNAME}-health-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (check,) = pod["spec"]["containers"]
    assert check["args"][:2] == ["kube", "health"]
    targets = [a for a in check["args"] if not a.startswith("-") and ":" in a]
    expected = []
    for component in MODELS:
        service = rendered.component("Service", component)
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        expected.append(f"{service['metadata']['name']}.{NAMESPACE}.svc:{port}")
    if [s for s in rendered.of_kind("Service") if s["metadata"]["name"] == f"{FULLNAME}-sandbox-pool"]:
        expected.append(f"{FULLNAME}-sandbox-pool.{NAMESPACE}.svc:50091")  # when enabled, the sandbox pool too
    assert sorted(targets) == sorted(expected)
    assert check["securityContext"]["readOnlyRootFilesystem"] is True


def test_helm_test_dials_grpc_as_the_services_do(rendered: Rendered, value_set: str, tmp_path: Path) -> None:
    """The test pod's TLS flags, read by the real CLI, are the services' grpc_tls as a client."""
    from services.ops.kube import _health_tls, _parser

    pod = rendered.get("Pod", f"{FULLNAME}-health-test")
    (check,) = pod["spec"]["containers"]
    args = _parser().parse_args(check["args"][1:])
    tls = expected_grpc_tls(rendered, check, pod["spec"], render_values(value_set))
    assert _health_tls(args) == tls.model_copy(update={"require_client_cert": False})
    # The services dial each other the same way.
    learner = load_service_config(rendered, "learner", tmp_path)
    generator = load_service_config(rendered, "generator", tmp_path)
    assert learner.grpc_tls == generator.grpc_tls == tls
    assert tls.client_enabled is tls.server_enabled is render_values(value_set)["grpcTls"]["enabled"]


def dialled_hosts(rendered: Rendered, tmp_path: Path) -> set[str]:
    """Every host a gRPC client of the release dials: the helm test's targets, the learner's broker
    endpoint, the learner's advertise_host (where generators pull weights)."""
    (check,) = rendered.get("Pod", f"{FULLNAME}-health-test")["spec"]["containers"]
    hosts = {a.rsplit(":", 1)[0] for a in check["args"] if not a.startswith("-") and ":" in a}
    learner = load_service_config(rendered, "learner", tmp_path)
    return hosts | {learner.broker_endpoint.rsplit(":", 1)[0], learner.advertise_host}


def test_cert_manager_certifies_every_name_peers_dial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Certificate cert-manager issues names every host dialled, serves and dials (mTLS), lands in
    the mounted Secret; a certificate with those names passes the helm test's real TLS handshake."""
    from services.cli import main as cli

    rendered = render("grpc-mtls-cert-manager")
    values = render_values("grpc-mtls-cert-manager")["grpcTls"]
    spec = rendered.component("Certificate", "grpc-tls")["spec"]
    hosts = dialled_hosts(rendered, tmp_path)
    service_hosts = [f"{FULLNAME}-{c}.{NAMESPACE}.svc" for c in MODELS]
    assert hosts == set(service_hosts)
    assert spec["dnsNames"] == service_hosts + values["certManager"]["extraDnsNames"]
    assert spec["secretName"] == values["secretName"]
    assert spec["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    for component in MODELS:
        assert {"name": "grpc-tls", "mountPath": "/etc/asymptote/grpc-tls", "readOnly": True} in container(
            rendered, component
        )["volumeMounts"]
    assert not render("grpc-tls-secret").of_kind("Certificate") and not render("defaults").of_kind("Certificate")

    # The helm test pod's own arguments, its Secret at a local folder, against an mTLS server
    # answering with a certificate of those names: each dialled name passes the handshake.
    secret = tls_secret(tmp_path / "grpc-tls", spec["dnsNames"])
    (check,) = rendered.get("Pod", f"{FULLNAME}-health-test")["spec"]["containers"]
    flags = [a.replace("/etc/asymptote/grpc-tls", str(secret)) for a in check["args"][2:] if a.startswith("--")]
    with health_server(service_tls(secret, require_client_cert=values["requireClientCert"])) as target:
        for host in sorted(hosts):
            assert cli(["kube", "health", *flags, f"--server-name={host}", target]) == 0, host
        assert capsys.readouterr().out.splitlines() == [f"{target}: SERVING"] * len(hosts)
        assert cli(["kube", "health", *flags, f"--server-name={FULLNAME}-broker.elsewhere.svc", target]) == 1


def test_notes_name_what_the_certificate_must_carry(tmp_path: Path) -> None:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(
            with_images({"grpcTls": {"enabled": True, "secretName": "grpc-tls"}}), name=RELEASE, namespace=NAMESPACE
        )
    rendered = Rendered(files, parse_manifests(files))
    notes = files["asymptote/templates/NOTES.txt"]
    assert "gRPC        TLS, certificate from Secret grpc-tls" in notes
    listed = {line.strip() for line in notes.split("the names peers dial")[1].splitlines()[1:5]}
    assert listed == dialled_hosts(rendered, tmp_path)
    assert "plaintext" in render("defaults").files["asymptote/templates/NOTES.txt"]
    assert "mTLS" in render("grpc-mtls-cert-manager").files["asymptote/templates/NOTES.txt"]


def test_service_monitors_scrape_every_service() -> None:
    rendered = render("monitoring-hpa")
    monitors = rendered.of_kind("ServiceMonitor")
    assert sorted(m["metadata"]["name"] for m in monitors) == sorted(f"{FULLNAME}-{c}" for c in MODELS)
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (endpoint,) = monitor["spec"]["endpoints"]
        # Every series labelled with its release, which the dashboard and the alerts select by.
        relabel = [{"targetLabel": "release", "replacement": RELEASE, "action": "replace"}]
        assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s", "relabelings": relabel}
        services = [
            s for s in rendered.of_kind("Service") if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert len(services) == 1 and "http" in [p["name"] for p in services[0]["spec"]["ports"]]
    assert not render("defaults").of_kind("ServiceMonitor")


def test_dashboard_ships_in_a_configmap(rendered: Rendered) -> None:
    config_map = rendered.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["asymptote.json"])
    assert shipped == dashboard()
    assert shipped["uid"] == "asymptote-scalerl"
    variables = {v["name"]: v for v in shipped["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in shipped["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needed in (
        "asymptote_fitter_projected_pass_rate",
        "asymptote_fitter_a_low",
        "asymptote_fitter_b",
        "asymptote_fitter_c_mid",
        "asymptote_generator_tokens_total",
        "asymptote_learner_samples_trained_total",
        "asymptote_learner_staleness_tokens",
        "asymptote_broker_pending_tasks",
        "asymptote_generator_swap_pause_seconds_bucket",
        "asymptote_learner_is_capped_frac",
        "asymptote_learner_is_kl_gen_learner",
        "asymptote_learner_batch_truncation_rate",
        "asymptote_broker_completions_received_total",
        "asymptote_learner_policy_entropy",
        "asymptote_generator_swaps_refused_total",
        "asymptote_broker_deadlettered_total",
        "asymptote_generator_task_errors_total",
        "asymptote_generator_inflight_groups",
    ):
        assert needed in exprs, needed
    ids = [p["id"] for p in shipped["panels"]]
    assert len(ids) == len(set(ids))


def test_secret_holds_the_nats_credentials_given_as_values() -> None:
    (secret,) = render("external-nats-credentials").of_kind("Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-nats"
    assert secret["stringData"] == {"user": "asymptote", "password": "s3cret-but-rendered"}
    assert not render("monitoring-hpa").of_kind("Secret")  # an existing Secret is used as it is
    env = container(render("monitoring-hpa"), "broker")["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs == {
        "ASY_BROKER__NATS__USER": {"name": "nats-users", "key": "username"},
        "ASY_BROKER__NATS__PASSWORD": {"name": "nats-users", "key": "password"},
    }


# -- the umbrella chart ------------------------------------------------------------


def test_umbrella_chart_installs_nats_for_the_services(stack_rendered: Rendered) -> None:
    chart = yaml.safe_load((STACK_CHART / "Chart.yaml").read_text())
    deps = {d["name"]: d for d in chart["dependencies"]}
    assert deps["nats"]["repository"] == "https://nats-io.github.io/k8s/helm/charts/"
    assert deps["nats"]["condition"] == "nats.enabled"
    assert deps["asymptote"]["repository"] == "file://../asymptote"
    # The asymptote chart itself depends on nothing, so users with a NATS vendor nothing.
    assert "dependencies" not in yaml.safe_load((CHART / "Chart.yaml").read_text())

    objects = stack_rendered.objects
    assert len(objects) == len(render("defaults").objects)
    for component in MODELS:
        config_map = stack_rendered.component("ConfigMap", named(stack_rendered, component))
        config = yaml.safe_load(config_map["data"]["config.yaml"])
        assert config["nats"]["url"] == f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222"
        refs = [
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container(stack_rendered, component)["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        assert refs == ["asymptote-nats-auth", "asymptote-nats-auth"]
        policy = stack_rendered.component("NetworkPolicy", component)["spec"]
        nats_rule = next(r for r in policy["egress"] if {"port": 4222, "protocol": "TCP"} in r["ports"])
        assert nats_rule["to"] == [
            {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": RELEASE}}}
        ]
    # The NATS server reads the same Secret.
    nats = yaml.safe_load((STACK_CHART / "values.yaml").read_text())["nats"]
    assert nats["config"]["jetstream"]["enabled"] is True
    secret_names = {v["valueFrom"]["secretKeyRef"]["name"] for v in nats["container"]["env"].values()}
    assert secret_names == {"asymptote-nats-auth"}


def test_umbrella_nats_carries_the_largest_message_on_replicated_file_storage(stack_rendered: Rendered) -> None:
    """NATS's max_payload covers the largest stream message; streams are replicated across its servers."""
    values = yaml.safe_load((STACK_CHART / "values.yaml").read_text())
    nats = values["nats"]["config"]
    largest = max(c.max_msg_size or 0 for c in stream_configs(Names()))
    assert largest == 8 * 1024 * 1024  # a rollout group
    assert nats["merge"]["max_payload"] >= largest + 64 * 1024  # room for the message's headers
    assert nats["jetstream"]["fileStore"]["enabled"] and nats["jetstream"]["fileStore"]["pvc"]["enabled"]
    assert nats["cluster"] == {"enabled": True, "replicas": 3}
    replicas = values["asymptote"]["nats"]["streamReplicas"]
    assert replicas == nats["cluster"]["replicas"]
    for component in MODELS:
        config_map = stack_rendered.component("ConfigMap", named(stack_rendered, component))
        config: Any = MODELS[component].model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
        assert config.nats.stream_replicas == replicas
    defaults = render("defaults").component("ConfigMap", "broker")
    assert yaml.safe_load(defaults["data"]["config.yaml"])["nats"]["stream_replicas"] == 1


def test_umbrella_chart_lints_but_for_the_nats_chart_it_fetches(tmp_path: Path) -> None:
    """Only `helm dependency build` (the official NATS chart, from its repository) is missing here."""
    import shutil

    stack = tmp_path / "asymptote-stack"
    shutil.copytree(STACK_CHART, stack)
    shutil.copytree(CHART, stack / "charts" / "asymptote")
    report = helm.lint(stack, strict=True)
    assert report["errors"] == ["chart directory is missing these dependencies: nats"], report
    statuses = {d["name"]: d["status"] for d in helm.dependency_list(stack)}
    assert statuses == {"asymptote": "unpacked", "nats": "missing"}


# -- images ------------------------------------------------------------------------

DOCKERFILES = REPO / "deploy" / "docker"


@pytest.mark.parametrize(
    ("role", "base"),
    [
        ("generator", "vllm/vllm-openai"),
        ("learner", "pytorch/pytorch"),
        ("broker", "python:3.11-slim"),
        ("fitter", "python:3.11-slim"),
    ],
)
def test_dockerfiles_run_each_role_as_the_charts_user(role: str, base: str) -> None:
    text = (DOCKERFILES / f"{role}.Dockerfile").read_text()
    assert base in text
    stages = re.split(r"^FROM ", text, flags=re.M)
    final = stages[-1]
    user = re.findall(r"^USER (\S+)", final, flags=re.M)
    values = render_values("defaults")
    uid = values["containerSecurityContext"]["runAsUser"]
    assert user == [f"{uid}:{values['containerSecurityContext']['runAsGroup']}"]
    assert f"--uid {uid}" in text
    assert re.search(r'^ENTRYPOINT \["asymptote"\]$', final, flags=re.M)
    assert re.search(rf'^CMD \["{role}"\]$', final, flags=re.M)
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", final, flags=re.M)[0].split()}
    defaults = MODELS[role].model_fields
    assert exposed == {defaults["grpc"].default.port, defaults["http"].default.port}
    assert exposed == set(values[role]["ports"].values())


def test_the_chart_defaults_are_the_papers_8b_preset(tmp_path: Path) -> None:
    """The chart deploys GPU-sized models: its defaults are ScaleRL's 8B dense settings, which the
    learner's large-model learning-rate check accepts (the tiny model's defaults it does not)."""
    rendered = render("defaults")
    learner = load_service_config(rendered, "learner", tmp_path)
    broker = load_service_config(rendered, "broker", tmp_path)
    opt = learner.optimizer
    assert (opt.lr, opt.warmup_steps, opt.eps, opt.weight_decay) == (5e-7, 100, 1e-15, 0.01)
    assert (learner.loss.name, learner.loss.eps_max) == ("cispo", 4.0)
    assert (learner.batch_prompts, broker.batch_prompts, broker.sampling.group_size) == (48, 48, 16)
    assert (broker.max_staleness_versions, broker.zero_variance) == (8, "drop")
    assert learner.warnings(num_parameters=8_000_000_000) == []
    tiny_lr = learner.model_copy(update={"optimizer": OptimizerSettings()})
    assert len(tiny_lr.warnings(num_parameters=8_000_000_000)) == 1


def test_the_broker_reads_a_dataset_task_from_the_model_cache(rendered: Rendered, value_set: str) -> None:
    """The broker loads a dataset task's files: with one, it mounts the model cache claim read-only, else nothing."""
    values = render_values(value_set)
    task = values.get("task") or {}
    spec = pod_spec(rendered, "broker")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container(rendered, "broker")["volumeMounts"]}
    claim = values["model"]["cache"]["existingClaim"]
    if task.get("name") == "dataset" and claim:
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mount = mounts["model-cache"]
        assert mount["readOnly"] is True
        for key in ("path", "eval_path"):
            assert task.get(key, mount["mountPath"] + "/").startswith(mount["mountPath"] + "/")
    else:
        assert "model-cache" not in volumes and "model-cache" not in mounts
