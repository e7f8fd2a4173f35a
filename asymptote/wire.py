"""Protobuf's wire format by hand, for messages whose big fields are bytes already.

Owns the few encodings the services write themselves instead of building
a message to serialize: a base-128 varint, and a length-delimited field
(its key, its length, its bytes). A weight chunk's tensor bytes and a
broker's stored rollout groups are framed this way, so they are copied
once, into the frame, rather than into a message and again into its
serialization; a reader sees exactly what ``SerializeToString`` would give.
"""

from __future__ import annotations


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


def length_delimited(key: bytes, payload: bytes) -> bytes:
    """One length-delimited field: ``key`` (from :func:`length_delimited_key`), the length, the bytes."""
    return b"".join((key, varint(len(payload)), payload))
