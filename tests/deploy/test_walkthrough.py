"""The deploy guide's walkthrough is copy-paste correct where it can be
checked here: its values file, given to the umbrella chart's asymptote
part, renders with the real Helm SDK into objects that validate strictly,
with the monitoring the guide promises, and every kubectl command that
creates or changes something in a namespace names it.
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import yaml
from chart_render import CHART, REPO, STACK_CHART, parse_manifests
from test_chart_validity import validate_object

from asymptote.tasks import ArithmeticSettings, DatasetSettings, task_digest
from services.broker.config import BrokerConfig
from services.generator.config import GeneratorConfig

GUIDE = (REPO / "docs" / "deploying.md").read_text()


def heredoc(name: str) -> str:
    match = re.search(rf"cat > {re.escape(name)} <<'EOF'\n(.*?)\n *EOF\n", GUIDE, flags=re.S)
    assert match, f"no heredoc writing {name} in docs/deploying.md"
    indent = len(match[1]) - len(match[1].lstrip(" "))
    return "\n".join(line[indent:] for line in match[1].splitlines())


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_the_walkthrough_values_render_a_monitored_autoscaled_release() -> None:
    values = yaml.safe_load(heredoc("lab-values.yaml"))
    assert set(values) == {"asymptote"}
    stack_defaults = yaml.safe_load((STACK_CHART / "values.yaml").read_text())["asymptote"]
    with helm.Chart.load(CHART) as chart:
        files = chart.render(merged(stack_defaults, values["asymptote"]), name="lab", namespace="rl")
    objects = parse_manifests(files)
    for obj in objects:
        validate_object(obj)
    kinds = {o["kind"] for o in objects}
    assert {"PrometheusRule", "ServiceMonitor", "ScaledObject"} <= kinds
    for obj in objects:
        if obj["kind"] in ("PrometheusRule", "ServiceMonitor"):
            assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (scaled,) = [o for o in objects if o["kind"] == "ScaledObject"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    config = yaml.safe_load(
        next(o for o in objects if o["metadata"]["name"] == "lab-asymptote-broker")["data"]["config.yaml"]
    )
    assert config["nats"]["url"] == "nats://lab-nats.rl.svc:4222" and config["nats"]["stream_replicas"] == 3
    images = {
        c["image"].split(":")[0]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"registry.example.com/you/asymptote-{r}" for r in ("generator", "learner", "broker", "fitter")}


def test_the_walkthrough_trains_gsm8k_with_one_task_in_broker_and_generators() -> None:
    """The broker and every generator pool of the walkthrough's release hold the same GSM8K task:
    their rendered configs, loaded by the services' own models, give one task digest."""
    values = yaml.safe_load(heredoc("lab-values.yaml"))
    stack_defaults = yaml.safe_load((STACK_CHART / "values.yaml").read_text())["asymptote"]
    with helm.Chart.load(CHART) as chart:
        files = chart.render(merged(stack_defaults, values["asymptote"]), name="lab", namespace="rl")
    maps = {o["metadata"]["name"]: o for o in parse_manifests(files) if o["kind"] == "ConfigMap"}
    broker = BrokerConfig.model_validate(yaml.safe_load(maps["lab-asymptote-broker"]["data"]["config.yaml"]))
    generators = [
        GeneratorConfig.model_validate(yaml.safe_load(o["data"]["config.yaml"]))
        for name, o in maps.items()
        if name.startswith("lab-asymptote-generator-")
    ]
    assert generators
    task = broker.task
    assert isinstance(task, DatasetSettings)
    assert (task.preset, task.verifier.kind, task.template) == ("gsm8k", "math", "chat")
    assert str(task.path) == "/models/data/gsm8k_train.jsonl"
    digests = {task_digest(broker.task), *(task_digest(g.task) for g in generators)}
    print("walkthrough task digest:", digests)
    assert digests == {task_digest(task)} and task_digest(task) != task_digest(ArithmeticSettings())
    # Each run its own streams: the prefix is the release's.
    assert broker.prefix == "lab" and {g.prefix for g in generators} == {"lab"}


def test_every_namespaced_kubectl_command_names_its_namespace() -> None:
    joined = re.sub(r"\\\n\s*", " ", GUIDE)  # a command continued over lines, as the shell reads it
    commands = re.findall(
        r"^\s*(kubectl (?:create|apply|delete|rollout|port-forward|label|annotate)\b.*)$", joined, flags=re.M
    )
    assert len(commands) >= 5
    for command in commands:
        if command.startswith("kubectl create namespace"):
            continue
        assert re.search(r"(^| )-n \S+", command), command
    helm_installs = re.findall(r"^\s*(helm (?:install|upgrade|test)\b.*)$", joined, flags=re.M)
    assert helm_installs and all(" -n " in c for c in helm_installs), helm_installs
