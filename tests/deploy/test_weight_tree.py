"""A generator pool on a weight fan-out tree: a StatefulSet whose pods dial each other by name.

With ``config.fanout.degree`` k > 0, generator i of a pool pulls each version
from generator i // k - 1 (services/generator/fanout.py), found through the
``peer_endpoint`` template. The chart makes that name real: the pool is a
StatefulSet (pod i is ``<pool>-i``, the ordinal the generator reads from its
host name) under a headless Service, and the template it writes resolves to
exactly those pods. The rest follows: the autoscaler scales a StatefulSet,
the network policy lets generators dial generators, and the gRPC
certificate names every pod. The pool beside it stays a Deployment.
"""

from __future__ import annotations

import yaml
from chart_render import NAMESPACE, RELEASE, render

from services.generator.config import FanoutSettings
from services.generator.fanout import parent_of

TREE = f"{RELEASE}-asymptote-generator-h100"
FLAT = f"{RELEASE}-asymptote-generator-a100"


def config_of(rendered: object, name: str) -> dict[str, object]:
    cm = rendered.get("ConfigMap", name)  # type: ignore[attr-defined]
    return dict(yaml.safe_load(cm["data"]["config.yaml"]))


def test_a_tree_pool_is_a_statefulset_under_a_headless_service() -> None:
    rendered = render("weight-fanout-tree")
    sts = rendered.get("StatefulSet", TREE)
    assert sts["spec"]["serviceName"] == f"{TREE}-peers" and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert "replicas" not in sts["spec"]  # KEDA owns the count
    peers = rendered.get("Service", f"{TREE}-peers")
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["template"]["metadata"]["labels"].items() >= peers["spec"]["selector"].items()
    # The other pool is untouched: a Deployment with no peers Service, no fan-out.
    assert rendered.get("Deployment", FLAT)["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert not [s for s in rendered.of_kind("Service") if s["metadata"]["name"] == f"{FLAT}-peers"]
    assert config_of(rendered, FLAT).get("fanout", {"degree": 0}) == {"degree": 0}
    assert sorted(rendered.pools()) == ["a100", "h100"]


def test_the_peer_template_names_the_statefulsets_pods() -> None:
    rendered = render("weight-fanout-tree")
    fanout = FanoutSettings.model_validate(config_of(rendered, TREE)["fanout"])
    assert fanout.degree == 4 and fanout.peer_timeout_s == 20.0 and fanout.index is None  # from the host name
    port = rendered.get("Service", f"{TREE}-peers")["spec"]["ports"][0]["port"]
    # Generator 9 pulls from generator 1: pod h100-1 under the headless Service, on its gRPC port.
    assert parent_of(9, fanout.degree) == 1
    assert fanout.peer_endpoint.format(index=1) == f"{TREE}-1.{TREE}-peers.{NAMESPACE}.svc:{port}"


def test_the_autoscaler_scales_the_statefulset() -> None:
    rendered = render("weight-fanout-tree")
    targets = {o["spec"]["scaleTargetRef"]["name"]: o["spec"]["scaleTargetRef"]["kind"]
               for o in rendered.of_kind("ScaledObject")}  # fmt: skip
    assert targets == {TREE: "StatefulSet", FLAT: "Deployment"}


def test_generators_may_dial_generators_only_with_a_tree() -> None:
    def generator_peers(value_set: str) -> tuple[list[str], list[str]]:
        policy = render(value_set).component("NetworkPolicy", "generator")
        selectors = [
            [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule.get(key, [])
             if "podSelector" in peer]
            for rule, key in ((policy["spec"]["ingress"][0], "from"),)
        ]  # fmt: skip
        egress = [
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for rule in policy["spec"]["egress"]
            for peer in rule.get("to", [])
            if "podSelector" in peer
        ]
        return selectors[0], egress

    ingress, egress = generator_peers("weight-fanout-tree")
    assert "generator" in ingress and {"learner", "generator"} <= set(egress)
    ingress, egress = generator_peers("defaults")
    assert "generator" not in ingress and "generator" not in egress


def test_the_grpc_certificate_names_every_tree_pod() -> None:
    (cert,) = render("weight-fanout-tree").of_kind("Certificate")
    assert f"*.{TREE}-peers.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert not [n for n in cert["spec"]["dnsNames"] if FLAT in n and "peers" in n]
