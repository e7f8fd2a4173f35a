"""Configuration loading shared by every service.

Each service owns one frozen pydantic model; this module only loads it:
a YAML (or JSON) file, then environment overrides, validated at start.
Overrides use ``ASY_<SERVICE>__FIELD__SUBFIELD=value`` (scalars are
converted to the field's type by pydantic; lists and mappings are YAML), which is what Kubernetes
ConfigMaps and Secrets feed a pod. Also the connection settings that several
services share.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from asymptote.errors import ConfigError

log = logging.getLogger(__name__)

Model = TypeVar("Model", bound=BaseModel)


class Frozen(BaseModel):
    """Base for config models: unknown keys are errors, values immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NatsSettings(Frozen):
    """How to reach NATS JetStream."""

    url: str = "nats://127.0.0.1:4222"
    """Server URL(s), comma separated for a cluster."""
    user: str | None = None
    """User name for user/password authentication."""
    password: SecretStr | None = None
    """Password for user/password authentication (never logged)."""
    creds_file: Path | None = None
    """NATS credentials file (NKey/JWT), used instead of user/password."""
    tls_ca_file: Path | None = None
    """CA bundle to verify the server's TLS certificate; enables TLS."""
    connect_timeout_s: float = 5.0
    """Time allowed for one connection attempt."""
    max_reconnect_attempts: int = Field(default=60, ge=-1)
    """Reconnect attempts before the service gives up and exits (-1: forever; nats-py also
    treats 0 as forever)."""


class ListenSettings(Frozen):
    """A TCP listener. Local mode binds loopback only."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 only inside a pod."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port; 0 picks a free one (tests)."""


def _parse_override(raw: str) -> Any:
    """Lists and mappings are parsed as YAML; scalars stay strings.

    pydantic converts a string to the field's type ("3" -> 3, "true" ->
    True), so a digits-only password stays the string it is.
    """
    text = raw.strip()
    if text[:1] in ("[", "{"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return raw
    if text in ("null", "~"):
        return None
    return raw


def _set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(keys)} goes inside {key}, which is not a section")
        node = child
    node[keys[-1]] = value


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nested dict from ``{prefix}__A__B=value`` variables (keys lower-cased)."""
    environ = os.environ if environ is None else environ
    head = prefix.upper() + "__"
    tree: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if name.startswith(head) and len(name) > len(head):
            keys = [k.lower() for k in name[len(head):].split("__")]
            _set_path(tree, keys, _parse_override(raw))
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    model: type[Model],
    path: Path | None,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
) -> Model:
    """Load ``model`` from ``path`` (YAML/JSON, optional) plus env overrides.

    Raises ConfigError naming the file and every invalid field.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        data = loaded
    data = _merge(data, env_overrides(env_prefix, environ))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        source = f"config file {path}" if path else "configuration"
        raise ConfigError(f"invalid {source} (env prefix {env_prefix}__): {problems}") from exc


def log_resolved(config: BaseModel, service: str) -> None:
    """Log the resolved config once; SecretStr fields print as '**********'."""
    log.info("%s config: %s", service, json.dumps(config.model_dump(mode="json"), sort_keys=True))


def dump_config(config: BaseModel, path: Path) -> None:
    """Write a config model as YAML (used by the local stack)."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False))
