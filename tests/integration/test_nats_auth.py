"""Without the right NATS credentials a client can neither publish rollout
groups nor read them (a real nats-server requiring user and password).

Asymptote's client cannot connect; a bare protocol client that ignores the
refusal and sends PUB, SUB and a JetStream message read anyway gets nothing
back and stores nothing, while the same script with the right credentials
reads the stored group (so the script itself works).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.errors import NoServersError
from raw_nats import session

from asymptote.config import NatsSettings
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.connect import connect
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.nats_local import NatsServer, check_config_string, new_password, start_nats

USER, PASSWORD = "asymptote", "s3cret-for-this-test"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats(Path(tmp_path_factory.mktemp("nats-auth")), user=USER, password=PASSWORD)
    try:
        yield server
    finally:
        server.stop()


def test_the_password_is_on_no_command_line_nor_in_a_file(secured: NatsServer) -> None:
    # Any local user can read a process's command line: the server gets the
    # password through its environment, which only its owner can read.
    cmdline = Path(f"/proc/{secured.process.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline and b"-c" in cmdline.split(b"\0")
    written = [f for f in secured.store_dir.rglob("*") if f.is_file()]
    assert written and not [f for f in written if PASSWORD.encode() in f.read_bytes()]


def settings(server: NatsServer, user: str | None, password: str | None) -> NatsSettings:
    return NatsSettings(url=server.url, user=user, password=password, connect_timeout_s=2, max_reconnect_attempts=1)


@pytest.mark.parametrize(
    ("user", "password"), [(None, None), (USER, "wrong-password"), ("intruder", PASSWORD), (USER, "")]
)
async def test_wrong_credentials_cannot_publish_or_read(
    secured: NatsServer, user: str | None, password: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(NoServersError):
        await connect(settings(secured, user, password), "intruder")
    # The password is never logged, not even on a failed attempt.
    assert PASSWORD not in caplog.text


async def test_right_credentials_publish_and_read(secured: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    names = Names("authtest")
    nc = await connect(settings(secured, USER, PASSWORD), "generator")
    try:
        js = nc.jetstream()
        await ensure_streams(js, names)
        group = rollout_pb2.RolloutGroup(group_id="g-1", prompt_token_ids=[1, 2])
        ack = await js.publish(names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": "g-1"})
        assert ack.stream == names.rollouts_stream
        msg = await js.get_msg(names.rollouts_stream, ack.seq)
        assert rollout_pb2.RolloutGroup.FromString(msg.data).group_id == "g-1"
    finally:
        await nc.close()
    assert PASSWORD not in caplog.text


def intruder_script(names: Names, user: str | None, password: str | None, seq: int) -> list[str]:
    """CONNECT, subscribe to rollouts, publish a rollout group, read stored group ``seq`` through the JetStream API."""
    creds = {"user": user, "pass": password} if user is not None else {}
    forged = rollout_pb2.RolloutGroup(group_id="forged").SerializeToString().decode("ascii")
    get = json.dumps({"seq": seq})
    return [
        "CONNECT " + json.dumps({"verbose": False, "pedantic": False, **creds}),
        f"SUB {names.rollouts} 1",
        "SUB _INBOX.raw 2",
        f"PUB {names.rollouts} {len(forged)}",
        forged,
        f"PUB $JS.API.STREAM.MSG.GET.{names.rollouts_stream} _INBOX.raw {len(get)}",
        get,
        "PING",
    ]


@pytest.mark.parametrize(("user", "password"), [(None, None), (USER, "wrong-password"), ("intruder", PASSWORD)])
async def test_a_bare_client_without_credentials_stores_and_reads_nothing(
    secured: NatsServer, user: str | None, password: str | None
) -> None:
    names = Names("rawauth")
    nc = await connect(settings(secured, USER, PASSWORD), "generator")
    try:
        js = nc.jetstream()
        await ensure_streams(js, names)
        group = rollout_pb2.RolloutGroup(group_id="g-stored", prompt_token_ids=[7])
        ack = await js.publish(names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": "g-stored"})
        before = (await js.stream_info(names.rollouts_stream)).state.last_seq

        reply = session(secured.port, intruder_script(names, user, password, ack.seq))
        assert "Authorization Violation" in reply
        assert "MSG " not in reply and "PONG" not in reply
        assert (await js.stream_info(names.rollouts_stream)).state.last_seq == before  # the forged group was not stored

        # The same script with the right credentials publishes, is delivered its group and reads the stored one.
        reply = session(secured.port, intruder_script(names, USER, PASSWORD, ack.seq), until='"time":')
        assert "Authorization Violation" not in reply and f"MSG {names.rollouts} 1 " in reply
        payload = next(line for line in reply.split("\r\n") if line.startswith("{") and '"message"' in line)
        stored = base64.b64decode(json.loads(payload)["message"]["data"])
        assert rollout_pb2.RolloutGroup.FromString(stored).group_id == "g-stored"
    finally:
        await nc.close()


@pytest.mark.parametrize("password", ["9nines", "-dash", "true", "On", "two words", 'quo"te', "brace}"])
def test_a_password_the_server_would_misread_is_refused_naming_the_rule(tmp_path: Path, password: str) -> None:
    with pytest.raises(ValueError, match="cannot take this password: it must start with a letter"):
        start_nats(tmp_path, user=USER, password=password)
    assert not list(tmp_path.iterdir()), "nothing is started or written for a refused password"


async def test_generated_passwords_are_read_back_unchanged(tmp_path: Path) -> None:
    # token_urlsafe alone starts with a digit or "-" one time in six: the
    # server then failed to parse its config and the local stack did not start.
    passwords = [new_password() for _ in range(2000)]
    assert len(set(passwords)) == len(passwords)
    for password in passwords:
        check_config_string("password", password)
    # A real server takes the most awkward of them, and authenticates with it.
    password = max(passwords, key=lambda p: (p[4] in "-_0123456789", p.count("-") + p.count("_")))
    server = start_nats(tmp_path, user=USER, password=password)
    try:
        nc = await connect(settings(server, USER, password), "test")
        assert nc.is_connected
        await nc.close()
    finally:
        server.stop()
