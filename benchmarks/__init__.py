"""The project's benchmarks: every performance claim as a figure measured against a baseline.

Each module measures one part (learner step, generator engine, broker
throughput, weight transfer, fitter, in-flight pipeline) and returns
:class:`benchmarks.figure.Figure` records; ``benchmarks.run`` (``asymptote
bench``) runs them side by side and writes ``bench.json`` and ``bench.md``.
Benchmarks sit beside the deployables, not inside them: no service imports
this package, and no service image ships it.
"""
