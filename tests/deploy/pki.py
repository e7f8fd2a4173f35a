"""Certificates made at test time, laid out as the chart's gRPC TLS Secret
(cert-manager's: tls.crt, tls.key, ca.crt), and gRPC health servers that
serve with them through the services' own credentials (asymptote.rpc).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from asymptote.config import TlsSettings
from asymptote.rpc import server_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def tls_secret(folder: Path, dns_names: list[str], ca_name: str = "asymptote test CA") -> Path:
    """``folder`` holding ca.crt and tls.crt/tls.key: a certificate for ``dns_names`` signed by
    that CA, usable as server and as client (as every service uses its one certificate)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])

    def signed(builder: x509.CertificateBuilder) -> bytes:
        cert = (
            builder.issuer_name(ca_subject)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .public_key(ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    )
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .public_key(key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)
    )
    (folder / "ca.crt").write_bytes(signed(ca))
    (folder / "tls.crt").write_bytes(signed(leaf))
    (folder / "tls.key").write_bytes(_pem_key(key))
    return folder


def service_tls(folder: Path, require_client_cert: bool) -> TlsSettings:
    """A service's grpc_tls section as the chart renders it, with the Secret mounted at ``folder``."""
    return TlsSettings(
        cert_file=folder / "tls.crt",
        key_file=folder / "tls.key",
        ca_file=folder / "ca.crt",
        require_client_cert=require_client_cert,
    )


@contextmanager
def health_server(
    tls: TlsSettings | None = None, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType = SERVING
) -> Iterator[str]:
    """A gRPC health server on loopback answering ``status`` (TLS with ``tls``, as a service's); yields host:port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = "127.0.0.1:0"
    port = (
        server.add_insecure_port(address) if tls is None else server.add_secure_port(address, server_credentials(tls))
    )
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
