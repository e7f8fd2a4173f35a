"""What a first install on a GPU cluster needs from the chart: a learner
under torchrun across nodes, generator pools of different GPUs, pods sized
for the model's weight swaps, and generators that go idle when the run ends.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import CHART, NAMESPACE, RELEASE, parse_manifests, render, with_images
from test_chart_contents import allowed

FULLNAME = f"{RELEASE}-asymptote"
GIB = 2**30
# A weight swap's measured peak extra memory in the generator: 436.5 MB on a
# 396.5 MB model (tmpfs 396.6 MB + ~40 MB of pull buffers), one version staged.
SWAP_PEAK_RATIO = 436.5 / 396.5


def render_values(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        return parse_manifests(chart.render(with_images(values), name=RELEASE, namespace=NAMESPACE))


def torchrun_args(args: list[str]) -> argparse.Namespace:
    """torchrun's own flags, as its parser (torch.distributed.run) reads them, without importing torch."""
    parser = argparse.ArgumentParser()
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--shutdown-timeout",
    ):
        parser.add_argument(flag)
    parser.add_argument("-m", dest="module")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    return parser.parse_args(args)


@pytest.mark.parametrize(("value_set", "nodes", "per_node"), [("defaults", 1, 8), ("two-node-learner", 2, 8)])
def test_the_learners_world_is_nodes_times_gpus(value_set: str, nodes: int, per_node: int) -> None:
    rendered = render(value_set)
    learner = rendered.component("StatefulSet", "learner")
    (main,) = learner["spec"]["template"]["spec"]["containers"]
    assert main["command"] == ["torchrun"]
    args = torchrun_args(main["args"])
    world_size = int(args.nnodes) * int(args.nproc_per_node)
    assert (learner["spec"]["replicas"], int(args.nnodes), int(args.nproc_per_node)) == (nodes, nodes, per_node)
    assert world_size == nodes * per_node
    assert main["resources"]["limits"]["nvidia.com/gpu"] == per_node  # one process per GPU
    assert (args.module, args.rest) == ("services.cli", ["learner", "--config", "/etc/asymptote/config/config.yaml"])
    # Node k is pod k; rank 0 (the service) is on pod 0, whose stable name is the rendezvous.
    assert args.node_rank == "$(NODE_RANK)"
    node_rank = next(e for e in main["env"] if e["name"] == "NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    nodes_service = rendered.get("Service", f"{FULLNAME}-learner-nodes")
    assert learner["spec"]["serviceName"] == nodes_service["metadata"]["name"]
    assert nodes_service["spec"]["clusterIP"] == "None" and nodes_service["spec"]["publishNotReadyAddresses"] is True
    expected_master = "127.0.0.1" if nodes == 1 else f"{FULLNAME}-learner-0.{FULLNAME}-learner-nodes.{NAMESPACE}.svc"
    assert (args.master_addr, args.master_port) == (expected_master, "29500")
    # The group restarts as a unit: no in-place restart of one node's ranks.
    assert args.max_restarts == "0" and learner["spec"]["podManagementPolicy"] == "Parallel"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # Generators pull weights from pod 0 alone.
    service = rendered.component("Service", "learner")
    assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{FULLNAME}-learner-0"
    config = yaml.safe_load(rendered.component("ConfigMap", "learner")["data"]["config.yaml"])
    assert config["num_devices"] == world_size
    if nodes > 1:
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert (env["NCCL_IB_HCA"], env["NCCL_DEBUG"], env["NCCL_IB_GID_INDEX"]) == ("mlx5", "INFO", "3")
        pod = learner["spec"]["template"]
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rl-learner"
        assert pod["spec"]["schedulerName"] == "kueue-aware-scheduler"
        # NCCL's rings and the rendezvous: learner pods reach each other on any port.
        assert allowed(rendered, "learner", "learner", 45123, "nccl")


def test_every_generator_pool_feeds_the_one_learner() -> None:
    rendered = render("two-generator-pools")
    assert rendered.pools() == ["h100", "a100", "mig"]
    a100 = rendered.component("Deployment", "generator-a100")["spec"]["template"]["spec"]
    (main,) = a100["containers"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2 and a100["runtimeClassName"] == "nvidia"
    assert a100["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}
    assert a100["tolerations"] == [{"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}]
    config = yaml.safe_load(rendered.component("ConfigMap", "generator-a100")["data"]["config.yaml"])
    assert config["engine"]["tensor_parallel_size"] == 2 and config["engine"]["max_num_seqs"] == 128
    mig = rendered.component("Deployment", "generator-mig")["spec"]["template"]["spec"]["containers"][0]
    assert (
        mig["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 1 and "nvidia.com/gpu" not in mig["resources"]["limits"]
    )
    h100 = rendered.component("Deployment", "generator-h100")
    assert h100["spec"]["replicas"] == 8
    # Every pool's pods carry the component's labels: the learner admits them all, one Service fronts them all.
    for pool in rendered.pools():
        labels = rendered.component("Deployment", f"generator-{pool}")["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "generator"
    assert allowed(rendered, "generator", "learner", 50071, "grpc")


def test_a_pool_with_mismatched_tensor_parallelism_is_refused() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"generatorPools\[a100\]: tensorParallelSize \(2\) must equal gpus \(4\)"
    ):
        render_values({"generatorPools": [{"name": "a100", "gpus": 4, "tensorParallelSize": 2}]})
    with pytest.raises(helm.HelmRenderError, match='the name "x" is used twice'):
        render_values({"generatorPools": [{"name": "x"}, {"name": "x"}]})


def quantity_bytes(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2]) * GIB


def test_pods_hold_a_swaps_measured_peak_for_a_16_gib_model() -> None:
    """shm, memory and /tmp of generators and the learner, read from the rendered pods for model.sizeGiB 16."""
    size_gib = 16
    objects = render_values({"model": {"sizeGiB": size_gib}})
    model_bytes = size_gib * GIB
    peak_bytes = SWAP_PEAK_RATIO * model_bytes
    assert round(SWAP_PEAK_RATIO, 2) == 1.10
    sized = {}
    for kind, name, base_gib in (("Deployment", "generator-main", 16), ("StatefulSet", "learner", 32)):
        obj = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == f"{FULLNAME}-{name}")
        spec = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
        shm, tmp = quantity_bytes(volumes["shm"]["sizeLimit"]), quantity_bytes(volumes["tmp"]["sizeLimit"])
        resources = spec["containers"][0]["resources"]
        memory = quantity_bytes(resources["limits"]["memory"])
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        # One staged version on shm, never two: shm holds the peak and is well short of two versions' peak.
        assert peak_bytes <= shm < 2 * model_bytes
        # shm's pages count against the memory limit: what is left beside the process's own base holds the peak.
        assert memory - base_gib * GIB >= peak_bytes and memory >= shm + base_gib * GIB
        assert tmp - 8 * GIB >= peak_bytes  # caches, and a version staged on disk (weightsOn: disk)
        sized[name] = (shm // GIB, memory // GIB, tmp // GIB)
    # The one formula (asymptote.sizing): peak = ceil(1.10 x 16) = 18 GiB. The learner's memory also holds
    # a load (8 ranks x a float32 tenth of the model), 2 served versions and 1 being copied out, and checkpoint
    # staging (6 x sizeGiB):
    # test_chart_sizing.py checks those against services/learner/memory.py.
    peak_gib = math.ceil(1.10 * size_gib)
    load_served_staging = math.ceil(8 * 2 * size_gib / 10) + 3 * size_gib + 6 * size_gib
    assert sized == {
        "generator-main": (peak_gib + 2, 16 + peak_gib + 2, 8 + peak_gib),
        "learner": (peak_gib + 8, 32 + peak_gib + 8 + load_served_staging, 8 + peak_gib),
    }
    # Twice the model, twice the room (less rounding): the formula scales.
    bigger = render_values({"model": {"sizeGiB": 2 * size_gib}})
    generator = next(
        o for o in bigger if o["metadata"]["name"] == f"{FULLNAME}-generator-main" and o["kind"] == "Deployment"
    )
    shm = next(v for v in generator["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["sizeLimit"] == f"{math.ceil(1.10 * 2 * size_gib) + 2}Gi"


def test_keda_idles_the_pools_when_the_run_is_over() -> None:
    rendered = render("keda-scale-to-zero")
    gauge = f'max(asymptote_broker_desired_generators{{namespace="{NAMESPACE}", service="{FULLNAME}-broker"}})'
    shares = {}
    for pool in ("h100", "a100"):
        scaled = rendered.component("ScaledObject", f"generator-{pool}")["spec"]
        assert scaled["minReplicaCount"] == 0  # the gauge at 0 after max_steps takes the pool to no pods
        assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 1}
        (trigger,) = scaled["triggers"]
        assert trigger["metadata"]["ignoreNullValues"] == "false"  # no series is an error (fallback), not 0
        query = trigger["metadata"]["query"]
        assert query.startswith(f"ceil({gauge} * ")
        shares[pool] = float(query.removeprefix(f"ceil({gauge} * ").removesuffix(")"))
    assert shares == {"h100": 0.75, "a100": 0.25}  # weights 3 and 1
    assert (
        "queried from http://prometheus-operated.monitoring.svc:9090" in rendered.files["asymptote/templates/NOTES.txt"]
    )


def test_keda_without_a_scraped_broker_is_refused() -> None:
    keda = {"generator": {"autoscaling": {"keda": {"enabled": True, "serverAddress": "http://prom:9090"}}}}
    with pytest.raises(helm.HelmRenderError, match=r"set monitoring\.serviceMonitors\.enabled"):
        render_values(keda)
    custom = {
        "generator": {
            "autoscaling": {"keda": {"enabled": True, "serverAddress": "http://prom:9090", "query": "vector(2)"}}
        }
    }
    (scaled,) = [o for o in render_values(custom) if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == "vector(2)"


@pytest.mark.parametrize("component", ["generator-main", "learner", "broker", "fitter"])
def test_an_empty_affinity_clears_the_default(component: str) -> None:
    kind = "StatefulSet" if component == "learner" else "Deployment"
    key = component.split("-")[0]
    values: dict[str, Any] = {key: {"affinity": {}, "nodeSelector": {}}}
    obj = next(
        o for o in render_values(values) if o["kind"] == kind and o["metadata"]["name"] == f"{FULLNAME}-{component}"
    )
    assert "affinity" not in obj["spec"]["template"]["spec"]
