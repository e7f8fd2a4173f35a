"""The chart's download of the model and dataset files from the Hugging Face hub (``model.download``).

Rendered with the real Helm SDK (value set ``model-download``); strict
validation and checkov run over the same value set in the chart's other
tests. The hub itself cannot be reached from here: ``tests/test_fetch.py``
runs the init containers' command against a stand-in for the download call.
"""

from __future__ import annotations

import pytest
from chart_render import VALUE_SETS, Rendered, render

from asymptote.download import MODEL_PATTERNS


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return render("model-download")


def pod_spec(r: Rendered, kind: str, component: str) -> dict:  # type: ignore[type-arg]
    if component == "generator":
        (name,) = r.pools()
        component = f"generator-{name}"
    return r.component(kind, component)["spec"]["template"]["spec"]


@pytest.mark.parametrize(("kind", "component"), [("Deployment", "generator"), ("StatefulSet", "learner")])
def test_generators_and_the_learner_fetch_the_model_and_datasets_first(
    rendered: Rendered, kind: str, component: str
) -> None:
    spec = pod_spec(rendered, kind, component)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["hf-token"]["secret"] == {
        "secretName": "hf-token",
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    init = {c["name"]: c for c in spec["initContainers"]}
    model, dataset = init["fetch-model"], init["fetch-dataset-0"]
    allow = [a for pair in zip(["--allow"] * len(MODEL_PATTERNS), MODEL_PATTERNS) for a in pair]
    assert model["command"] == [
        "python", "-m", "asymptote.download", "model", "Qwen/Qwen3-8B", "/models/qwen3-8b", "--revision", "main", *allow
    ]  # fmt: skip
    assert dataset["command"] == [
        "python", "-m", "asymptote.download", "dataset", "openai/gsm8k", "/models/data/gsm8k",
        "--revision", "main", "--allow", "main/*.parquet",
    ]  # fmt: skip
    for c in (model, dataset):
        env = {e["name"]: e for e in c["env"]}
        # The token is a file from the Secret, never in the environment.
        assert "HF_TOKEN" not in env and env["HF_TOKEN_PATH"]["value"] == "/var/run/secrets/huggingface/token"
        assert env["HF_HOME"]["value"] == "/models/.hf-home"
        assert c["volumeMounts"] == [
            {"name": "model-cache", "mountPath": "/models"},
            {"name": "hf-token", "mountPath": "/var/run/secrets/huggingface", "readOnly": True},
        ]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        learner = pod_spec(rendered, "StatefulSet", "learner")["containers"]
        assert c["image"] == next(x["image"] for x in learner if x["name"] == "learner")  # it has huggingface_hub


def test_only_pods_that_download_may_reach_https(rendered: Rendered) -> None:
    defaults = render("defaults")
    for component in ("generator", "learner", "broker", "fitter"):
        policy = rendered.component("NetworkPolicy", component)["spec"]
        https = [rule for rule in policy["egress"] if {"port": 443, "protocol": "TCP"} in rule.get("ports", [])]
        if component in ("generator", "learner"):
            assert https == [
                {
                    "ports": [{"port": 443, "protocol": "TCP"}],
                    "to": VALUE_SETS["model-download"]["networkPolicy"]["downloadTo"],
                }
            ]
        else:
            assert https == []
        plain = defaults.component("NetworkPolicy", component)["spec"]
        assert not [r for r in plain["egress"] if {"port": 443, "protocol": "TCP"} in r.get("ports", [])]


def test_without_download_no_fetch_runs(rendered: Rendered) -> None:
    spec = pod_spec(render("defaults"), "StatefulSet", "learner")
    assert not [c for c in spec.get("initContainers", []) if c["name"].startswith("fetch-")]
