"""gRPC bootstrap shared by every server and client.

Servers are ``grpc.aio`` with the health service registered; message limits
stay at gRPC's defaults because tensors are chunked (see codec). With a
service's ``grpc_tls`` settings the server listens with TLS (mTLS when it
requires client certificates) and its clients dial with TLS; without them
both stay plaintext.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Callable, Collection

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2_grpc

from asymptote.config import ListenSettings, TlsSettings, read_pem
from asymptote.health import Health

log = logging.getLogger(__name__)

# Keepalive so a dead peer is noticed in seconds, not at the next TCP timeout.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 4 << 20
"""gRPC's default largest message: every message-sized buffer comes from the heap and is reused."""
_TRIM_THRESHOLD_BYTES = 8 << 20
"""Freed memory kept at the top of a heap before glibc hands it back to the kernel: a few
messages' worth, enough to reuse them (32 MiB measured no faster, and held 20 MB more per swap)."""


def reuse_freed_message_buffers() -> None:
    """Make glibc reuse the ~1 MiB buffers a weights stream allocates and frees for every message.

    On the receiving side gRPC's receive buffers and each message's bytes,
    on the sending side each frame and gRPC's copy of it, are about a
    chunk each. With glibc's defaults such buffers are mmapped, or
    the heap grows and is trimmed back, for every message, and the kernel
    faults in and zeroes fresh pages each time: receiving an 82 MB version
    took over three times the CPU it takes with the buffers reused, and
    serving one took about a quarter more. Costs
    at most the trim threshold of idle memory per malloc arena.
    Process-wide and idempotent; does nothing on a C library other than
    glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)


def already_serialized(frame: bytes) -> bytes:
    """The response serializer of a method whose handler yields messages already serialized."""
    return frame


def add_service(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    serialized: Collection[str] = (),
) -> None:
    """Register ``servicer``'s methods as ``service``, the generated registration's equivalent.

    Each RPC of the service is the servicer's method of the same name,
    unary or server-streaming as the descriptor says. The methods named in
    ``serialized`` yield their responses already serialized (a frame built
    by hand around bytes at hand, see :mod:`asymptote.wire`), so their
    responses pass through untouched.
    """
    unknown = set(serialized) - set(service.methods_by_name)
    if unknown:
        raise ValueError(f"{service.full_name} has no RPC {sorted(unknown)}")
    handlers = {}
    for name, method in service.methods_by_name.items():
        if method.client_streaming:
            raise ValueError(f"{service.full_name}.{name}: client streaming is not supported here")
        request = GetMessageClass(method.input_type)
        response = GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=already_serialized if name in serialized else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS credentials of a server (``tls.server_enabled``); mTLS verifies clients against ca_file."""
    assert tls.cert_file is not None and tls.key_file is not None
    key = read_pem("grpc_tls.key_file", tls.key_file)
    cert = read_pem("grpc_tls.cert_file", tls.cert_file)
    ca = read_pem("grpc_tls.ca_file", tls.ca_file) if tls.require_client_cert and tls.ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=tls.require_client_cert)


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    """TLS credentials of a client (``tls.client_enabled``); presents cert_file to mTLS servers."""
    ca = read_pem("grpc_tls.ca_file", tls.ca_file) if tls.ca_file else None
    key = read_pem("grpc_tls.key_file", tls.key_file) if tls.key_file else None
    cert = read_pem("grpc_tls.cert_file", tls.cert_file) if tls.cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


async def start_server(
    listen: ListenSettings,
    health: Health,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    tls: TlsSettings | None = None,
    max_receive_bytes: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with health checking; returns (server, port). ``max_receive_bytes`` raises
    gRPC's 4 MiB limit on one request for a service whose requests are not chunked (the sandbox pool's)."""
    credentials = server_credentials(tls) if tls is not None and tls.server_enabled else None
    options = [*SERVER_OPTIONS]
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options)
    register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.grpc, server)
    health.track_grpc(*service_names)
    address = f"{listen.host}:{listen.port}"
    if credentials is None:
        port, security = server.add_insecure_port(address), "plaintext"
    else:
        port = server.add_secure_port(address, credentials)
        security = "mTLS" if tls is not None and tls.require_client_cert else "TLS"
    if port == 0:
        raise OSError(f"cannot bind gRPC on {address}")
    await server.start()
    log.info("grpc on %s:%d, %s (%s)", listen.host, port, security, ", ".join(service_names))
    return server, port


def channel(target: str, tls: TlsSettings | None = None) -> grpc.aio.Channel:
    """A client channel to ``target``: TLS when ``tls`` turns it on for clients, else plaintext."""
    if tls is None or not tls.client_enabled:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    options: list[tuple[str, str | int]] = [*CHANNEL_OPTIONS]
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=options)
