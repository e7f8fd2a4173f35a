"""One task for every service, and a run of its own per release, as the chart renders them
(the real Helm SDK):

- the top-level ``task`` reaches the broker and every generator pool, whose
  configs (loaded by the services' own models) hold one task digest; a
  service's own ``config.task`` is refused by the schema, and a release that
  sets a model but no task is refused by the templates;
- ``run.prefix`` defaults to the release name made a NATS prefix, so two
  releases on one NATS never share a stream; the dashboard and the alerts
  select the release, not only the namespace.
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import CHART, NAMESPACE, RELEASE, VALUE_SETS, Rendered, dashboard, parse_manifests, with_images
from pydantic import BaseModel

from asymptote.jetstream.names import Names
from asymptote.tasks import task_digest
from services.broker.config import BrokerConfig
from services.fitter.config import FitterConfig
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig

MODELS: dict[str, type[BaseModel]] = {
    "broker": BrokerConfig,
    "generator": GeneratorConfig,
    "learner": LearnerConfig,
    "fitter": FitterConfig,
}


def render_with(values: dict[str, Any], release: str = RELEASE) -> Rendered:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(with_images(values), name=release, namespace=NAMESPACE)
    return Rendered(files, parse_manifests(files))


def configs(rendered: Rendered, release: str = RELEASE) -> dict[str, Any]:
    """Every service's rendered config, loaded by its own model, by ConfigMap name."""
    out = {}
    for cm in rendered.of_kind("ConfigMap"):
        name = cm["metadata"]["name"]
        component = name.removeprefix(f"{release}-asymptote-").split("-")[0]
        if component in MODELS and "config.yaml" in cm["data"]:
            out[name] = MODELS[component].model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    return out


def test_every_value_set_gives_broker_and_generators_one_task(rendered: Rendered, value_set: str) -> None:
    loaded = configs(rendered)
    broker = loaded[f"{RELEASE}-asymptote-broker"]
    generators = [c for n, c in loaded.items() if n.startswith(f"{RELEASE}-asymptote-generator-")]
    assert generators
    assert {task_digest(g.task) for g in generators} == {task_digest(broker.task)}
    task = VALUE_SETS[value_set].get("task")
    if task:
        assert broker.task.name == task["name"]


@pytest.mark.parametrize(
    "model",
    [
        {"cache": {"existingClaim": "qwen3-8b"}},
        {"download": {"enabled": True, "repo": "Qwen/Qwen3-8B"}},
        {"cache": {"initContainers": [{"name": "fill", "image": "busybox"}]}},
    ],
    ids=["claim", "download", "init-containers"],
)
def test_a_model_without_a_task_is_refused_naming_task(model: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError, match=r"task is not set, and a model is .* set the top-level task"):
        render_with({"model": model})
    render_with({"model": model, "task": {"name": "arithmetic"}})  # the toy, asked for by name


@pytest.mark.parametrize("service", ["broker", "generator"])
def test_a_service_of_its_own_task_is_refused_by_the_schema(service: str) -> None:
    values = {service: {"config": {"task": {"name": "arithmetic", "max_digits": 2}}}}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="additional properties 'task'"):
        chart.validate_schema(values)
    pools = {"generatorPools": [{"name": "main", "config": {"task": {"name": "arithmetic"}}}]}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="additional properties 'task'"):
        chart.validate_schema(pools)


def test_a_task_the_services_would_refuse_is_refused_by_the_schema() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="/task"):
        chart.validate_schema({"task": {"name": "dataset", "preset": "gsm8k"}})  # no path


@pytest.mark.parametrize(
    ("release", "prefix"),
    [("lab", "lab"), ("lab-b", "lab_b"), ("run.2-x", "run_2_x"), ("7b-sweep", "r7b_sweep")],
)
def test_the_run_prefix_is_the_release_made_a_nats_prefix(release: str, prefix: str) -> None:
    loaded = configs(render_with({}, release), release)
    assert {c.prefix for c in loaded.values()} == {prefix}, loaded.keys()
    assert len(loaded) == 4
    names = Names(prefix)
    assert re.fullmatch(r"[A-Z][A-Z0-9_]*", names.tasks_stream) and re.fullmatch(
        r"[a-z][a-z0-9_-]*", names.policy_bucket
    )


def test_a_set_run_prefix_is_kept() -> None:
    loaded = configs(render_with({"run": {"prefix": "asy"}}, "lab-b"), "lab-b")
    assert {c.prefix for c in loaded.values()} == {"asy"}


def test_two_releases_get_streams_of_their_own() -> None:
    a = {c.prefix for c in configs(render_with({}, "lab-a"), "lab-a").values()}
    b = {c.prefix for c in configs(render_with({}, "lab-b"), "lab-b").values()}
    assert a == {"lab_a"} and b == {"lab_b"}


def test_the_dashboard_selects_the_release_in_every_query() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["release"]["definition"]
        == 'label_values(asymptote_broker_learner_version{namespace="$namespace"}, release)'
    )
    assert 'release="$release"' in variables["run"]["definition"]
    exprs = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(exprs) >= 60
    for expr in exprs:
        selectors = re.findall(r"\{([^}]*)\}", expr.replace("{{", "").replace("}}", ""))
        assert selectors, expr
        for selector in selectors:
            assert 'namespace="$namespace", release="$release"' in selector, expr


def test_service_monitors_label_every_series_with_the_release() -> None:
    rendered = render_with({"monitoring": {"serviceMonitors": {"enabled": True}}}, "lab-b")
    monitors = rendered.of_kind("ServiceMonitor")
    assert len(monitors) == 4
    for monitor in monitors:
        (endpoint,) = monitor["spec"]["endpoints"]
        assert {"targetLabel": "release", "replacement": "lab-b", "action": "replace"} in endpoint["relabelings"]
