"""The sandbox backends this machine has, found by their own self-tests (at collection).

Tests parametrize over ``AVAILABLE``, so a backend the machine lacks is
not run (and cannot pass vacuously); ``test_escapes`` asserts there is at
least one.
"""

from __future__ import annotations

from asymptote.sandbox import Sandbox, SandboxSettings, SandboxUnavailable, select_sandbox


def settings_for(backend: str) -> SandboxSettings:
    return SandboxSettings.model_validate({"backend": backend})


def _available() -> dict[str, Sandbox]:
    found: dict[str, Sandbox] = {}
    for backend in ("bubblewrap", "landlock"):
        try:
            found[backend] = select_sandbox(settings_for(backend)).sandbox
        except SandboxUnavailable:
            continue
    return found


AVAILABLE = _available()
"""Backend name -> a sandbox whose self-test passed here."""
