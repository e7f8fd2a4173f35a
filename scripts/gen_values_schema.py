"""Write deploy/helm/asymptote/values.schema.json.

The chart's own values are typed here; each service's ``<service>.config``
is typed by that service's pydantic config model (services/<service>/config.py),
less the fields the chart owns (NATS, listeners, the shared run settings and
paths it mounts), so `helm install` rejects a value the service would refuse.
A test regenerates the schema and fails if the committed file differs:
run ``python scripts/gen_values_schema.py`` after changing a config model.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "deploy" / "helm" / "asymptote" / "values.schema.json"

# Config fields the chart renders itself (templates/_helpers.tpl and each
# service's template); a value for one of them would be overwritten, so the
# schema refuses it. Dotted paths are fields of a nested section.
# grpc_tls comes from the chart's grpcTls values, with the certificate it mounts;
# task from the top-level `task`, one for the broker and every generator pool; lora from the top-level
# `lora`, one for the learner and every generator pool.
OWNED_FIELDS: dict[str, tuple[str, ...]] = {
    "broker": ("nats", "prefix", "grpc", "grpc_tls", "http", "log_format", "batch_prompts", "task"),
    "generator": (
        "nats",
        "prefix",
        "task",
        "grpc",
        "grpc_tls",
        "http",
        "log_format",
        "weights_dir",
        "num_devices",
        "engine.model_dir",
        "fanout.peer_endpoint",
        "fanout.index",
        "sandbox_pool",
        "lora",
    ),
    "learner": (
        "nats",
        "prefix",
        "grpc",
        "grpc_tls",
        "http",
        "log_format",
        "model_dir",
        "run_dir",
        "batch_prompts",
        "broker_endpoint",
        "advertise_host",
        "num_devices",
        "lora",
    ),
    "fitter": ("nats", "prefix", "grpc", "grpc_tls", "http", "log_format", "run_dir", "run_name"),
    # The generators' sandbox_pool above: the chart points them at sandboxPool when it is enabled.
    "sandbox_pool": ("grpc", "grpc_tls", "http", "log_format"),
}


def config_models() -> dict[str, type[BaseModel]]:
    sys.path.insert(0, str(REPO))
    from services.broker.config import BrokerConfig
    from services.fitter.config import FitterConfig
    from services.generator.config import GeneratorConfig
    from services.learner.config import LearnerConfig
    from services.sandbox_pool.config import SandboxPoolConfig

    return {
        "broker": BrokerConfig,
        "generator": GeneratorConfig,
        "learner": LearnerConfig,
        "fitter": FitterConfig,
        "sandbox_pool": SandboxPoolConfig,
    }


def _rename_refs(node: Any, service: str) -> Any:
    if isinstance(node, dict):
        return {
            k: (v.replace("#/$defs/", f"#/$defs/{service}.") if k == "$ref" else _rename_refs(v, service))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rename_refs(v, service) for v in node]
    return node


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else schema


def _refs(node: Any) -> set[str]:
    """Names of the $defs that ``node`` refers to directly."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if "$ref" in node else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _used_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The $defs ``schema`` reaches, directly or through other $defs (the owned fields' drop out)."""
    used: set[str] = set()
    todo = _refs(schema)
    while todo:
        name = todo.pop()
        used.add(name)
        todo |= _refs(defs[name]) - used
    return {name: defs[name] for name in sorted(used)}


def service_config_schema(service: str, model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of ``<service>.config``, its $defs keyed ``<service>.<Model>``)."""
    schema = copy.deepcopy(model.model_json_schema(mode="validation"))
    defs = schema.pop("$defs", {})
    for path in OWNED_FIELDS[service]:
        *parents, leaf = path.split(".")
        node = schema
        for parent in parents:
            node = _resolve(node["properties"][parent], defs)
        del node["properties"][leaf]
        if leaf in node.get("required", []):
            node["required"].remove(leaf)
            if not node["required"]:
                del node["required"]
        if parents and parents[0] in schema.get("required", []):
            schema["required"].remove(parents[0])  # the chart fills in what was required
            if not schema["required"]:
                del schema["required"]
    defs = _used_defs(schema, defs)
    schema.pop("title", None)
    schema["description"] = (
        f"{model.__name__} fields (services/{service}/config.py) except those the chart owns: "
        + ", ".join(OWNED_FIELDS[service])
    )
    return _rename_refs(schema, service), {f"{service}.{k}": _rename_refs(v, service) for k, v in defs.items()}


def task_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of the top-level ``task``, its $defs keyed ``task.<Model>``): the services' TaskSettings."""
    sys.path.insert(0, str(REPO))
    from pydantic import TypeAdapter

    from asymptote.tasks import TaskSettings

    schema = copy.deepcopy(TypeAdapter(TaskSettings).json_schema(mode="validation"))
    defs = schema.pop("$defs", {})
    schema["description"] = (
        "The run's task (asymptote.tasks: arithmetic or dataset), rendered into the broker's and every "
        "generator pool's config; {} = none, refused once a model is set (model.cache.existingClaim, "
        "model.download or model.cache.initContainers)"
    )
    return _rename_refs(schema, "task"), {f"task.{k}": _rename_refs(v, "task") for k, v in defs.items()}


def lora_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of the top-level ``lora``, its $defs keyed ``lora.<Model>``): the learner's LoraSettings, or {}."""
    sys.path.insert(0, str(REPO))
    from asymptote.lora import LoraSettings

    schema = copy.deepcopy(LoraSettings.model_json_schema(mode="validation"))
    defs = schema.pop("$defs", {})
    schema = {
        "anyOf": [{"type": "object", "maxProperties": 0}, schema],
        "description": (
            "The run trains a LoRA adapter (asymptote.lora.LoraSettings), rendered into the learner's and every "
            "generator pool's config; {} = none, every weight trains. The learning rate stays "
            "learner.config.optimizer.lr: LoRA's is about 10x full fine-tuning's (docs/recipe.md)"
        ),
    }
    return _rename_refs(schema, "lora"), {f"lora.{k}": _rename_refs(v, "lora") for k, v in defs.items()}


def obj(
    properties: dict[str, Any], required: tuple[str, ...] = (), description: str = "", **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    out.update(extra)
    return out


STR = {"type": "string"}
BOOL = {"type": "boolean"}
OBJECT = {"type": "object"}
ARRAY = {"type": "array"}
PEERS = {
    "type": "array",
    "items": {"type": "object"},
    "description": "NetworkPolicy peers (podSelector, namespaceSelector, ipBlock)",
}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
DNS_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$"
# A namespace name (an RFC 1123 label).
NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"}
RESOURCES = obj(
    {
        "requests": {"type": "object", "required": ["cpu", "memory"]},
        "limits": {"type": "object", "required": ["cpu", "memory"]},
    },
    required=("requests", "limits"),
    description="Kubernetes requests and limits (cpu, memory); every container has both",
)
GPU_RESOURCES = obj(
    {
        "requests": {"type": "object", "required": ["cpu"]},
        "limits": {"type": "object", "required": ["cpu"]},
    },
    required=("requests", "limits"),
    description="Kubernetes requests and limits: cpu; memory is sized from model.sizeGiB unless set here",
)
# A GPU as the device plugin advertises it: nvidia.com/gpu, a MIG slice (nvidia.com/mig-3g.40gb), amd.com/gpu...
GPU_RESOURCE_NAME = {"type": "string", "pattern": r"^[a-z0-9.-]+/[a-z0-9.-]+$"}


def image() -> dict[str, Any]:
    return obj(
        {
            # Empty by default (the chart ships no image), so the schema takes it empty; the templates
            # refuse an empty one the release deploys (sandboxPool's only when enabled), naming it.
            "repository": {
                "type": "string",
                "pattern": r"^\S*$",
                "description": "where the image was pushed, e.g. registry.example.com/you/asymptote-generator",
            },
            "tag": STR,
            "digest": {"type": "string", "pattern": r"^(sha256:[a-f0-9]{64})?$"},
        },
        required=("repository",),
    )


def persistence(sized: bool = False) -> dict[str, Any]:
    """A volume claim's values; ``sized``: an empty size is computed by the chart (asymptote.sizing)."""
    size = QUANTITY
    if sized:
        size = {
            "type": "string",
            "pattern": "^$|" + QUANTITY["pattern"],
            "description": '"" = sized for the checkpoints kept (asymptote.sizing)',
        }
    return obj(
        {
            "enabled": BOOL,
            "size": size,
            "storageClassName": STR,
            "accessModes": {
                "type": "array",
                "minItems": 1,
                "items": {"enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]},
            },
        },
        required=("enabled", "size"),
    )


def service_values(service: str, config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {
        "ports": obj({"grpc": PORT, "http": PORT}, required=("grpc", "http")),
        "resources": RESOURCES,
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": {"type": "object"}},
        "affinity": OBJECT,
        "topologySpreadConstraints": {"type": "array", "items": {"type": "object", "required": ["topologyKey"]}},
        "runtimeClassName": STR,
        "schedulerName": STR,
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
        "priorityClassName": STR,
        "podLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "extraEnv": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "extraVolumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "extraVolumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
        "config": config,
    }
    props.update(extra)
    return obj(props, required=("ports", "resources", "config"), description=f"The {service}")


def _optional(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with nothing required at any depth: a pool sets only what it changes."""
    if isinstance(schema, dict):
        return {k: _optional(v) for k, v in schema.items() if k not in ("required", "allOf")}
    return schema


def startup_probe() -> dict[str, Any]:
    return obj(
        {"periodSeconds": {"type": "integer", "minimum": 1}, "failureThreshold": {"type": "integer", "minimum": 1}},
        required=("periodSeconds", "failureThreshold"),
    )


def _at(path: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Matches an object whose property at the dotted ``path`` is present and matches ``schema``."""
    for key in reversed(path.split(".")):
        schema = {"properties": {key: schema}, "required": [key]}
    return schema


def grpc_tls() -> dict[str, Any]:
    enabled = _at("enabled", {"const": True})
    return obj(
        {
            "enabled": BOOL,
            "secretName": STR,
            "requireClientCert": BOOL,
            "serverName": {"type": "string", "pattern": DNS_NAME},
            "certManager": obj(
                {
                    "issuerRef": obj(
                        {
                            "name": STR,
                            "kind": {"type": "string", "minLength": 1},
                            "group": {"type": "string", "minLength": 1},
                        },
                    ),
                    "extraDnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
                },
                description="cert-manager issues the certificate when issuerRef.name is set",
            ),
        },
        required=("enabled",),
        description="TLS on every service's gRPC from a Secret with tls.crt, tls.key and ca.crt",
        # Each setting needs the one it refines: no TLS details without TLS, no TLS without a Secret.
        allOf=[
            {"if": enabled, "then": _at("secretName", {"minLength": 1})},
            {"if": _at("requireClientCert", {"const": True}), "then": enabled},
            {"if": _at("serverName", {"minLength": 1}), "then": enabled},
            {"if": _at("certManager.issuerRef.name", {"minLength": 1}), "then": enabled},
        ],
    )


def values_schema() -> dict[str, Any]:
    configs: dict[str, dict[str, Any]] = {}
    defs: dict[str, Any] = {}
    for service, model in config_models().items():
        configs[service], service_defs = service_config_schema(service, model)
        defs.update(service_defs)
    task, task_defs = task_schema()
    defs.update(task_defs)
    lora, lora_defs = lora_schema()
    defs.update(lora_defs)
    pattern_prefix = config_models()["broker"].model_fields["prefix"].metadata
    prefix_pattern = next(m.pattern for m in pattern_prefix if hasattr(m, "pattern"))
    autoscaling = obj(
        {
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 1},
            "weight": {"type": "number", "exclusiveMinimum": 0, "description": "This pool's part of the gauge"},
            "scaleDownStabilizationSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
            "keda": obj(
                {
                    "enabled": BOOL,
                    "pollingIntervalSeconds": {"type": "integer", "minimum": 1},
                    "cooldownPeriodSeconds": {"type": "integer", "minimum": 0},
                    "serverAddress": {"type": "string", "pattern": r"^(https?://\S+)?$"},
                    "query": STR,
                    "fallbackReplicas": {"type": "integer", "minimum": 0},
                },
                required=("enabled",),
            ),
            "hpa": obj(
                {
                    "enabled": BOOL,
                    "metricName": {"type": "string", "minLength": 1},
                    "metricSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                required=("enabled",),
            ),
        },
        required=("minReplicas", "maxReplicas", "keda", "hpa"),
        description="Generators follow the broker's asymptote_broker_desired_generators gauge (KEDA or an HPA, not both)",
        allOf=[
            {
                "if": {"properties": {"keda": {"properties": {"enabled": {"const": True}}}}},
                "then": {
                    "properties": {
                        "hpa": {"properties": {"enabled": {"const": False}}},
                        "keda": {"properties": {"serverAddress": {"minLength": 1}}},
                    }
                },
            }
        ],
    )
    generator = service_values(
        "generators: the settings every pool shares (vLLM on GPU node pools)",
        configs["generator"],
        {
            "resources": GPU_RESOURCES,
            "replicas": {"type": "integer", "minimum": 0},
            "gpus": {"type": "integer", "minimum": 1},
            "tensorParallelSize": {"type": "integer", "minimum": 1},
            "gpuResourceName": GPU_RESOURCE_NAME,
            "weightsOn": {"enum": ["memory", "disk"]},
            "maxUnavailable": {"type": "integer", "minimum": 1},
            "startupProbe": startup_probe(),
            "pdb": obj({"enabled": BOOL, "maxUnavailable": {"type": "integer", "minimum": 1}}, required=("enabled",)),
            "autoscaling": autoscaling,
        },
    )
    generator_pools = {
        "type": "array",
        "minItems": 1,
        "description": "Generator pools: a Deployment each; a key set here replaces generator's (config, autoscaling merge)",
        "items": obj(
            {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$"},
                **{k: _optional(v) for k, v in generator["properties"].items()},
            },
            required=("name",),
        ),
    }
    learner = service_values(
        "learner (torchrun on learner.nodes pods of a StatefulSet, on its own GPU pool)",
        configs["learner"],
        {
            "resources": GPU_RESOURCES,
            "nodes": {"type": "integer", "minimum": 1},
            "gpusPerNode": {"type": "integer", "minimum": 1},
            "gpuResourceName": GPU_RESOURCE_NAME,
            "rendezvousPort": PORT,
            "nccl": obj(
                {
                    "socketIfname": STR,
                    "ibHca": STR,
                    "debug": {"enum": ["", "VERSION", "WARN", "INFO", "TRACE"]},
                    "env": {
                        "type": "object",
                        "propertyNames": {"pattern": "^(NCCL|TORCH_NCCL|GLOO)_[A-Z0-9_]+$"},
                        "additionalProperties": {"type": "string"},
                    },
                },
                description="NCCL between the learner's ranks: interfaces, InfiniBand HCAs, debug, other NCCL_* settings",
            ),
            "persistence": persistence(sized=True),
            "startupProbe": startup_probe(),
        },
    )
    broker = service_values("broker (CPU nodes)", configs["broker"], {})
    fitter = service_values("fitter (CPU nodes)", configs["fitter"], {"persistence": persistence()})
    sandbox_pool = service_values(
        "sandbox pool: code tasks' programs, in pods of their own that the generators call",
        configs["sandbox_pool"],
        {
            "enabled": BOOL,
            "replicas": {"type": "integer", "minimum": 1},
            "podSecurityContext": OBJECT,
            "containerSecurityContext": OBJECT,
            "tmpSizeLimit": QUANTITY,
            "pdb": obj({"enabled": BOOL, "maxUnavailable": {"type": "integer", "minimum": 1}}, required=("enabled",)),
        },
    )
    sandbox_pool["required"] = [*sandbox_pool["required"], "enabled"]
    nats = obj(
        {
            "url": {
                "type": "string",
                "pattern": r"^(((nats|tls|ws|wss)://[^,\s]+)(,(nats|tls|ws|wss)://[^,\s]+)*|.*\{\{.*\}\}.*)$",
                "description": "NATS URL(s), comma separated; templates allowed",
            },
            "streamReplicas": {
                "type": "integer",
                "minimum": 1,
                "maximum": 5,
                "description": "JetStream replicas of every stream and KV bucket (3 on a 3-server cluster)",
            },
            "auth": obj(
                {
                    "user": STR,
                    "password": STR,
                    "existingSecret": STR,
                    "userKey": {"type": "string", "minLength": 1},
                    "passwordKey": {"type": "string", "minLength": 1},
                    "credsSecret": STR,
                    "credsKey": {"type": "string", "minLength": 1},
                },
                allOf=[
                    {
                        "if": {"properties": {"user": {"minLength": 1}}, "required": ["user"]},
                        "then": {"properties": {"password": {"minLength": 1}}, "required": ["password"]},
                    }
                ],
            ),
            "tls": obj({"caSecret": STR, "caKey": {"type": "string", "minLength": 1}}),
        },
        required=("url",),
        description="An existing NATS with JetStream",
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Asymptote chart values",
        "description": "Generated by scripts/gen_values_schema.py from the chart's values and the services' config models.",
        "type": "object",
        "additionalProperties": False,
        "required": ["run", "nats", "model", "images", "generator", "generatorPools", "learner", "broker", "fitter"],
        "properties": {
            "global": OBJECT,
            "nameOverride": STR,
            "fullnameOverride": {"type": "string", "maxLength": 40},
            "run": obj(
                {
                    "prefix": {
                        "type": "string",
                        "pattern": f"^$|{prefix_pattern}",
                        "description": '"" = the release name, "-" and "." as "_"',
                    },
                    "name": STR,
                    "batchPrompts": {"type": "integer", "minimum": 1},
                    "claimsOnUninstall": {
                        "enum": ["keep", "delete"],
                        "description": "helm uninstall keeps or deletes the learner's and the fitter's claims alike",
                    },
                },
                required=("prefix", "batchPrompts", "claimsOnUninstall"),
            ),
            "task": task,
            "lora": lora,
            "nats": nats,
            "grpcTls": grpc_tls(),
            "model": obj(
                {
                    "path": {"type": "string", "pattern": "^/"},
                    "sizeGiB": {
                        "type": "number",
                        "exclusiveMinimum": 0,
                        "description": "The weights' size; sizes shm, memory and /tmp",
                    },
                    "cache": obj(
                        {
                            "mountPath": {"type": "string", "pattern": "^/"},
                            "existingClaim": STR,
                            "sizeLimit": QUANTITY,
                            "initContainers": {
                                "type": "array",
                                "items": {"type": "object", "required": ["name", "image"]},
                            },
                        },
                        required=("mountPath",),
                    ),
                    "download": obj(
                        {
                            "enabled": BOOL,
                            "repo": {"type": "string", "pattern": "^$|^[^/]+/[^/]+$"},
                            "revision": {"type": "string", "minLength": 1},
                            "allowPatterns": {"type": "array", "items": {"type": "string", "minLength": 1}},
                            "tokenSecret": obj({"name": STR, "key": {"type": "string", "minLength": 1}}),
                            "datasets": {
                                "type": "array",
                                "items": obj(
                                    {
                                        "repo": {"type": "string", "pattern": "^[^/]+/[^/]+$"},
                                        "path": {"type": "string", "pattern": "^[^/]"},
                                        "files": {"type": "array", "items": {"type": "string", "minLength": 1}},
                                        "revision": {"type": "string", "minLength": 1},
                                    },
                                    required=("repo", "path"),
                                ),
                            },
                        },
                        required=("enabled",),
                    ),
                },
                required=("path", "sizeGiB", "cache"),
            ),
            "images": obj(
                {
                    "generator": image(),
                    "learner": image(),
                    "broker": image(),
                    "fitter": image(),
                    "sandboxPool": image(),
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    "pullSecrets": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                },
                required=("generator", "learner", "broker", "fitter"),
            ),
            "serviceAccount": obj({"create": BOOL, "name": STR, "annotations": OBJECT}),
            "podSecurityContext": OBJECT,
            "containerSecurityContext": OBJECT,
            "generator": generator,
            "generatorPools": generator_pools,
            "learner": learner,
            "broker": broker,
            "fitter": fitter,
            "sandboxPool": sandbox_pool,
            "networkPolicy": obj(
                {
                    "enabled": BOOL,
                    "prometheusNamespaces": {
                        "type": "array",
                        "items": {"type": "string", "pattern": NAMESPACE_NAME},
                        "uniqueItems": True,
                        "description": "namespaces whose Prometheus pods may scrape /metrics",
                    },
                    "metricsFrom": PEERS,
                    "dnsTo": PEERS,
                    "natsTo": PEERS,
                    "natsPorts": {"type": "array", "minItems": 1, "items": PORT},
                    "generatorClientsFrom": PEERS,
                    "fitterClientsFrom": PEERS,
                    "extraEgress": {"type": "array", "items": {"type": "object"}},
                    "downloadTo": PEERS,
                },
                required=("enabled",),
            ),
            "monitoring": obj(
                {
                    "serviceMonitors": obj(
                        {
                            "enabled": BOOL,
                            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        }
                    ),
                    "dashboard": obj(
                        {
                            "enabled": BOOL,
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                        }
                    ),
                    "prometheusRule": obj(
                        {
                            "enabled": BOOL,
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "swapStaleMinutes": {"type": "integer", "minimum": 1},
                            "maxVersionLag": {"type": "integer", "minimum": 1},
                            "learnerIdleMinutes": {"type": "integer", "minimum": 1},
                            "projectionErrorRatio": {"type": "number", "exclusiveMinimum": 0},
                            "maxTruncationRate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                            "truncationWindowMinutes": {"type": "integer", "minimum": 1},
                        }
                    ),
                }
            ),
            "tests": obj({"timeoutSeconds": {"type": "number", "exclusiveMinimum": 0}}),
        },
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH.relative_to(REPO)}")
