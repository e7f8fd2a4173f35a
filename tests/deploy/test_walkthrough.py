"""The deploy guide's walkthrough is copy-paste correct where it can be
checked here: its values file, given to the umbrella chart's asymptote
part, renders with the real Helm SDK into objects that validate strictly,
with the monitoring the guide promises, and every kubectl command that
creates or changes something in a namespace names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from chart_render import CHART, REPO, STACK_CHART, parse_manifests, render_with
from test_chart_contents import load_service_config, pod_spec
from test_chart_validity import validate_object
from test_deploying_commands import read_page

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


def _fill_pod_volume() -> tuple[str, str, str]:
    """(claim, mount path, model folder) of the page's throwaway fill pod and its ``hf download``."""
    page = read_page(REPO / "docs" / "deploying.md")
    (run,) = [a for _, a in page.commands if a[:2] == ["kubectl", "run"]]
    overrides = json.loads(next(a.split("=", 1)[1] for a in run if a.startswith("--overrides=")))
    (volume,) = overrides["spec"]["volumes"]
    (mount,) = overrides["spec"]["containers"][0]["volumeMounts"]
    assert mount["name"] == volume["name"]
    (download,) = [a for _, a in page.commands if a[:2] == ["hf", "download"] and "Qwen/Qwen3-8B" in a]
    local_dir = download[download.index("--local-dir") + 1]
    return volume["persistentVolumeClaim"]["claimName"], mount["mountPath"], local_dir


def test_the_example_values_read_the_model_where_the_walkthrough_puts_it(tmp_path: Path) -> None:
    """The page's own values file, installed as the Install section says (and as the README does),
    mounts the claim the walkthrough fills and loads the model from the folder it fills, at the
    walkthrough's own model path; the task's files are on the same claim."""
    claim, fill_mount, local_dir = _fill_pod_volume()
    assert (claim, fill_mount, local_dir) == ("qwen3-8b", "/models", "/models/qwen3-8b")
    example = yaml.safe_load((REPO / "examples" / "helm" / "qwen3-gsm8k-values.yaml").read_text())
    walkthrough = yaml.safe_load(heredoc("lab-values.yaml"))["asymptote"]
    for values in (example, walkthrough):
        assert values["model"]["cache"]["existingClaim"] == claim
        assert values["model"]["path"] == local_dir
    images = yaml.safe_load(heredoc("images.yaml"))
    rendered = render_with(merged(example, images))
    chart_mount = yaml.safe_load((CHART / "values.yaml").read_text())["model"]["cache"]["mountPath"]
    assert chart_mount == fill_mount  # the same folders on the claim, seen at the same paths
    for component in ("generator", "learner"):
        spec = pod_spec(rendered, component)
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        config = load_service_config(rendered, component, tmp_path)
        model_dir = config.engine.model_dir if component == "generator" else config.model_dir
        assert model_dir == Path(local_dir)
    broker = load_service_config(rendered, "broker", tmp_path)
    assert isinstance(broker.task, DatasetSettings)
    assert {str(broker.task.path), str(broker.task.eval_path)} == {
        "/models/data/gsm8k_train.jsonl",
        "/models/data/gsm8k_test.jsonl",
    }
    assert "will find no model" not in rendered.files["asymptote/templates/NOTES.txt"]
