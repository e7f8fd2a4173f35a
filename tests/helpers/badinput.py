"""Bad inputs: the session's tally of what the tests tried, and bad gRPC requests.

Every test that feeds a service bad input records each one under the
interface it hit ("config", "weights", "gRPC Broker", ...), with whether it
crashed something: an exception escaping where an error should have been
returned, or a server that stopped answering. Inputs count once however
often they are tried, by a hash of their bytes or canonical description.
``tests/conftest.py`` prints the tally at the end of the session and writes
it as JSON.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import grpc

from asymptote.config import ListenSettings
from asymptote.health import Health
from asymptote.rpc import start_server
from asymptote.wire import varint

BadInput = str | bytes | Sequence[bytes]
"""Canonical text, the bytes sent, or a stream of messages (each message's bytes)."""

PARSE_ERROR = "Error parsing message with type"
"""How grpc.aio answers request bytes that do not parse (status UNKNOWN), naming the message type."""
OVERSIZED_BYTES = 5 << 20
"""Over gRPC's default 4 MiB receive limit, which every server keeps."""


def fingerprint(bad_input: BadInput) -> str:
    h = hashlib.sha256()
    if isinstance(bad_input, str):
        h.update(b"text\0" + bad_input.encode())
    elif isinstance(bad_input, bytes):
        h.update(b"bytes\0" + bad_input)
    else:
        h.update(b"stream\0")
        for message in bad_input:
            h.update(len(message).to_bytes(8, "little"))
            h.update(message)
    return h.hexdigest()


@dataclass
class Tally:
    tried: set[str] = field(default_factory=set)
    crashed: set[str] = field(default_factory=set)


class BadInputs:
    """Distinct bad inputs tried and crashes seen, per interface."""

    def __init__(self) -> None:
        self._tallies: dict[str, Tally] = {}
        self._lock = threading.Lock()  # the poison test injects from a thread

    def record(self, interface: str, bad_input: BadInput, *, crashed: bool = False) -> None:
        key = fingerprint(bad_input)
        with self._lock:
            tally = self._tallies.setdefault(interface, Tally())
            tally.tried.add(key)
            if crashed:
                tally.crashed.add(key)

    def record_crash(self, interface: str, what: str) -> None:
        """A crash no single input can be blamed for, e.g. a service of the stack restarted."""
        with self._lock:
            self._tallies.setdefault(interface, Tally()).crashed.add(fingerprint(what))

    @contextmanager
    def trying(self, interface: str, bad_input: BadInput) -> Iterator[None]:
        """Record ``bad_input``; any exception escaping the block but a failed check is a crash.

        Wrap the call and the check of its error together, e.g. with
        ``pytest.raises(ConfigError)`` inside: another exception escapes it.
        """
        crashed = False
        try:
            yield
        except AssertionError:
            raise
        except Exception:
            crashed = True
            raise
        finally:
            self.record(interface, bad_input, crashed=crashed)

    def dump(self) -> dict[str, dict[str, list[str]]]:
        """Every fingerprint, per interface: what a parallel worker hands the controller (JSON-able)."""
        with self._lock:
            return {name: {"tried": sorted(t.tried), "crashed": sorted(t.crashed)} for name, t in self._tallies.items()}

    def merge(self, dumped: dict[str, dict[str, list[str]]]) -> None:
        """Take in another process's :meth:`dump`: the same input tried on two workers counts once."""
        with self._lock:
            for name, sets in dumped.items():
                tally = self._tallies.setdefault(name, Tally())
                tally.tried.update(sets["tried"])
                tally.crashed.update(sets["crashed"])

    def num_tried(self, interface: str) -> int:
        with self._lock:
            return len(self._tallies[interface].tried) if interface in self._tallies else 0

    def counts(self) -> dict[str, dict[str, int]]:
        """``{interface: {"distinct": n, "crashes": m}}``, interfaces in name order."""
        with self._lock:
            return {
                name: {"distinct": len(t.tried), "crashes": len(t.crashed)} for name, t in sorted(self._tallies.items())
            }


BAD_INPUTS = BadInputs()


# -- bad gRPC requests ---------------------------------------------------------------


def corrupted(rng: random.Random, valid: bytes, num: int) -> list[bytes]:
    """``num`` requests: random bytes, truncations and bit flips of ``valid``, and a few fixed malformed ones."""
    out = [b"\xff", b"\x0a\xff\xff\xff\xff\x0f", valid[: len(valid) // 2]]
    while len(out) < num:
        kind = rng.random()
        if kind < 0.4:
            out.append(rng.randbytes(rng.randint(1, 200)))
        elif kind < 0.8 and valid:
            flipped = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            out.append(bytes(flipped))
        else:
            out.append(b"\x08" + rng.randbytes(rng.randint(0, 12)))
    return out


def oversized(valid: bytes) -> bytes:
    """``valid`` plus an unknown length-delimited field 15 that takes it past OVERSIZED_BYTES: parses, too big."""
    return valid + bytes([15 << 3 | 2]) + varint(OVERSIZED_BYTES) + bytes(OVERSIZED_BYTES)


@dataclass(frozen=True)
class Answer:
    """How a server answered one raw request."""

    request: bytes
    code: grpc.StatusCode
    details: str

    @property
    def unparsable(self) -> bool:
        return self.code == grpc.StatusCode.UNKNOWN and PARSE_ERROR in self.details

    @property
    def crashed(self) -> bool:
        """The server stopped answering, or an exception escaped the handler (UNKNOWN: "Unexpected <class ...>")."""
        return self.code == grpc.StatusCode.UNAVAILABLE or (
            self.code == grpc.StatusCode.UNKNOWN and not self.unparsable
        )


async def send_bad_request(
    channel: grpc.aio.Channel,
    interface: str,
    method: str,
    request: bytes,
    *,
    streaming: bool = False,
    timeout_s: float = 2.0,
) -> Answer:
    """Send ``request`` as is to ``method`` (reading a stream to its end) and record it under ``interface``."""

    def same(x: bytes) -> bytes:
        return x

    try:
        if streaming:
            async for _ in channel.unary_stream(method, request_serializer=same, response_deserializer=same)(
                request, timeout=timeout_s
            ):
                pass
        else:
            await channel.unary_unary(method, request_serializer=same, response_deserializer=same)(
                request, timeout=timeout_s
            )
        answer = Answer(request, grpc.StatusCode.OK, "")
    except grpc.aio.AioRpcError as exc:
        answer = Answer(request, exc.code(), str(exc.details()))
    BAD_INPUTS.record(interface, [method.encode(), request], crashed=answer.crashed)
    return answer


async def send_bad_requests(
    channel: grpc.aio.Channel,
    interface: str,
    method: str,
    valid: bytes,
    rng: random.Random,
    num: int,
    *,
    streaming: bool = False,
    timeout_s: float = 2.0,
) -> list[Answer]:
    """``num`` corrupted copies of ``valid`` then an oversized one, each sent and recorded; their answers."""
    return [
        await send_bad_request(channel, interface, method, request, streaming=streaming, timeout_s=timeout_s)
        for request in [*corrupted(rng, valid, num), oversized(valid)]
    ]


@asynccontextmanager
async def raw_stream_server(
    service: str, method: str, stream: Callable[[], AsyncIterator[bytes]]
) -> AsyncIterator[str]:
    """A server whose ``service``/``method`` streams whatever bytes ``stream()`` yields; yields its endpoint.

    The peer of a client under test that misbehaves on the wire.
    """

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for frame in stream():
            yield frame

    handler = grpc.unary_stream_rpc_method_handler(handle)  # bytes in and out
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        Health(service),
        lambda s: s.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(f"asymptote.contracts.v1.{service}", {method: handler}),)
        ),
        [],
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
