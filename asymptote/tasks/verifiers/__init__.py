"""Verifiers: built-in ones, plugins from an entry-point group, and rewards.

``make_verifier(settings)`` builds the verifier a ``VerifierSettings``
selects. Built-ins: ``math`` (math-verify), ``exact``, ``regex``,
``choice`` and ``code`` (the program run against tests in the sandbox). A package adds its own without forking by declaring an entry
point in the ``asymptote.verifiers`` group whose object, called with the
``options`` mapping of a ``plugin`` setting, returns a ``Verifier``::

    [project.entry-points."asymptote.verifiers"]
    chess = "my_package.chess:make_verifier"

Rewards: a verdict is worth 1 when correct and, by ``RewardStyle``, 0
("binary") or -1 ("signed") otherwise, whatever the reason (a timeout
must not pay better than a wrong answer).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Annotated, Any, Literal

from pydantic import Field

from asymptote.config import Frozen
from asymptote.tasks.verifiers.base import REASONS, Reason, Verdict, Verifier, normalize, strip_think
from asymptote.tasks.verifiers.code import CodeSettings, CodeVerifier
from asymptote.tasks.verifiers.math import MathSettings, MathVerifier
from asymptote.tasks.verifiers.text import (
    ChoiceSettings,
    ChoiceVerifier,
    ExactSettings,
    ExactVerifier,
    RegexSettings,
    RegexVerifier,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "REASONS",
    "ChoiceSettings",
    "CodeSettings",
    "ExactSettings",
    "MathSettings",
    "PluginSettings",
    "Reason",
    "RegexSettings",
    "RewardStyle",
    "Verdict",
    "Verifier",
    "VerifierSettings",
    "make_verifier",
    "normalize",
    "plugin_names",
    "reward",
    "strip_think",
]

ENTRY_POINT_GROUP = "asymptote.verifiers"
"""Entry-point group a package registers its verifier factories in."""

RewardStyle = Literal["binary", "signed"]
"""binary: rewards in {0, 1}; signed: rewards in {-1, +1}."""


class PluginSettings(Frozen):
    """A verifier from another package, found through the asymptote.verifiers entry-point group."""

    kind: Literal["plugin"] = "plugin"
    """Verifier kind."""
    entry_point: str = Field(min_length=1)
    """Name of the entry point in the asymptote.verifiers group."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Mapping passed as the factory's only argument (the plugin's own settings)."""


VerifierSettings = Annotated[
    MathSettings | ExactSettings | RegexSettings | ChoiceSettings | CodeSettings | PluginSettings,
    Field(discriminator="kind"),
]


def plugin_names() -> list[str]:
    """Names of the verifier entry points installed in this environment."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _plugin(settings: PluginSettings) -> Verifier:
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == settings.entry_point]
    if not found:
        known = ", ".join(plugin_names()) or "none installed"
        raise ValueError(
            f"no verifier entry point {settings.entry_point!r} in group {ENTRY_POINT_GROUP!r} (known: {known})"
        )
    factory = found[0].load()
    verifier = factory(dict(settings.options))
    if not isinstance(verifier, Verifier):
        raise TypeError(
            f"entry point {settings.entry_point!r} returned {type(verifier).__name__}, which lacks "
            "check_reference(reference) and verdict(completion, reference)"
        )
    return verifier


def make_verifier(
    settings: MathSettings | ExactSettings | RegexSettings | ChoiceSettings | CodeSettings | PluginSettings,
) -> Verifier:
    """The verifier ``settings`` selects; ValueError for a plugin that is not installed."""
    if isinstance(settings, MathSettings):
        return MathVerifier(settings)
    if isinstance(settings, ExactSettings):
        return ExactVerifier(settings)
    if isinstance(settings, RegexSettings):
        return RegexVerifier(settings)
    if isinstance(settings, ChoiceSettings):
        return ChoiceVerifier(settings)
    if isinstance(settings, CodeSettings):
        return CodeVerifier(settings)
    return _plugin(settings)


def reward(verdict: Verdict, style: RewardStyle) -> float:
    """1.0 for a correct verdict; otherwise 0.0 (binary) or -1.0 (signed)."""
    if verdict.correct:
        return 1.0
    return -1.0 if style == "signed" else 0.0
