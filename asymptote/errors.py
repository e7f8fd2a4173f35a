"""The project's error tree: one base class, one subclass per boundary."""

from __future__ import annotations


class AsymptoteError(Exception):
    """Base class for errors raised on purpose by Asymptote."""


class ConfigError(AsymptoteError, ValueError):
    """A configuration file or override is invalid; the message names it."""


class PayloadError(AsymptoteError, ValueError):
    """A message on the wire could not be decoded or failed validation."""


class WeightsError(AsymptoteError, ValueError):
    """A weight update was refused (checksum, names, shapes, dtypes, NaN/Inf)."""


class StagingError(AsymptoteError, OSError):
    """A weight update could not be written where the engine reads it (tmpfs full or unwritable).

    Not the update's fault: the version is pulled again later, not refused.
    """


class ModelError(AsymptoteError, ValueError):
    """A model directory cannot be loaded as configured (a weight one side lacks, an unsupported head)."""
