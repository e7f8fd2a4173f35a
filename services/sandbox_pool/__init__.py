"""The sandbox pool: model-written programs run in a deployable of their own (``asymptote sandbox-pool``)."""
