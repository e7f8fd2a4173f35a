"""Without the right NATS credentials a client can neither publish rollout
groups nor read them (a real nats-server requiring user and password)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.errors import NoServersError

from asymptote.config import NatsSettings
from asymptote.contracts.v1 import rollout_pb2
from asymptote.nats_local import NatsServer, start_nats
from asymptote.streams import Names, connect, ensure_streams

USER, PASSWORD = "asymptote", "s3cret-for-this-test"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats(Path(tmp_path_factory.mktemp("nats-auth")), user=USER, password=PASSWORD)
    try:
        yield server
    finally:
        server.stop()


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
