"""The chart sizes the 8B example as the memory planner (services/learner/memory.py) says it needs.

The example values file for Qwen3-8B is rendered with the real Helm SDK and
planned by ``asymptote plan``'s own reading of it (the example over the
chart's defaults): the learner takes every GPU of its node, its pod's memory
holds the planner's host figures beside the processes' own, its volume the
checkpoints kept plus the one being written, torchrun lets its ranks use the
pod's grace period to write the final checkpoint, the startup probe waits
for a resume, every learner pod probes itself over HTTP, and generators size
their KV cache by memory fraction.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart_render import EXAMPLES, Rendered, render

from services.generator.config import GeneratorConfig
from services.learner.memory import GIB, RunPlan
from services.ops.plan import PlanInputs, plan_inputs
from tests.helpers.families import QWEN3_8B, config_only

EXAMPLE = "example-qwen3-gsm8k"
BASE_GIB = 32
"""The learner pod's memory for its processes without the model's host copies (asymptote.sizing)."""
SLOWEST_VOLUME_BYTES_S = 100e6
"""A network volume's read rate the startup probe must allow a resume at."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[PlanInputs, RunPlan]:
    model_dir = config_only(tmp_path_factory.mktemp("Qwen3-8B"), QWEN3_8B)
    inputs = plan_inputs(["--model", str(model_dir), "--config", str(EXAMPLES / "qwen3-gsm8k-values.yaml")])
    return inputs, inputs.plan()


def learner_container(rendered: Rendered) -> dict[str, Any]:
    (main,) = rendered.component("StatefulSet", "learner")["spec"]["template"]["spec"]["containers"]
    return dict(main)


def gib(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


def test_the_learner_takes_every_gpu_of_its_node(planned: tuple[PlanInputs, RunPlan]) -> None:
    inputs, run = planned
    main = learner_container(render(EXAMPLE))
    assert main["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert "--nproc-per-node=8" in main["args"]
    assert inputs.gpus_per_node == 8 and run.learner.world_size == 8 and run.learner.layout == "fsdp"
    config = yaml.safe_load(render(EXAMPLE).component("ConfigMap", "learner")["data"]["config.yaml"])
    assert config["micro_batch_tokens"] == inputs.learner.micro_batch_tokens == 32768
    assert config["activation_checkpointing"] is True
    assert run.learner.fits and run.learner.total_bytes <= 0.9 * 80 * GIB


def test_the_learner_pod_holds_the_planned_host_memory(planned: tuple[PlanInputs, RunPlan]) -> None:
    _, run = planned
    rendered = render(EXAMPLE)
    main = learner_container(rendered)
    memory = gib(main["resources"]["limits"]["memory"])
    assert main["resources"]["requests"]["memory"] == main["resources"]["limits"]["memory"]
    volumes = {
        v["name"]: v for v in rendered.component("StatefulSet", "learner")["spec"]["template"]["spec"]["volumes"]
    }
    shm = gib(volumes["shm"]["emptyDir"]["sizeLimit"])
    # Beside the processes' own memory and /dev/shm (whose pages count against the limit): the planner's
    # load (a float32 tensor per rank), the versions rank 0 serves, and checkpoint staging.
    assert (memory - BASE_GIB - shm) * GIB >= run.host.load_bytes + run.host.served_bytes + run.host.staging_bytes
    assert run.host.host_bytes == pytest.approx(155.85 * GIB, abs=0.1 * GIB)
    # The chart's model.sizeGiB (2 bytes a parameter) is at least the model's bf16 size.
    assert 16 * GIB >= 2 * run.shape.num_parameters


def test_the_volume_holds_the_checkpoints_kept_the_best_and_one_more(planned: tuple[PlanInputs, RunPlan]) -> None:
    inputs, run = planned
    (claim,) = render(EXAMPLE).component("StatefulSet", "learner")["spec"]["volumeClaimTemplates"]
    storage = gib(claim["spec"]["resources"]["requests"]["storage"])
    assert inputs.learner.keep_best_checkpoint
    assert run.host.checkpoints_on_disk == inputs.learner.keep_checkpoints + 2 == 4
    assert storage * GIB >= run.host.checkpoint_bytes * run.host.checkpoints_on_disk
    assert run.host.checkpoint_bytes >= 12 * run.shape.num_parameters


def test_torchrun_gives_the_ranks_the_grace_period(planned: tuple[PlanInputs, RunPlan]) -> None:
    _, run = planned
    for value_set in (EXAMPLE, "two-node-learner"):
        learner = render(value_set).component("StatefulSet", "learner")
        grace = learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        (timeout,) = [a for a in learner_container(render(value_set))["args"] if a.startswith("--shutdown-timeout=")]
        seconds = int(timeout.removeprefix("--shutdown-timeout="))
        # torchrun's default of 30 s would kill the final checkpoint; the ranks get all but 30 s of the grace.
        assert grace - 30 <= seconds < grace
    # The final checkpoint at 8B, written at a network volume's pace, fits in the grace period.
    assert grace >= run.host.checkpoint_bytes / (2 * SLOWEST_VOLUME_BYTES_S)


def test_every_learner_pod_probes_itself_over_http(planned: tuple[PlanInputs, RunPlan]) -> None:
    _, run = planned
    for value_set in (EXAMPLE, "two-node-learner"):
        main = learner_container(render(value_set))
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/readyz")):
            assert main[probe]["httpGet"] == {"path": path, "port": "http"}
            assert "exec" not in main[probe]
    startup = learner_container(render(EXAMPLE))["startupProbe"]
    # Long enough for a resume: reading a whole 8B checkpoint at a slow network volume's rate.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= run.host.checkpoint_bytes / SLOWEST_VOLUME_BYTES_S


def test_generators_size_their_kv_cache_by_memory_fraction(planned: tuple[PlanInputs, RunPlan]) -> None:
    inputs, run = planned
    rendered = render(EXAMPLE)
    (pool,) = rendered.pools()
    text = rendered.component("ConfigMap", f"generator-{pool}")["data"]["config.yaml"]
    config = GeneratorConfig.model_validate(yaml.safe_load(text))
    assert config.engine.kv_cache_memory_bytes is None and config.engine.gpu_memory_utilization == 0.9
    assert inputs.engine.kv_cache_memory_bytes is None
    # By fraction, an 80 GiB GPU holds over 40 sequences of 512 + 8192 tokens of Qwen3-8B's KV.
    assert run.generator.sequences >= 40 and run.generator.total_bytes <= 80 * GIB
