"""Reading a service's Prometheus exposition (the text a ``/metrics`` scrape returns) in tests."""

from __future__ import annotations

import re


def gauge(prom: str, name: str) -> float:
    """The value of the first sample of ``name`` (any labels) in ``prom``; AssertionError if there is none."""
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", prom, re.MULTILINE)
    assert match, f"{name} not in the exposition"
    return float(match.group(1))
