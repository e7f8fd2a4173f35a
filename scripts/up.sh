#!/usr/bin/env bash
# Set up (idempotent) and run the embedded default end to end:
# nats-server, broker, learner, fitter and a vLLM generator on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/asymptote up "$@"
