"""free_port hands out listening ports the kernel will not give to outgoing sockets."""

from __future__ import annotations

import socket

import pytest

from asymptote.nats_local import LOWEST_PORT, ephemeral_range_start, free_port


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    high = ephemeral_range_start()
    assert 1024 < high <= 65535
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if high > LOWEST_PORT + 1000:
        assert all(LOWEST_PORT <= p < high for p in ports), sorted(ports)[:5]


def test_a_port_handed_out_can_be_listened_on_while_many_outgoing_sockets_are_open() -> None:
    # Open outgoing connections to a listener: the kernel gives each an
    # ephemeral local port. The port free_port chose must stay bindable.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        target = listener.getsockname()
        port = free_port()
        clients = []
        try:
            for _ in range(200):
                c = socket.create_connection(target)
                clients.append(c)
                assert c.getsockname()[1] != port
            with socket.socket() as server:
                server.bind(("127.0.0.1", port))
                server.listen(1)
                assert server.getsockname()[1] == port
        finally:
            for c in clients:
                c.close()


def test_a_port_already_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import asymptote.nats_local as nl

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        choices = iter([taken, taken])

        class Fixed:
            def randrange(self, low: int, high: int) -> int:
                return next(choices, low + 7)

        monkeypatch.setattr(nl.random, "SystemRandom", Fixed)
        monkeypatch.setattr(nl, "ephemeral_range_start", lambda: 65000)
        port = free_port()
        assert port != taken
