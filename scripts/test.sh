#!/usr/bin/env bash
# Set up (idempotent), lint and type-check, then run the whole test suite:
# the fast tier and the slow tier (real vLLM, the local stack, Prometheus).
# Arguments go to pytest, e.g. `-m "not slow"` for the fast tier alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
exec .venv/bin/python -m pytest "$@"
