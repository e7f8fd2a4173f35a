"""The Helm chart rendered with the real Helm SDK (helm-python-sdk binds
Helm v4's Go library), once per value set per process, and the value sets
the tests prove it with.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "asymptote"
STACK_CHART = REPO / "deploy" / "helm" / "asymptote-stack"
RELEASE = "lab"
NAMESPACE = "rl"
DIGEST = "sha256:" + "ab" * 32

EXAMPLES = REPO / "examples" / "helm"

IMAGE_ROLES = ("generator", "learner", "broker", "fitter", "sandboxPool")
IMAGES: dict[str, Any] = {
    "images": {role: {"repository": f"registry.example/asymptote-{role}"} for role in IMAGE_ROLES}
}
"""Where a release's images are: the chart has no default and refuses to render without them, so every
value set is rendered over these (a value set's own ``images`` win), as a user's values file sets them."""


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key, as Helm merges values files."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def with_images(values: dict[str, Any]) -> dict[str, Any]:
    return merged(IMAGES, values)


# The value sets the chart is proven with; every test that renders uses these
# (the example values files for users among them).
VALUE_SETS: dict[str, dict[str, Any]] = {
    **{
        f"example-{p.name.removesuffix('-values.yaml')}": yaml.safe_load(p.read_text()) for p in EXAMPLES.glob("*.yaml")
    },
    "defaults": {},
    "many-generators-keda": {
        "generator": {
            "gpus": 2,
            "autoscaling": {
                "minReplicas": 4,
                "maxReplicas": 64,
                "keda": {"enabled": True, "serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
            },
            "config": {"engine": {"dtype": "bfloat16", "max_num_seqs": 512}, "max_inflight_groups": 64},
        },
        "images": {
            role: {"repository": f"registry.example/asymptote-{role}", "digest": DIGEST}
            for role in ("generator", "learner", "broker", "fitter")
        },
        "monitoring": {
            "serviceMonitors": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
    },
    # A learner across two 8-GPU nodes over InfiniBand, on its own node pool.
    "two-node-learner": {
        "learner": {
            "nodes": 2,
            "gpusPerNode": 8,
            "nccl": {"socketIfname": "eth0", "ibHca": "mlx5", "debug": "INFO", "env": {"NCCL_IB_GID_INDEX": "3"}},
            "nodeSelector": {"cloud.google.com/gke-nodepool": "learner-h100"},
            "podLabels": {"kueue.x-k8s.io/queue-name": "rl-learner"},
            "schedulerName": "kueue-aware-scheduler",
        },
        "model": {"sizeGiB": 16, "cache": {"existingClaim": "qwen3-8b"}},
        "task": {"name": "arithmetic", "max_digits": 4},
    },
    # Two generator pools: H100s one GPU each, and A100s in pairs (tensor
    # parallelism 2) on another node pool, under the NVIDIA runtime class, one on MIG slices.
    "two-generator-pools": {
        "generator": {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
            ],
            "podLabels": {"kueue.x-k8s.io/queue-name": "rl-generators"},
            "extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}],
            "extraVolumes": [{"name": "hf-cache", "emptyDir": {"sizeLimit": "1Gi"}}],
            "extraVolumeMounts": [{"name": "hf-cache", "mountPath": "/var/cache/hf"}],
        },
        "generatorPools": [
            {"name": "h100", "replicas": 8, "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}},
            {
                "name": "a100",
                "replicas": 3,
                "gpus": 2,
                "tensorParallelSize": 2,
                "runtimeClassName": "nvidia",
                "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
                "tolerations": [{"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}],
                "affinity": {},
                "config": {"engine": {"max_num_seqs": 128}},
            },
            {"name": "mig", "replicas": 2, "gpuResourceName": "nvidia.com/mig-3g.40gb"},
        ],
    },
    # KEDA over two pools that idle at zero once the run is done; alerts on.
    "keda-scale-to-zero": {
        "generator": {
            "autoscaling": {
                "minReplicas": 0,
                "maxReplicas": 32,
                "keda": {"enabled": True, "serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
            }
        },
        "generatorPools": [{"name": "h100", "autoscaling": {"weight": 3}}, {"name": "a100", "gpus": 2}],
        "monitoring": {
            "serviceMonitors": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
    },
    "external-nats-credentials": {
        "nats": {
            "url": "tls://nats-0.example.internal:4222,tls://nats-1.example.internal:4222",
            "auth": {"user": "asymptote", "password": "s3cret-but-rendered"},
            "tls": {"caSecret": "nats-ca"},
        },
        "model": {"cache": {"existingClaim": "qwen3-8b"}, "path": "/models/qwen3-8b"},
        "task": {
            "name": "dataset",
            "path": "/models/data/train.parquet",
            "holdout_fraction": 0.05,
            "fields": {"prompt": "problem", "answer": "solution", "id": None},
            "verifier": {"kind": "exact"},
        },
        "networkPolicy": {"natsTo": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "natsPorts": [4222]},
        "run": {"prefix": "ablation_b", "name": "cispo-8b", "batchPrompts": 48},
        "learner": {"config": {"loss": {"name": "dapo", "tis_cap": 2.0}, "max_steps": 500}},
    },
    "nats-creds-file": {
        "nats": {"url": "nats://nats.shared.svc:4222", "auth": {"credsSecret": "asymptote-nats-creds"}},
        "learner": {"persistence": {"enabled": False}},
        "fitter": {"persistence": {"enabled": False}},
    },
    "monitoring-hpa": {
        "monitoring": {
            "serviceMonitors": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "dashboard": {"enabled": True, "annotations": {"grafana_folder": "RL"}},
        },
        "generator": {"autoscaling": {"hpa": {"enabled": True}}},
        "nats": {"auth": {"existingSecret": "nats-users", "userKey": "username", "passwordKey": "password"}},
    },
    # The model and a dataset fetched from the hub by init containers, with a token Secret.
    "model-download": {
        "model": {
            "path": "/models/qwen3-8b",
            "download": {
                "enabled": True,
                "repo": "Qwen/Qwen3-8B",
                "revision": "main",
                "tokenSecret": {"name": "hf-token", "key": "token"},
                "datasets": [{"repo": "openai/gsm8k", "path": "data/gsm8k", "files": ["main/*.parquet"]}],
            },
        },
        "task": {
            "name": "dataset",
            "path": "/models/data/gsm8k/main/train-00000-of-00001.parquet",
            "eval_path": "/models/data/gsm8k/main/test-00000-of-00001.parquet",
            "preset": "gsm8k",
        },
        "networkPolicy": {"downloadTo": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}]},
    },
    "grpc-tls-secret": {
        "grpcTls": {"enabled": True, "secretName": "asymptote-grpc-tls", "serverName": "asymptote.internal"},
    },
    # One pool pulls weights down a fan-out tree of degree 4 (a StatefulSet), one from the learner; mTLS on.
    "weight-fanout-tree": {
        "generator": {
            "autoscaling": {
                "maxReplicas": 64,
                "keda": {"enabled": True, "serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
            }
        },
        "generatorPools": [
            {"name": "a100", "gpus": 2},
            {"name": "h100", "config": {"fanout": {"degree": 4, "peer_timeout_s": 20.0}}},
        ],
        "monitoring": {"serviceMonitors": {"enabled": True}},
        "grpcTls": {
            "enabled": True,
            "secretName": "lab-grpc-tls",
            "requireClientCert": True,
            "certManager": {"issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}},
        },
    },
    "grpc-mtls-cert-manager": {
        "grpcTls": {
            "enabled": True,
            "secretName": "lab-grpc-tls",
            "requireClientCert": True,
            "certManager": {
                "issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"},
                "extraDnsNames": ["lab-asymptote-generator.rl.svc.cluster.local"],
            },
        },
        "nats": {"auth": {"credsSecret": "asymptote-nats-creds"}, "tls": {"caSecret": "nats-ca"}},
    },
    # A code task whose programs run in the sandbox pool, under gVisor (where no sandbox backend
    # passes, so the runtime class is the boundary), with mTLS between the pods.
    "sandbox-pool-gvisor": {
        "model": {"cache": {"existingClaim": "qwen3-8b"}, "path": "/models/qwen3-8b"},
        "task": {
            "name": "dataset",
            "path": "/models/data/mbpp/train.jsonl",
            "eval_path": "/models/data/mbpp/test.jsonl",
            "preset": "mbpp",
            "verifier": {"kind": "code", "test_timeout_s": 4.0, "program_timeout_s": 20.0},
            "score_timeout_s": 30.0,
        },
        "sandboxPool": {
            "enabled": True,
            "replicas": 3,
            "runtimeClassName": "gvisor",
            "config": {"max_concurrent_runs": 8, "max_runs": 5000, "sandbox": {"unsafe_no_sandbox": True}},
        },
        "images": {"sandboxPool": {"repository": "registry.example/asymptote-sandbox-pool", "digest": DIGEST}},
        "grpcTls": {
            "enabled": True,
            "secretName": "lab-grpc-tls",
            "requireClientCert": True,
            "certManager": {"issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}},
        },
    },
}


@dataclass
class Rendered:
    """One rendering: the template outputs and the Kubernetes objects in them."""

    files: dict[str, str]
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, (
            f"{kind}/{name}: found {len(found)} of {[o['metadata']['name'] for o in self.of_kind(kind)]}"
        )
        return found[0]

    def component(self, kind: str, component: str) -> dict[str, Any]:
        return self.get(kind, f"{RELEASE}-asymptote-{component}")

    def pools(self) -> list[str]:
        """Names of the generator pools: a Deployment each, or a StatefulSet for a pool on a fan-out tree."""
        prefix = f"{RELEASE}-asymptote-generator-"
        return [
            d["metadata"]["name"].removeprefix(prefix)
            for d in self.of_kind("Deployment") + self.of_kind("StatefulSet")
            if d["metadata"]["name"].startswith(prefix)
        ]


def parse_manifests(files: dict[str, str]) -> list[dict[str, Any]]:
    objects = []
    for path, text in sorted(files.items()):
        if not path.endswith(".yaml"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


@cache
def render(value_set: str) -> Rendered:
    return render_with(VALUE_SETS[value_set])


def render_with(values: dict[str, Any], release: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    """The chart rendered with ``values`` over the test images (the values' own ``images`` win)."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(with_images(values), name=release, namespace=namespace)
    return Rendered(files, parse_manifests(files))


def render_stack(workdir: Path) -> Rendered:
    """The umbrella chart with the asymptote chart vendored as `helm dependency build` would."""
    stack = workdir / "asymptote-stack"
    shutil.copytree(STACK_CHART, stack)
    shutil.copytree(CHART, stack / "charts" / "asymptote")
    with helm.Chart.load(stack) as chart:
        files = chart.render({"asymptote": IMAGES}, name=RELEASE, namespace=NAMESPACE)
    return Rendered(files, parse_manifests(files))


def dashboard() -> dict[str, Any]:
    return dict(json.loads((CHART / "files" / "asymptote-dashboard.json").read_text()))
