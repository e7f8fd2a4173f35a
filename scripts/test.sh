#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
