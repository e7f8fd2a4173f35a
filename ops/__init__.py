"""Operator tools for a deployed run (``asymptote kube``).

Nothing here is deployed as a service: it talks to the Kubernetes API and
to the services' public endpoints (gRPC health, ``/metrics``) from outside,
and knows the Helm chart's labels, not the services' internals.
"""
