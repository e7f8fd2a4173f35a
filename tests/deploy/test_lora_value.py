"""One LoRA adapter for the learner and every generator pool, as the chart renders it (the real Helm SDK):
the top-level ``lora`` reaches the learner's and each pool's config (loaded by the services' own models),
a service's own ``config.lora`` is refused by the schema (one place for it), and {} trains every weight."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import CHART, NAMESPACE, RELEASE, Rendered, parse_manifests, with_images

from asymptote.lora import LoraSettings
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig

POOLS = [{"name": "a", "replicas": 1}, {"name": "b", "replicas": 2}]


def _configs(values: dict[str, Any]) -> tuple[LearnerConfig, list[GeneratorConfig]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(with_images({"generatorPools": POOLS, **values}), name=RELEASE, namespace=NAMESPACE)
    rendered = Rendered(files, parse_manifests(files))
    learner: LearnerConfig | None = None
    pools = []
    for cm in rendered.of_kind("ConfigMap"):
        name = cm["metadata"]["name"].removeprefix(f"{RELEASE}-asymptote-")
        if "config.yaml" not in cm["data"]:
            continue
        data = yaml.safe_load(cm["data"]["config.yaml"])
        if name == "learner":
            learner = LearnerConfig.model_validate(data)
        elif name.startswith("generator-"):
            pools.append(GeneratorConfig.model_validate(data))
    assert learner is not None
    return learner, pools


def test_the_lora_value_reaches_the_learner_and_every_pool() -> None:
    learner, pools = _configs({"lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}})
    expected = LoraSettings(rank=16, alpha=32, target_modules=("q_proj", "v_proj"))
    assert learner.lora == expected
    assert len(pools) == 2 and [p.lora for p in pools] == [expected, expected]


def test_no_lora_value_trains_every_weight() -> None:
    learner, pools = _configs({})
    assert learner.lora is None and [p.lora for p in pools] == [None, None]


@pytest.mark.parametrize(
    "values",
    [
        {"learner": {"config": {"lora": {"rank": 8}}}},
        {"generator": {"config": {"lora": {"rank": 8}}}},
        {"generatorPools": [{"name": "a", "config": {"lora": {"rank": 8}}}]},
    ],
)
def test_a_services_own_lora_is_refused_by_the_schema(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="additional properties 'lora'"):
        chart.validate_schema(values)


@pytest.mark.parametrize("lora", [{"rank": 0}, {"alpha": 16}, {"rank": 8, "targets": ["q_proj"]}])
def test_a_lora_the_learner_would_refuse_is_refused_by_the_schema(lora: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="lora"):
        chart.validate_schema({"lora": lora})
