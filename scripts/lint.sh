#!/usr/bin/env bash
# Lint and type-check: ruff (rules and formatting) and mypy, strict on the
# torch-free core. Zero findings or a non-zero exit. Assumes scripts/setup.sh ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy" --strict asymptote
"$bin/mypy" services benchmarks ops
