"""The chart is valid: Helm lints it clean, its values schema is the services'
own config models and refuses bad values, every rendered object validates
against the Kubernetes schemas in strict mode (custom resources against
models generated from KEDA's, the Prometheus Operator's and cert-manager's
CRDs), and
checkov finds nothing it does not skip for a written reason.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from chart_render import CHART, NAMESPACE, RELEASE, REPO, VALUE_SETS, Rendered, parse_manifests, render, with_images
from cloudcoil.models.cert_manager.v1 import Certificate
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor
from pydantic import BaseModel

KUBE_VERSION = kubernetes_validate.latest_version()
CUSTOM_RESOURCES: dict[tuple[str, str], type[BaseModel]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
    ("cert-manager.io/v1", "Certificate"): Certificate,
}


def validate_object(obj: dict[str, Any]) -> None:
    """Strict schema validation of one object; raises with the object's kind and name."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    model = CUSTOM_RESOURCES.get((obj["apiVersion"], obj["kind"]))
    if model is None:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{where} is invalid for Kubernetes {KUBE_VERSION} at {path}: {exc.message}") from exc
        return
    # The CRD models ignore unknown fields: a field they drop on the round trip is one the CRD does not have.
    round_trip = model.model_validate(obj).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert round_trip == obj, f"{where} has fields its CRD does not define:\n{json.dumps(obj, indent=1)}"


def test_every_object_validates_strictly(rendered: Rendered, value_set: str) -> None:
    kinds = Counter(o["kind"] for o in rendered.objects)
    for obj in rendered.objects:
        validate_object(obj)
    print(
        f"{value_set}: {len(rendered.objects)} objects valid for Kubernetes {KUBE_VERSION}: {dict(sorted(kinds.items()))}"
    )
    # Each object once, and everything in the release's namespace.
    names = [(o["kind"], o["metadata"]["name"]) for o in rendered.objects]
    assert len(names) == len(set(names))
    assert {o["metadata"].get("namespace") for o in rendered.objects} == {NAMESPACE}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= set(kinds)


def test_umbrella_chart_objects_validate_strictly(stack_rendered: Rendered) -> None:
    for obj in stack_rendered.objects:
        validate_object(obj)
    print(f"asymptote-stack (without the NATS chart it fetches): {len(stack_rendered.objects)} objects valid")
    assert len(stack_rendered.objects) > 20


def test_strict_validation_catches_a_misspelled_field() -> None:
    """The validator is not vacuous: a typo in a core object or a custom resource fails."""
    deployment = json.loads(json.dumps(render("defaults").component("Deployment", "broker")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = deployment["spec"]["template"]["spec"][
        "containers"
    ][0].pop("readinessProbe")
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate_object(deployment)
    scaled = json.loads(json.dumps(render("many-generators-keda").component("ScaledObject", "generator-main")))
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        validate_object(scaled)
    certificate = json.loads(json.dumps(render("grpc-mtls-cert-manager").component("Certificate", "grpc-tls")))
    certificate["spec"]["dnsName"] = certificate["spec"].pop("dnsNames")
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        validate_object(certificate)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_is_clean(value_set: str) -> None:
    report = helm.lint(
        CHART, with_images(VALUE_SETS[value_set]), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_values_schema_is_generated_from_the_config_models() -> None:
    spec = importlib.util.spec_from_file_location("gen_values_schema", REPO / "scripts" / "gen_values_schema.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (CHART / "values.schema.json").read_text()
    assert module.render() == committed, "values.schema.json is stale: run python scripts/gen_values_schema.py"


BAD_VALUES = [
    ({"generator": {"replicas": -1}}, "/generator/replicas"),
    ({"generator": {"gpus": 0}}, "/generator/gpus"),
    ({"broker": {"config": {"batch_prompts": 3}}}, "additional properties 'batch_prompts'"),
    ({"broker": {"config": {"nats": {"url": "nats://elsewhere:4222"}}}}, "additional properties 'nats'"),
    ({"broker": {"config": {"sampling": {"group_size": 1}}}}, "/broker/config/sampling/group_size"),
    ({"broker": {"config": {"mode": "lockstep"}}}, "/broker/config/mode"),
    ({"learner": {"config": {"loss": {"name": "ppo"}}}}, "/learner/config/loss/name"),
    ({"learner": {"config": {"model_dir": "/elsewhere"}}}, "additional properties 'model_dir'"),
    ({"generator": {"config": {"engine": {"model_dir": "/elsewhere"}}}}, "additional properties 'model_dir'"),
    ({"generator": {"config": {"engine": {"dtype": "int4"}}}}, "/generator/config/engine/dtype"),
    ({"fitter": {"config": {"curve": {"min_num_points": 2}}}}, "/fitter/config/curve/min_num_points"),
    ({"nats": {"url": "http://nats:4222"}}, "/nats/url"),
    ({"nats": {"auth": {"user": "asymptote"}}}, "/nats/auth/password"),
    ({"generator": {"autoscaling": {"keda": {"enabled": True}}}}, "/generator/autoscaling/keda/serverAddress"),
    (
        {
            "generator": {
                "autoscaling": {"keda": {"enabled": True, "serverAddress": "http://p:9090"}, "hpa": {"enabled": True}}
            }
        },
        "/generator/autoscaling/hpa/enabled",
    ),
    ({"images": {"generator": {"digest": "latest"}}}, "/images/generator/digest"),
    ({"images": {"learner": {"repository": "registry.example/asymptote learner"}}}, "/images/learner/repository"),
    ({"run": {"prefix": "Bad-Prefix"}}, "/run/prefix"),
    (
        {"broker": {"resources": {"requests": {"memory": None}}}},  # null deletes a default in Helm
        "/broker/resources/requests",
    ),
    ({"generator": {"resources": {"requests": {"cpu": None}}}}, "/generator/resources/requests"),
    # The learner is nodes x gpusPerNode now; a pool needs a DNS-label name and only generator's keys.
    ({"learner": {"gpus": 8}}, "additional properties 'gpus'"),
    ({"learner": {"nodes": 0}}, "/learner/nodes"),
    ({"learner": {"nccl": {"env": {"CUDA_VISIBLE_DEVICES": "0"}}}}, "invalid propertyName 'CUDA_VISIBLE_DEVICES'"),
    ({"generatorPools": []}, "/generatorPools"),
    ({"generatorPools": [{"name": "H100_pool"}]}, "/generatorPools/0/name"),
    ({"generatorPools": [{"name": "h100", "gpu": 2}]}, "additional properties 'gpu'"),
    ({"generatorPools": [{"name": "h100", "gpuResourceName": "gpu"}]}, "/generatorPools/0/gpuResourceName"),
    ({"model": {"sizeGiB": 0}}, "/model/sizeGiB"),
    ({"replicaCount": 3}, "additional properties 'replicaCount'"),
    # gRPC TLS: the chart owns each service's grpc_tls; TLS needs its Secret, and its details need TLS.
    ({"learner": {"config": {"grpc_tls": {"ca_file": "/etc/ca.crt"}}}}, "additional properties 'grpc_tls'"),
    ({"grpcTls": {"enabled": True}}, "/grpcTls/secretName"),
    ({"grpcTls": {"requireClientCert": True}}, "/grpcTls/enabled"),
    ({"grpcTls": {"serverName": "asymptote.internal"}}, "/grpcTls/enabled"),
    ({"grpcTls": {"certManager": {"issuerRef": {"name": "cluster-ca"}}}}, "/grpcTls/enabled"),
    ({"grpcTls": {"enabled": True, "secretName": "tls", "serverName": "https://broker"}}, "/grpcTls/serverName"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as caught:
            chart.validate_schema(values)
        assert where in str(caught.value)
        with pytest.raises(helm.HelmValuesError):  # install/template refuse them too
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_every_value_set_passes_the_schema() -> None:
    with helm.Chart.load(CHART) as chart:
        for values in VALUE_SETS.values():
            chart.validate_schema(values)


# Checks the chart skips, where, and why (the reason is in the annotation).
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_35", "CKV_K8S_8", "CKV_K8S_9"}


@pytest.mark.slow  # a checkov process per value set, ~10 s
def test_checkov_finds_nothing_unexplained(checkov: Path, tmp_path: Path) -> None:
    for value_set in VALUE_SETS:
        out = tmp_path / value_set
        out.mkdir()
        for i, obj in enumerate(render(value_set).objects):
            (out / f"{i:03d}-{obj['kind']}-{obj['metadata']['name']}.yaml").write_text(yaml.safe_dump(obj))
    result = subprocess.run(
        [str(checkov), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.stdout, result.stderr[-3000:]
    report = json.loads(result.stdout)
    report = report[0] if isinstance(report, list) else report
    summary, results = report["summary"], report["results"]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in results["failed_checks"]]
    assert summary["failed"] == 0 and not failed, failed
    assert summary["passed"] > 300
    skipped = results["skipped_checks"]
    for check in skipped:
        assert check["check_id"] in ALLOWED_SKIPS, check["check_id"]
        assert len(check["check_result"].get("suppress_comment", "")) > 20, check
    by_set = Counter((Path(c["file_path"]).parts[1], c["check_id"]) for c in skipped)
    # With digests, the digest check runs (and passes) instead of being skipped.
    assert not by_set[("many-generators-keda", "CKV_K8S_43")]
    assert by_set[("defaults", "CKV_K8S_43")] == 5  # four workloads and the test pod
    # A credentials file needs no secret in the environment.
    assert not by_set[("nats-creds-file", "CKV_K8S_35")]
    print(
        f"checkov: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped: "
        f"{dict(sorted(Counter(c['check_id'] for c in skipped).items()))}"
    )


SERVICE_IMAGES = {
    r: {"repository": f"registry.example/asymptote-{r}"} for r in ("generator", "learner", "broker", "fitter")
}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({}, ["generator", "learner", "broker", "fitter"]),
        ({"images": {r: SERVICE_IMAGES[r] for r in ("generator", "broker")}}, ["learner", "fitter"]),
        # A digest is no repository.
        (
            {"images": {**SERVICE_IMAGES, "fitter": {"repository": "", "digest": "sha256:" + "ab" * 32}}},
            ["fitter"],
        ),
        # The sandbox pool's image only once the pool is on.
        ({"images": SERVICE_IMAGES, "sandboxPool": {"enabled": True}}, ["sandboxPool"]),
    ],
    ids=["none", "two-forgotten", "digest-only", "sandbox-pool"],
)
def test_a_forgotten_image_is_refused_at_render_by_name(values: dict[str, Any], named: list[str]) -> None:
    """No default image: a release that leaves an image it deploys unset is refused by helm install
    and helm template (not at pull time), in one message naming each such images.<role>.repository."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)  # the schema takes partial values; the templates refuse
        with pytest.raises(helm.HelmRenderError) as caught:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    listed = re.findall(r"images\.(\w+)\.repository", message.split(" not set:")[0])
    assert listed == named, message
    example = re.sub(r"(?<!^)([A-Z])", r"-\1", named[0]).lower()  # sandboxPool: asymptote-sandbox-pool
    assert f"e.g. images.{named[0]}.repository=registry.example.com/you/asymptote-{example}" in message
    assert "docker buildx bake" in message
    # Given the ones it named, the same values render, with those images.
    given = {r: {"repository": f"r.example/{r}"} for r in named}
    fixed = {**values, "images": {**values.get("images", {}), **given}}
    with helm.Chart.load(CHART) as chart:
        objects = parse_manifests(chart.render(fixed, name=RELEASE, namespace=NAMESPACE))
    pulled = {
        c["image"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert {f"r.example/{r}:0.1.0" for r in named} <= pulled
