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
