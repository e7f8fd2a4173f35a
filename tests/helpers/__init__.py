"""What many tests share: waiting for an event with a deadline (``waiting``), the bad-input report
(``badinput``, ``poison``, ``refusals``), the model families built for tests (``families``), the fitter's
check of a fit against its data (``fitcheck``), Prometheus expositions (``exposition``) and fresh virtual
environments (``venvs``). Imported by name, ``from tests.helpers.waiting import wait_until``; a folder's
own helpers (tests/deploy/chart_render.py, tests/sandbox_pool/pool_process.py) stay in it.
"""
