#!/usr/bin/env bash
# Installs the agent harnesses that the `harness` environment's presets run inside a job's
# sandbox, so no job ever reaches a registry (runtime/envs/harness/shipped/*.toml):
#
#   harness-mini-swe-agent-<key>   mini-swe-agent in a venv of its own (it pins litellm and
#                                  friends that the server's venv must not carry), made from the
#                                  server's base interpreter, which every sandbox can run.
#   harness-codex-<key>            OpenAI Codex CLI from npm (a Node launcher and the native
#                                  binary of this platform).
#
# Each lives under the set-up cache (like the vLLM and trainer venvs), keyed by its recipe (the
# install function's text and versions); a harness job's sandbox binds it read-only at
# /.rollout-harness (so presets run a venv's interpreter, not its scripts, whose first line
# names the build path). The server finds them through `current-harness-<name>` links in the
# same directory. Idempotent: a built harness (its stamp) is a no-op. ROLLOUT_SKIP_HARNESSES=1
# skips this step; the harness tests then skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLOUT_SKIP_HARNESSES:-0}" = "1" ]; then
  echo "setup_harnesses: skipped (ROLLOUT_SKIP_HARNESSES=1)"
  exit 0
fi

CACHE=${ROLLOUT_SETUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service}
# The interpreter the server's venv was made from: the sandbox binds its prefix in, so a venv
# made from it runs there as well.
BASE_PY=$(.venv/bin/python -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')

MINI_SWE_AGENT_VERSION=2.4.6
CODEX_VERSION=0.169.0

install_mini_swe_agent() {  # $1: target directory
  "$BASE_PY" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q "mini-swe-agent==$MINI_SWE_AGENT_VERSION"
  "$1/bin/python" -c "import minisweagent, litellm" >/dev/null
}

install_codex() {  # $1: target directory
  mkdir -p "$1"
  npm install --prefix "$1" --no-audit --no-fund --loglevel=error "@openai/codex@$CODEX_VERSION"
  "$1/node_modules/.bin/codex" --version >/dev/null
}

# build NAME INSTALL_FUNCTION
build() {
  local name=$1 install=$2 want dir
  want="$({ declare -f "$install"; echo "$BASE_PY $MINI_SWE_AGENT_VERSION $CODEX_VERSION"; } \
    | sha256sum | cut -c1-16)"
  dir=$CACHE/harness-$name-$want
  if [ "$(cat "$dir/.setup-stamp" 2>/dev/null)" != "$want" ]; then
    local t0=$SECONDS
    mkdir -p "$CACHE"
    rm -rf "$dir"
    "$install" "$dir"
    chmod -R a+rX "$dir"
    echo "$want" > "$dir/.setup-stamp"
    echo "setup_harnesses: $dir built in $((SECONDS - t0)) s"
  fi
  ln -sfn "$(basename "$dir")" "$CACHE/current-harness-$name"
}

build mini-swe-agent install_mini_swe_agent
if command -v npm >/dev/null 2>&1; then
  build codex install_codex
else
  echo "setup_harnesses: no npm on PATH, so no Codex CLI (its preset and tests are unavailable)"
fi
