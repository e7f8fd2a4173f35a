"""Protobuf's wire format by hand, for messages whose big fields are bytes already.

Owns the few encodings the services write themselves instead of building
a message to serialize: a base-128 varint, and a length-delimited field
(its key, its length, its bytes). A weight chunk's tensor bytes and a
broker's stored rollout groups are framed this way, so they are copied
once, into the frame, rather than into a message and again into its
serialization; a reader sees exactly what ``SerializeToString`` would give.

The reading side is as small: ``fields`` walks a message's top-level
fields without parsing them, so a receiver can find a large bytes field
and take it as a view of the bytes it received, and let protobuf parse
the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_delimited_key(field_number: int) -> bytes:
    """The key protobuf writes before a length-delimited (wire type 2) field's length."""
    return varint(field_number << 3 | 2)


_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` and the position after it; ValueError if it is cut short or over 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise ValueError(f"no complete varint at byte {pos}")


class Field(NamedTuple):
    """Where one field of a serialized message lies: ``key_start:end`` is all of it, ``start:end`` its value."""

    number: int
    wire_type: int
    key_start: int
    start: int
    end: int

    @property
    def length_delimited(self) -> bool:
        return self.wire_type == _LENGTH_DELIMITED


def fields(buf: memoryview) -> Iterator[Field]:
    """Each top-level field of the message in ``buf``, in the order it holds them.

    A field's value is a length-delimited field's payload (after its
    length), a varint's or a fixed field's bytes. ValueError at a field
    that runs past the end, has number 0 or a wire type protobuf 3 does not
    write (groups).
    """
    pos = 0
    while pos < len(buf):
        key_start = pos
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            start = pos
            _, pos = read_varint(buf, pos)
        elif wire_type == _LENGTH_DELIMITED:
            size, start = read_varint(buf, pos)
            pos = start + size
        elif wire_type in (_FIXED64, _FIXED32):
            start, pos = pos, pos + (8 if wire_type == _FIXED64 else 4)
        else:
            raise ValueError(f"field {number}: wire type {wire_type} is not one protobuf 3 writes")
        if pos > len(buf) or number == 0:
            raise ValueError(f"field {number} runs past the message's {len(buf)} bytes or has number 0")
        yield Field(number, wire_type, key_start, start, pos)


def length_delimited(key: bytes, payload: bytes) -> bytes:
    """One length-delimited field: ``key`` (from :func:`length_delimited_key`), the length, the bytes."""
    return b"".join((key, varint(len(payload)), payload))
