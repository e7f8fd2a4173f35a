"""The Helm chart's labels, as ``asymptote kube`` selects a release's objects
by them (deploy/helm/asymptote/templates/_helpers.tpl: ``asymptote.labels``).
"""

from __future__ import annotations

POOL_LABEL = "asymptote.dev/generator-pool"
"""The generator pool a Deployment or StatefulSet (and its pods) belongs to."""


def release_selector(release: str, component: str | None = None) -> str:
    """Label selector of the chart's objects of ``release`` (optionally one component)."""
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/part-of=asymptote"
    return selector + (f",app.kubernetes.io/component={component}" if component else "")
