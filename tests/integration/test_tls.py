"""TLS on gRPC and NATS, with certificates made at test time.

gRPC: a real Fitter server whose TLS settings come from its config's env
keys takes clients that trust its CA and refuses plaintext clients and
clients trusting another CA; under mTLS it also refuses clients without a
certificate signed by its CA, and the generator's weight pulls work only
with one. Half-configured TLS is a ConfigError naming the setting.
NATS: a real nats-server with TLS (and with client verification) takes an
Asymptote client holding the CA (and a signed client certificate), which
publishes and reads a rollout group on the real subjects; a plaintext
client, one trusting another CA or one without a client certificate
cannot connect, and a bare protocol client's publish is never stored.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.errors import NoServersError
from raw_nats import session

from asymptote.codec import WireTensor, encode, version_digest
from asymptote.config import ListenSettings, NatsSettings, TlsSettings, load_config
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc, tensors_pb2
from asymptote.errors import ConfigError
from asymptote.health import Health
from asymptote.jetstream.connect import connect, wait_for_nats
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.nats_local import NatsServer, ServerTls, start_nats
from asymptote.rpc import channel, start_server
from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.config import FitterConfig
from services.fitter.curve import CurveFitSettings
from services.fitter.server import FitterServicer
from services.generator.weights import GrpcWeightSource

# -- certificates --------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing the servers trust."""
    rogue_cert: Path
    """A client certificate signed by other_ca."""
    rogue_key: Path
    not_pem: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.crt"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name = issuer[0].subject if issuer else _name(subject)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is None:  # a CA
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        return builder.sign(key, hashes.SHA256())
    builder = (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        # One identity per service: the same certificate serves and dials.
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .add_extension(x509.SubjectAlternativeName(sans or [x509.DNSName(subject)]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()), critical=False)
    )
    return builder.sign(issuer[1], hashes.SHA256())


def _ca(folder: Path, stem: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(f"{stem} test CA", key, None)
    cert_path, _ = _write(folder, stem, key, cert)
    return cert, key, cert_path


def _leaf(
    folder: Path, stem: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], sans: list[x509.GeneralName]
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(folder, stem, key, _certificate(stem, key, ca, sans))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = Path(tmp_path_factory.mktemp("pki"))
    ca_cert, ca_key, ca_path = _ca(folder, "ca")
    other_cert, other_key, other_path = _ca(folder, "other-ca")
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_cert, server_key = _leaf(folder, "server", (ca_cert, ca_key), loopback)
    client_cert, client_key = _leaf(folder, "generator", (ca_cert, ca_key), [x509.DNSName("generator")])
    rogue_cert, rogue_key = _leaf(folder, "rogue", (other_cert, other_key), [x509.DNSName("generator")])
    not_pem = folder / "not-a-cert.der"
    not_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.DER))
    return Pki(ca_path, server_cert, server_key, client_cert, client_key, other_path, rogue_cert, rogue_key, not_pem)


# -- gRPC ----------------------------------------------------------------------


def fitter_config(pki: Pki, mtls: bool) -> FitterConfig:
    """The Fitter's config with TLS set the way a Kubernetes Secret would set it: env keys."""
    env = {
        "ASY_FITTER__GRPC_TLS__CERT_FILE": str(pki.server_cert),
        "ASY_FITTER__GRPC_TLS__KEY_FILE": str(pki.server_key),
    }
    if mtls:
        env |= {"ASY_FITTER__GRPC_TLS__CA_FILE": str(pki.ca), "ASY_FITTER__GRPC_TLS__REQUIRE_CLIENT_CERT": "true"}
    return load_config(FitterConfig, None, "ASY_FITTER", env)


@asynccontextmanager
async def fitter_server(tmp_path: Path, tls: TlsSettings) -> AsyncIterator[int]:
    collector = Collector(tmp_path, "live", CurveFitSettings(), (2.0,), ComputeAxis(30.0), plot=False)
    health = Health("fitter")
    server, port = await start_server(
        ListenSettings(port=0),
        health,
        lambda s: services_pb2_grpc.add_FitterServicer_to_server(FitterServicer(collector), s),
        ["asymptote.contracts.v1.Fitter"],
        tls,
    )
    await health.unblock("starting")
    try:
        yield port
    finally:
        await server.stop(None)


async def fitter_call(port: int, tls: TlsSettings | None) -> grpc.StatusCode:
    """Health check and GetProjection over asymptote's client channel; the status the client got."""
    async with channel(f"127.0.0.1:{port}", tls) as ch:
        try:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="asymptote.contracts.v1.Fitter"), timeout=10
            )
            projection = await services_pb2_grpc.FitterStub(ch).GetProjection(
                services_pb2.GetProjectionRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert not projection.ok and projection.reason  # the live run has no points yet
    return grpc.StatusCode.OK


async def test_grpc_tls_takes_only_clients_trusting_its_ca(pki: Pki, tmp_path: Path) -> None:
    config = fitter_config(pki, mtls=False)
    assert config.grpc_tls.server_enabled and not config.grpc_tls.require_client_cert
    async with fitter_server(tmp_path, config.grpc_tls) as port:
        assert await fitter_call(port, TlsSettings(ca_file=pki.ca)) == grpc.StatusCode.OK
        assert await fitter_call(port, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert await fitter_call(port, TlsSettings(ca_file=pki.other_ca)) == grpc.StatusCode.UNAVAILABLE
        # The certificate names 127.0.0.1 and localhost, not another host.
        wrong_name = TlsSettings(ca_file=pki.ca, server_name="broker.example")
        assert await fitter_call(port, wrong_name) == grpc.StatusCode.UNAVAILABLE
        assert await fitter_call(port, TlsSettings(ca_file=pki.ca, server_name="localhost")) == grpc.StatusCode.OK


async def test_grpc_mtls_refuses_clients_without_a_certificate_from_its_ca(pki: Pki, tmp_path: Path) -> None:
    config = fitter_config(pki, mtls=True)
    assert config.grpc_tls.require_client_cert
    async with fitter_server(tmp_path, config.grpc_tls) as port:
        signed = TlsSettings(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
        assert await fitter_call(port, signed) == grpc.StatusCode.OK
        assert await fitter_call(port, TlsSettings(ca_file=pki.ca)) == grpc.StatusCode.UNAVAILABLE  # no client cert
        rogue = TlsSettings(ca_file=pki.ca, cert_file=pki.rogue_cert, key_file=pki.rogue_key)
        assert await fitter_call(port, rogue) == grpc.StatusCode.UNAVAILABLE
        assert await fitter_call(port, None) == grpc.StatusCode.UNAVAILABLE


class OneVersionLearner(services_pb2_grpc.LearnerServicer):
    def __init__(self, tensors: dict[str, WireTensor]) -> None:
        self.tensors = tensors

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tensors_pb2.WeightsPart]:
        for part in encode(1, self.tensors, version_digest(self.tensors)):
            yield part


async def test_generator_pulls_weights_over_mtls_only_with_its_certificate(pki: Pki) -> None:
    tensors = {"w": WireTensor.from_numpy(np.arange(600_000, dtype=np.float32).reshape(600, 1000))}  # 2 chunks+
    server_tls = TlsSettings(
        cert_file=pki.server_cert, key_file=pki.server_key, ca_file=pki.ca, require_client_cert=True
    )
    health = Health("learner")
    server, port = await start_server(
        ListenSettings(port=0),
        health,
        lambda s: services_pb2_grpc.add_LearnerServicer_to_server(OneVersionLearner(tensors), s),
        ["asymptote.contracts.v1.Learner"],
        server_tls,
    )
    try:
        generator_tls = TlsSettings(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
        weights = await GrpcWeightSource(timeout_s=10, tls=generator_tls).pull(f"127.0.0.1:{port}", 1)
        assert weights.version == 1 and weights.tensors["w"].data == tensors["w"].data
        for tls in (TlsSettings(ca_file=pki.ca), None):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await GrpcWeightSource(timeout_s=10, tls=tls).pull(f"127.0.0.1:{port}", 1)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GRPC_TLS__CERT_FILE": "a.crt"}, "grpc_tls: .*cert_file and key_file go together: cert_file is set"),
        ({"GRPC_TLS__KEY_FILE": "a.key"}, "grpc_tls: .*key_file is set, cert_file is not"),
        (
            {"GRPC_TLS__CERT_FILE": "a.crt", "GRPC_TLS__KEY_FILE": "a.key", "GRPC_TLS__REQUIRE_CLIENT_CERT": "true"},
            r"grpc_tls: .*require_client_cert \(mTLS\) needs ca_file",
        ),
        ({"GRPC_TLS__CA_FILE": "ca.crt", "GRPC_TLS__REQUIRE_CLIENT_CERT": "true"}, "needs ca_file .* and cert_file"),
        ({"GRPC_TLS__SERVER_NAME": "broker"}, "server_name applies only with TLS"),
        ({"NATS__TLS_CERT_FILE": "a.crt"}, "nats: .*tls_cert_file and tls_key_file go together"),
    ],
)
def test_half_configured_tls_is_a_config_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(FitterConfig, None, "ASY_FITTER", {f"ASY_FITTER__{k}": v for k, v in env.items()})


async def test_unreadable_or_non_pem_certificates_fail_at_start(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    with pytest.raises(ConfigError, match=f"grpc_tls.cert_file: cannot read {missing}: No such file"):
        await start_server(
            ListenSettings(port=0),
            Health("x"),
            lambda s: None,
            [],
            TlsSettings(cert_file=missing, key_file=pki.server_key),
        )
    with pytest.raises(ConfigError, match=f"grpc_tls.cert_file: {pki.not_pem} is not a PEM file"):
        await start_server(
            ListenSettings(port=0),
            Health("x"),
            lambda s: None,
            [],
            TlsSettings(cert_file=pki.not_pem, key_file=pki.server_key),
        )
    # The generator's weight client fails at start, not at its first pull.
    with pytest.raises(ConfigError, match=r"grpc_tls\.ca_file: cannot read"):
        GrpcWeightSource(tls=TlsSettings(ca_file=missing))
    # NATS: no waiting out the start-up timeout for a setting that cannot improve.
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"nats\.tls_ca_file: cannot read"):
        await wait_for_nats(NatsSettings(url="nats://127.0.0.1:1", tls_ca_file=missing), "x", timeout_s=30)
    assert time.monotonic() - started < 5


# -- NATS ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_nats(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats(Path(tmp_path_factory.mktemp("nats-tls")), tls=ServerTls(pki.server_cert, pki.server_key))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_nats(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    tls = ServerTls(pki.server_cert, pki.server_key, ca_file=pki.ca, verify=True)
    server = start_nats(Path(tmp_path_factory.mktemp("nats-mtls")), tls=tls)
    try:
        yield server
    finally:
        server.stop()


def nats_settings(server: NatsServer, **tls: Path | str) -> NatsSettings:
    return NatsSettings(url=server.url, connect_timeout_s=2, max_reconnect_attempts=1, **tls)  # type: ignore[arg-type]


async def publish_and_read(settings: NatsSettings, names: Names, group_id: str) -> rollout_pb2.RolloutGroup:
    """Publish a rollout group as a generator does and read it back as the broker does."""
    nc = await connect(settings, "generator")
    try:
        js = nc.jetstream()
        await ensure_streams(js, names)
        group = rollout_pb2.RolloutGroup(group_id=group_id, prompt_token_ids=[1, 2, 3])
        ack = await js.publish(names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": group_id})
        assert ack.stream == names.rollouts_stream
        sub = await js.pull_subscribe(names.rollouts, durable=names.broker_consumer, stream=names.rollouts_stream)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack()
        return rollout_pb2.RolloutGroup.FromString(msg.data)
    finally:
        await nc.close()


async def publish_group(settings: NatsSettings, names: Names, group_id: str) -> int:
    """Publish a rollout group; the stream sequence number it was stored under."""
    nc = await connect(settings, "generator")
    try:
        group = rollout_pb2.RolloutGroup(group_id=group_id)
        ack = await nc.jetstream().publish(names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": group_id})
        return int(ack.seq)
    finally:
        await nc.close()


async def stored_rollouts(settings: NatsSettings, names: Names) -> int:
    nc = await connect(settings, "auditor")
    try:
        info = await nc.jetstream().stream_info(names.rollouts_stream)
        return int(info.state.last_seq)  # every message ever stored, consumed or not
    finally:
        await nc.close()


async def connect_error(settings: NatsSettings) -> Exception | None:
    """What asymptote's client raised trying to connect, or None if it connected."""
    try:
        nc = await asyncio.wait_for(connect(settings, "intruder"), 30)
    except Exception as exc:  # the type is asserted by the caller
        return exc
    await nc.close()
    return None


def unverified(exc: Exception | None) -> bool:
    """The client refused the server's certificate (and said so, instead of hanging)."""
    return isinstance(exc, ConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(exc)


async def test_nats_tls_client_with_the_ca_publishes_and_reads(pki: Pki, tls_nats: NatsServer) -> None:
    names = Names("tls")
    group = await publish_and_read(nats_settings(tls_nats, tls_ca_file=pki.ca), names, "g-tls")
    assert group.group_id == "g-tls" and list(group.prompt_token_ids) == [1, 2, 3]
    # tls_hostname names what the certificate must say when the URL's host differs.
    good_name = nats_settings(tls_nats, tls_ca_file=pki.ca, tls_hostname="localhost")
    assert await connect_error(good_name) is None
    assert unverified(await connect_error(nats_settings(tls_nats, tls_ca_file=pki.ca, tls_hostname="nats.example")))


async def test_nats_tls_refuses_plaintext_and_other_cas(pki: Pki, tls_nats: NatsServer) -> None:
    names = Names("tlsplain")
    good = nats_settings(tls_nats, tls_ca_file=pki.ca)
    await publish_and_read(good, names, "g-1")
    assert unverified(await connect_error(nats_settings(tls_nats)))  # no CA set: the system's CAs do not know ours
    assert unverified(await connect_error(nats_settings(tls_nats, tls_ca_file=pki.other_ca)))
    # A plaintext client that ignores the refusal and publishes anyway.
    group = rollout_pb2.RolloutGroup(group_id="g-plain").SerializeToString()
    reply = session(
        tls_nats.port,
        ['CONNECT {"verbose":false}', f"PUB {names.rollouts} {len(group)}", group.decode("ascii"), "PING"],
    )
    assert '"tls_required":true' in reply and "PONG" not in reply
    # The server closed the intruder's connection before the session returned: a
    # group published after it is stored behind anything the intruder got stored.
    assert await publish_group(good, names, "g-after") == 2
    assert await stored_rollouts(good, names) == 2


async def test_nats_mtls_needs_a_client_certificate_from_its_ca(pki: Pki, mtls_nats: NatsServer) -> None:
    names = Names("mtls")
    signed = nats_settings(mtls_nats, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key)
    group = await publish_and_read(signed, names, "g-mtls")
    assert group.group_id == "g-mtls"
    no_cert = await connect_error(nats_settings(mtls_nats, tls_ca_file=pki.ca))
    rogue = nats_settings(mtls_nats, tls_ca_file=pki.ca, tls_cert_file=pki.rogue_cert, tls_key_file=pki.rogue_key)
    rogue_error = await connect_error(rogue)
    # The server refuses both: under TLS 1.3 its alert (certificate required, unknown CA)
    # reaches the client as a TLS error or as the connection closing, never as a session.
    assert isinstance(no_cert, (ConnectionError, NoServersError)), no_cert
    assert isinstance(rogue_error, (ConnectionError, NoServersError)), rogue_error
    assert await stored_rollouts(signed, names) == 1
