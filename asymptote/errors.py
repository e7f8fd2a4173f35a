"""The project's error tree: one base class, one subclass per boundary."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


class AsymptoteError(Exception):
    """Base class for errors raised on purpose by Asymptote."""


class ConfigError(AsymptoteError, ValueError):
    """A configuration file or override is invalid; the message names it."""


class PayloadError(AsymptoteError, ValueError):
    """A message on the wire could not be decoded or failed validation."""


class WeightsError(AsymptoteError, ValueError):
    """A weight update was refused (checksum, names, shapes, dtypes, NaN/Inf)."""


def parse(message_type: type[M], data: bytes) -> M:
    """Decode one protobuf message; PayloadError names the type on failure."""
    try:
        return message_type.FromString(data)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise PayloadError(f"undecodable {message_type.DESCRIPTOR.name}: {exc}") from exc
