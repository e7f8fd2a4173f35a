"""Configuration loading shared by every service.

Each service owns one frozen pydantic model; this module only loads it:
a YAML (or JSON) file, then environment overrides, validated at start.
Overrides use ``ASY_<SERVICE>__FIELD__SUBFIELD=value`` (scalars are
converted to the field's type by pydantic; lists and mappings are YAML), which is what Kubernetes
ConfigMaps and Secrets feed a pod. Also the settings that several services
share: how to reach NATS, listeners, TLS, and the fields every service's
config starts with (``ServiceSettings``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from asymptote.errors import ConfigError
from asymptote.logs import LogFormat

log = logging.getLogger(__name__)

Model = TypeVar("Model", bound=BaseModel)


class Frozen(BaseModel):
    """Base for config models: unknown keys are errors, values immutable.

    A field's docstring becomes its description in the JSON schema (and so in
    the Helm chart's values.schema.json).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


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
    tls_cert_file: Path | None = None
    """Client certificate (PEM) for servers that verify clients (mTLS); enables TLS."""
    tls_key_file: Path | None = None
    """Private key (PEM) of tls_cert_file."""
    tls_hostname: str | None = None
    """Name expected in the server's certificate when it differs from the URL's host."""
    connect_timeout_s: float = 5.0
    """Time allowed for one connection attempt."""
    stream_replicas: int = Field(default=1, ge=1, le=5)
    """JetStream replicas of every stream and KV bucket the services declare (3 on a
    3-server cluster: a stream survives one server's loss; 1 on a single server)."""
    max_reconnect_attempts: int = Field(default=60, ge=-1)
    """Reconnect attempts before the service gives up and exits (-1: forever; nats-py also
    treats 0 as forever)."""

    @model_validator(mode="after")
    def _check_tls(self) -> NatsSettings:
        _check_key_pair(self.tls_cert_file, self.tls_key_file, "tls_cert_file", "tls_key_file")
        return self


class TlsSettings(Frozen):
    """TLS for a service's gRPC server and the gRPC clients it opens; off by default.

    One identity per service, as one certificate per pod: ``cert_file`` is
    presented as the server's certificate and, to servers that require one,
    as the client's. ``ca_file`` verifies the peers' certificates.
    """

    cert_file: Path | None = None
    """This service's certificate chain (PEM); turns TLS on for its gRPC server."""
    key_file: Path | None = None
    """Private key (PEM) of cert_file."""
    ca_file: Path | None = None
    """CA bundle (PEM) that verifies the servers this service calls (and, with require_client_cert,
    the clients calling it); turns TLS on for its clients. None with cert_file: the system's CAs."""
    require_client_cert: bool = False
    """mTLS: the server refuses clients without a certificate signed by ca_file."""
    server_name: str | None = None
    """Name expected in the servers' certificates when it differs from the address dialled."""

    @property
    def server_enabled(self) -> bool:
        return self.cert_file is not None

    @property
    def client_enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None

    @model_validator(mode="after")
    def _check(self) -> TlsSettings:
        _check_key_pair(self.cert_file, self.key_file, "cert_file", "key_file")
        if self.require_client_cert and (self.ca_file is None or self.cert_file is None):
            raise ValueError(
                "require_client_cert (mTLS) needs ca_file (the CA that signs client certificates) and "
                "cert_file/key_file (the server's own certificate)"
            )
        if self.server_name and not self.client_enabled:
            raise ValueError("server_name applies only with TLS: set ca_file or cert_file")
        return self


def _check_key_pair(cert: Path | None, key: Path | None, cert_name: str, key_name: str) -> None:
    if (cert is None) != (key is None):
        given, missing = (cert_name, key_name) if key is None else (key_name, cert_name)
        raise ValueError(f"{cert_name} and {key_name} go together: {given} is set, {missing} is not")


def read_pem(setting: str, path: Path) -> bytes:
    """A certificate or key file's bytes; ConfigError naming the setting if unreadable or not PEM.

    Checked when the file is used, not when the config is validated: the
    files are mounted where the service runs, not where its config is rendered.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting}: {path} is not a PEM file (no -----BEGIN line)")
    return data


class ListenSettings(Frozen):
    """A TCP listener. Local mode binds loopback only."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 only inside a pod."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port; 0 picks a free one (tests)."""


class ServiceSettings(Frozen):
    """The fields every service's config starts with.

    Each service subclasses it and redeclares ``grpc`` and ``http`` with its
    own default ports, so services on one host do not collide.
    """

    nats: NatsSettings = NatsSettings()
    """Where JetStream is."""
    prefix: str = Field(default="asy", pattern=r"^[a-z][a-z0-9_]*$")
    """Namespace of this run's streams, subjects and buckets."""
    grpc: ListenSettings = ListenSettings()
    """gRPC listener (the service's RPCs and health)."""
    grpc_tls: TlsSettings = TlsSettings()
    """TLS (or mTLS) for the gRPC server and the gRPC calls this service makes; off by default."""
    http: ListenSettings = ListenSettings()
    """HTTP listener (/metrics, /healthz, /readyz)."""
    log_format: LogFormat = "auto"
    """Log format: JSON in pods, text on a terminal."""


class MeteredServiceSettings(ServiceSettings):
    """A service whose accelerator time counts as the run's compute (generators and the learner).

    These fields feed asymptote.compute.ComputeMeter, whose telemetry the
    fitter sums into the compute axis of the scaling curve.
    """

    device_kind: str = "cpu-core"
    """What this service's accelerator is, for compute accounting."""
    num_devices: int = Field(default=1, ge=1)
    """Accelerators this service holds, for compute accounting."""
    telemetry_interval_s: float = Field(default=5.0, gt=0.0)
    """How often compute telemetry is published."""


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


def set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``tree[keys[0]]...[keys[-1]] = value``, making the sections on the way; ConfigError when one of them
    is a value."""
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
            keys = [k.lower() for k in name[len(head) :].split("__")]
            set_path(tree, keys, _parse_override(raw))
    return tree


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key, mappings recursively; ``over`` wins elsewhere."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
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
    data = merge(data, env_overrides(env_prefix, environ))
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
    """Write a config model as YAML (used by the local stack), nulls included: a field whose default is not
    None but whose value is (a GPU engine's ``kv_cache_memory_bytes``) must read back as None."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
