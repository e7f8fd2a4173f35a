"""What ``helm uninstall`` leaves of a run, and what ``helm install`` tells the
operator, rendered with the real Helm SDK.

The learner's checkpoints (its StatefulSet's claims) and the fitter's curve
(a claim of the chart's) are kept or deleted alike, by one value: a reinstall
never resumes old weights against an empty curve.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_render import CHART, NAMESPACE, RELEASE, Rendered, render_with

TASK = {"name": "arithmetic"}
"""The chart refuses a model without a task; any task does here."""
CLAIM = {"model": {"cache": {"existingClaim": "qwen3-8b"}, "path": "/models/qwen3-8b"}, "task": TASK}


def kept_on_uninstall(rendered: Rendered) -> tuple[bool, bool]:
    """(the learner's claims kept, the fitter's claim kept) when the release is uninstalled."""
    learner = rendered.component("StatefulSet", "learner")
    fitter = rendered.component("PersistentVolumeClaim", "fitter")
    learner_kept = learner["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    fitter_kept = (fitter["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep"
    return learner_kept, fitter_kept


def test_both_claims_survive_an_uninstall_by_default_and_go_together_on_request() -> None:
    assert kept_on_uninstall(render_with({})) == (True, True)
    deleted = render_with({"run": {"claimsOnUninstall": "delete"}})
    assert kept_on_uninstall(deleted) == (False, False)
    assert deleted.component("StatefulSet", "learner")["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Retain",
    }
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"run": {"claimsOnUninstall": "retain"}})
    assert "/run/claimsOnUninstall" in str(caught.value)


def notes(values: dict[str, Any]) -> str:
    return render_with(values).files["asymptote/templates/NOTES.txt"]


@pytest.mark.parametrize(
    ("values", "warned"),
    [
        ({}, True),
        (CLAIM, False),
        ({"model": {"download": {"enabled": True, "repo": "Qwen/Qwen3-8B"}}, "task": TASK}, False),
        ({"model": {"cache": {"initContainers": [{"name": "fill", "image": "busybox:1.36"}]}}, "task": TASK}, False),
    ],
    ids=["nothing", "existing-claim", "download", "init-containers"],
)
def test_notes_warn_of_a_missing_model_only_when_nothing_provides_one(values: dict[str, Any], warned: bool) -> None:
    assert ("will find no model" in notes(values)) == warned


def test_notes_say_how_to_fetch_results_and_what_uninstall_keeps() -> None:
    text = notes(CLAIM)
    assert f"asymptote kube fetch {RELEASE} --namespace {NAMESPACE} --to ./{RELEASE}-results" in text
    assert "`helm uninstall` keeps the learner's checkpoints and the fitter's curve" in text
    assert "`helm uninstall` keeps" not in notes({**CLAIM, "run": {"claimsOnUninstall": "delete"}})


KEDA = {"enabled": True, "serverAddress": "http://prometheus-operated.monitoring.svc:9090"}
MONITORED = {"monitoring": {"serviceMonitors": {"enabled": True}}}


def scale_commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("asymptote kube scale")]


def test_notes_offer_kube_scale_only_for_a_pool_no_autoscaler_owns() -> None:
    """`asymptote kube scale` refuses a pool KEDA or an HPA scales: the notes give such a pool's
    bounds and how to watch its count instead, and the scale command for a pool of fixed size."""
    fixed = notes({"generatorPools": [{"name": "h100", "replicas": 6}]})
    assert scale_commands(fixed) == [f"asymptote kube scale h100 7 --release {RELEASE} --namespace {NAMESPACE}"]
    assert "resets the count to the pool's replicas, 6 for h100" in fixed
    assert "kubectl get scaledobject" not in fixed and "refuses" not in fixed

    keda = notes({**MONITORED, "generator": {"autoscaling": {"minReplicas": 2, "maxReplicas": 16, "keda": KEDA}}})
    assert scale_commands(keda) == []
    assert "The generator count of pool main (KEDA, 2 to 16)" in keda
    assert "`asymptote kube scale` refuses\nit." in keda
    assert f"  kubectl get scaledobject {RELEASE}-asymptote-generator-main --namespace {NAMESPACE}" in keda

    hpa = notes({"generator": {"autoscaling": {"maxReplicas": 12, "hpa": {"enabled": True}}}})
    assert scale_commands(hpa) == []
    assert "pool main (HPA, 1 to 12)" in hpa
    assert f"  kubectl get hpa {RELEASE}-asymptote-generator-main --namespace {NAMESPACE}" in hpa
    assert "kubectl get scaledobject" not in hpa

    # Pools apart: the fixed one is offered, the autoscaled ones are named with their own owner.
    mixed = notes(
        {
            **MONITORED,
            "generatorPools": [
                {"name": "a100", "replicas": 3},
                {"name": "h100", "autoscaling": {"maxReplicas": 32, "keda": KEDA}},
                {"name": "l40s", "autoscaling": {"hpa": {"enabled": True}}},
            ],
        }
    )
    assert scale_commands(mixed) == [f"asymptote kube scale a100 4 --release {RELEASE} --namespace {NAMESPACE}"]
    assert "pool h100 (KEDA, 1 to 32), pool l40s (HPA, 1 to 16)" in mixed
    assert f"kubectl get scaledobject {RELEASE}-asymptote-generator-h100 --namespace" in mixed
    assert f"kubectl get hpa {RELEASE}-asymptote-generator-l40s --namespace" in mixed


def test_notes_name_a_pool_on_a_fan_out_tree_a_statefulset() -> None:
    text = notes({"generatorPools": [{"name": "a100"}, {"name": "h100", "config": {"fanout": {"degree": 4}}}]})
    assert f"{RELEASE}-asymptote-generator-a100  (pool a100: Deployment, 2 replicas;" in text
    assert f"{RELEASE}-asymptote-generator-h100  (pool h100: StatefulSet, 2 replicas;" in text
