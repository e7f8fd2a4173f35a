"""Recipe sweeps decided by their projected asymptote (``asymptote sweep``).

The rule that stops a sweep's arms (``rule.py``: dominated, equivalent, undecided, or unstable, at planned
looks) and the Optuna pruner that carries it into any Optuna study (``pruner.py``). The sweep sits above
the runs it compares, as the local stack and the operator tools do: it reads the fitter's pure curve and
decision code (``services.fitter.curve``, ``services.fitter.decision``), so that ``asymptote fit``, the
live fitter and a sweep compare runs by one rule, and no deployable imports it. Torch-free.
"""
