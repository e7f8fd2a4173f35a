#!/usr/bin/env bash
# Lint and type-check: ruff (rules and formatting) and mypy, strict on the
# torch-free core. Zero findings or a non-zero exit. Assumes scripts/setup.sh ran.
#
# The two mypy runs go side by side, each with a cache of its own (their
# options differ, so one shared cache would be rebuilt by each in turn),
# kept outside the checkout so a new clone starts from it: mypy checks each
# cached module against its file's hash, never trusting a stale entry.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
cache="${XDG_CACHE_HOME:-$HOME/.cache}/asymptote"
"$bin/ruff" check --cache-dir "$cache/ruff" .
"$bin/ruff" format --check --cache-dir "$cache/ruff" .
"$bin/mypy" --cache-dir "$cache/mypy-strict" --strict asymptote &
strict=$!
"$bin/mypy" --cache-dir "$cache/mypy" services benchmarks &
rest=$!
status=0
wait "$strict" || status=1
wait "$rest" || status=1
exit "$status"
