"""Operator tools: planning a run before it starts (``asymptote plan``) and operating a deployed one
(``asymptote kube``).

Nothing here is deployed as a service: it does arithmetic over the learner's
memory model and the planner's cost model, or talks to the Kubernetes API and
to the services' public endpoints (gRPC health, ``/metrics``) from outside,
and knows the Helm chart's labels, not the services' internals.
"""
