"""A mixture of tasks on Kubernetes: the one top-level task reaches the broker and every generator, and
the broker mounts the model cache claim to read the sub-tasks' dataset files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
from chart_render import CHART, NAMESPACE, RELEASE, Rendered, parse_manifests, with_images
from test_chart_contents import container, load_service_config, pod_spec

from asymptote.tasks import MixtureSettings

MIXTURE: dict[str, Any] = {
    "name": "mixture",
    "tasks": [
        {
            "name": "math",
            "weight": 3,
            "task": {"name": "dataset", "path": "/models/data/gsm8k.jsonl", "eval_path": "/models/data/test.jsonl"},
        },
        {
            "name": "code",
            "weight": 1,
            "task": {"name": "dataset", "path": "/models/data/apps.jsonl", "preset": "apps", "holdout_fraction": 0.05},
        },
    ],
}


def test_a_mixture_reaches_every_service_and_the_broker_reads_its_files(tmp_path: Path) -> None:
    values = {"task": MIXTURE, "model": {"path": "/models/qwen3", "cache": {"existingClaim": "qwen3-8b"}}}
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        files = chart.render(with_images(values), name=RELEASE, namespace=NAMESPACE)
    rendered = Rendered(files, parse_manifests(files))
    broker = load_service_config(rendered, "broker", tmp_path)
    assert isinstance(broker.task, MixtureSettings) and broker.task.names == ("math", "code")
    assert broker.task.weights == {"math": 3.0, "code": 1.0}
    volumes = {v["name"]: v for v in pod_spec(rendered, "broker")["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "qwen3-8b", "readOnly": True}
    mounts = {m["name"]: m for m in container(rendered, "broker")["volumeMounts"]}
    assert mounts["model-cache"]["readOnly"] is True
