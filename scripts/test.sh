#!/usr/bin/env bash
# Set up (idempotent), lint and type-check, then run the whole test suite:
# the fast tier and the slow tier (real vLLM, the local stack, Prometheus).
# Arguments go to pytest, e.g. `-m "not slow"` for the fast tier alone.
# Two parallel workers (ASY_TEST_WORKERS; 0 runs in one process): each takes
# whole modules, longest first (tests/conftest.py), so most of what one
# worker waits on (a service starting, a stack's step) the other fills.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
exec .venv/bin/python -m pytest -n "${ASY_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
