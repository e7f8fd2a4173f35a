"""What a run needs of its NATS server, checked once at start.

Owns turning a server that cannot carry the run into one
:class:`~asymptote.errors.ConfigError` naming the setting to change, before
a service does any work: JetStream enabled for the account, streams of the
replicas asked for possible on this server or cluster, and the server's
``max_payload`` at least the largest message the run can make. Every
service checks the first two (:func:`declare_streams`); the broker, which
sets the group size and the token cap, checks the third
(:func:`check_max_payload`). Without these a run fails later and far from
the cause: streams time out, or a generator's first large group is refused
by the server and its task retried until JetStream gives up on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

from asymptote.errors import ConfigError
from asymptote.jetstream.names import ROLLOUT_MAX_BYTES, Names, ensure_streams

MIB = 1024 * 1024

# JetStream's API error codes (nats-server's errors.json) that mean "these replicas cannot be placed".
REPLICAS_NOT_CLUSTERED = 10074
"""replicas > 1 not supported in non-clustered mode"""
NO_SUITABLE_PEERS = 10005
"""no suitable peers for placement (fewer servers than replicas)"""
INSUFFICIENT_RESOURCES = 10023
"""insufficient resources"""
JETSTREAM_NOT_ENABLED_FOR_ACCOUNT = 10039


@dataclass(frozen=True)
class MessageSize:
    """The largest message a run can publish, what it is, and the settings it follows from."""

    num_bytes: int
    what: str
    """E.g. "a rollout group of 16 x 8192 tokens"."""
    settings: str
    """The settings that make it smaller, e.g. "broker sampling.group_size or sampling.max_tokens"."""


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.2f} MiB"


async def check_jetstream(js: JetStreamContext, url: str) -> None:
    """ConfigError when the server at ``url`` runs no JetStream, or not for this account."""
    try:
        await js.account_info()
    except APIError as exc:
        if isinstance(exc, ServiceUnavailableError):
            raise ConfigError(
                f"NATS at {url} has JetStream off: start nats-server with -js (or a `jetstream {{}}` block in "
                "its config; the NATS Helm chart's config.jetstream.enabled)"
            ) from None
        if exc.err_code == JETSTREAM_NOT_ENABLED_FOR_ACCOUNT:
            raise ConfigError(
                f"NATS at {url} has JetStream off for this account: enable it in the account's config "
                "(`jetstream: enabled` in the account, or its JWT's JetStream limits)"
            ) from None
        raise
    except (NoRespondersError, NatsTimeoutError, TimeoutError):
        raise ConfigError(
            f"NATS at {url} did not answer JetStream's API: start nats-server with -js (or a `jetstream {{}}` "
            "block in its config; the NATS Helm chart's config.jetstream.enabled)"
        ) from None


def replicas_problem(exc: APIError, replicas: int, url: str) -> ConfigError | None:
    """A ConfigError naming nats.stream_replicas when ``exc`` says streams of ``replicas`` cannot be placed."""
    if exc.err_code == REPLICAS_NOT_CLUSTERED:
        where = "a single server (JetStream is not clustered)"
    elif exc.err_code in (NO_SUITABLE_PEERS, INSUFFICIENT_RESOURCES):
        where = f"a cluster with fewer than {replicas} JetStream servers with room ({exc.description})"
    else:
        return None
    return ConfigError(
        f"nats.stream_replicas is {replicas} but NATS at {url} is {where}: set nats.stream_replicas "
        f"(the chart's nats.streamReplicas) to at most the number of JetStream servers (1 on one server), "
        f"or run {replicas} JetStream servers"
    )


async def declare_streams(js: JetStreamContext, names: Names, url: str) -> None:
    """Check JetStream, then declare the run's streams; ConfigError when the replicas cannot be placed."""
    await check_jetstream(js, url)
    try:
        await ensure_streams(js, names)
    except APIError as exc:
        problem = replicas_problem(exc, names.replicas, url)
        if problem is None:
            raise
        raise problem from None


def check_max_payload(max_payload: int, need: MessageSize, url: str) -> None:
    """ConfigError when ``need`` does not fit the server's ``max_payload`` or the rollouts stream's limit."""
    if need.num_bytes > ROLLOUT_MAX_BYTES:
        raise ConfigError(
            f"{need.what} can reach {_mib(need.num_bytes)}, over the rollouts stream's "
            f"{_mib(ROLLOUT_MAX_BYTES)} message limit: lower {need.settings}"
        )
    if need.num_bytes > max_payload:
        raise ConfigError(
            f"NATS at {url} has max_payload {_mib(max_payload)} but {need.what} can reach "
            f"{_mib(need.num_bytes)}: raise max_payload in the NATS server's config to at least "
            f"{_mib(need.num_bytes)} (the asymptote-stack chart sets 9 MiB, nats.config.merge.max_payload), "
            f"or lower {need.settings}"
        )
