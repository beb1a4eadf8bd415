#!/usr/bin/env bash
# Builds the two trainer environments the adapter tests run in, each beside the main .venv:
#
#   .venv-verl      verl 0.9.1 and what its agent loop, DataProto and AgentLoopWorker import on a
#                   CPU (no vLLM, no flash-attn, no GPU), plus our package without its deps.
#   .venv-nemo-gym  nemo-gym 0.7.0 and what its agent/resources server base classes and
#                   pydantic models import, plus our package without its deps.
#
# Own environments because both pin transformers below the server's (verl: < 5.11) or pull in
# large stacks (nemo-gym: mlflow, wandb, ray, anthropic, mcp) that the main venv must not carry.
# Each package goes in with --no-deps and only the dependencies its imported modules need, so a
# fresh CI machine spends minutes, not tens of minutes, here. Our own package goes in editable and
# --no-deps, followed by the gRPC stack at the versions of the main venv (the generated stubs
# require protobuf >= 7.35.1; a trainer's resolver would pick the same from our metadata).
#
# Caching: each environment's third-party packages (verl or nemo-gym, torch, ray...) are built
# once into a venv under the cache directory, keyed by this script and the gRPC pins; the
# checkout's .venv-verl / .venv-nemo-gym is a small venv that adds that cached site-packages with
# a .pth line and holds only our own package (editable, seconds to install). A fresh clone (CI)
# therefore reuses minutes of installs. Idempotent: stamps make a second run a no-op. Set
# ROLLOUT_SKIP_ADAPTERS=1 to skip it (the adapter tests then skip, saying why; under CI=true
# they fail instead).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLOUT_SKIP_ADAPTERS:-0}" = "1" ]; then
  echo "setup_adapters: skipped (ROLLOUT_SKIP_ADAPTERS=1)"
  exit 0
fi

PY=${PYTHON:-python3}
# The gRPC stack of the main venv, so that both sides of the wire run the same versions.
grpc_pins() {
  .venv/bin/python - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in
               ("grpcio", "grpcio-status", "protobuf", "googleapis-common-protos")))
EOF
}

# setuptools prints pages of packaging warnings while building an editable wheel; show them
# only when the step fails.
quiet() {
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  [ $rc -eq 0 ] || cat "$log" >&2
  rm -f "$log"
  return $rc
}

CACHE=${ROLLOUT_SETUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service}

# What a cached third-party venv depends on: its install recipe (the function's text, not this
# script's comments) and the main venv's gRPC versions.
heavy_stamp() { { declare -f "$1"; grpc_pins; } | sha256sum | cut -c1-16; }
# What the checkout's own small venv depends on besides: the package list and entry points of
# pyproject.toml (an editable install must be redone when they change), not every edit of it.
local_stamp() {
  { heavy_stamp "$1"
    sed -n '/^\[project.entry-points/,/^$/p; /^packages = \[/,/^\]/p' pyproject.toml
    pwd; } | sha256sum | cut -c1-16
}

# build NAME INSTALL_FUNCTION CHECK_IMPORTS
build() {
  local name=$1 install=$2 check=$3
  local heavy want local_venv=.venv-$1
  want="$(heavy_stamp "$install")"
  heavy=$CACHE/venv-$name-$want
  if [ "$(cat "$heavy/.setup-stamp" 2>/dev/null)" != "$want" ]; then
    local t0=$SECONDS
    mkdir -p "$CACHE"
    rm -rf "$heavy"
    "$PY" -m venv "$heavy"
    "$heavy/bin/python" -m pip install -q --upgrade pip
    "$install" "$heavy/bin/python -m pip"
    "$heavy/bin/python" -m pip install -q $(grpc_pins)
    echo "$want" > "$heavy/.setup-stamp"
    echo "setup_adapters: $heavy built in $((SECONDS - t0)) s"
  fi
  local lwant
  lwant="$(local_stamp "$install")"
  [ "$(cat "$local_venv/.setup-stamp" 2>/dev/null)" = "$lwant" ] && return 0
  rm -rf "$local_venv"
  "$PY" -m venv --without-pip "$local_venv"
  local site heavy_site
  site=$("$local_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  heavy_site=$("$heavy/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir (not a bare path line) so the cached venv's own .pth files are processed too.
  echo "import site; site.addsitedir('$heavy_site')" > "$site/_rollout_cached_venv.pth"
  quiet "$local_venv/bin/python" -m pip install -q --no-deps -e .
  "$local_venv/bin/python" -c "$check"
  echo "$lwant" > "$local_venv/.setup-stamp"
}

install_verl() {
  local pip=$1
  # The local CPU wheel; any other torch version downloads a CUDA build of several GB.
  $pip install -q torch==2.13.0
  $pip install -q --no-deps verl==0.9.1
  # What verl.protocol, verl.experimental.agent_loop and verl.utils import at module level on a
  # CPU. ray without [default]: the dashboard and its web stack are not needed in-process.
  $pip install -q "transformers>=5.5.3,<5.11,!=5.6.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
    ray omegaconf hydra-core pillow codetiming datasets cachetools fastapi uvicorn pydantic \
    numpy pandas pyarrow dill packaging pytest pytest-asyncio pytest-timeout
  # verl's V1 trainer modules (verl.trainer.ppo.v1: its per-rollout GRPO advantages over
  # several outputs per sample, TransferQueue keys) and ray_trainer's compute_advantage import
  # these at module level (found by importing both in this venv); --no-deps keeps ray without
  # [default], tensordict pinned above, and peft/accelerate from pulling another torch.
  $pip install -q --no-deps TransferQueue==0.1.11 torchdata==0.11.0 peft accelerate
  $pip install -q pyzmq msgspec psutil "prometheus_client>=0.20.0" aiohttp
}

install_nemo_gym() {
  local pip=$1
  # nemo-gym declares Python >= 3.13 but runs on 3.11; its full dependency list also pulls in
  # mlflow, anthropic, mcp and datasets, which its server base classes and pydantic models do
  # not import. The list below is what `import nemo_gym.server_utils` and the agent and
  # resources base classes need (found by importing them in a bare venv).
  $pip install -q --no-deps --ignore-requires-python nemo-gym==0.7.0
  $pip install -q "openai==2.44.0" pydantic fastapi uvicorn httptools aiohttp omegaconf \
    hydra-core rich itsdangerous orjson psutil requests pyyaml packaging "anyio>=4.15.1" httpx \
    ray yappi pydot pandas scipy wandb pytest pytest-asyncio pytest-timeout
}

# pip's "Location ... is ignored" lines (local mirrors without that package) are noise here.
build verl install_verl \
  "import verl.experimental.agent_loop, rollout.trainer_adapters.verl.agent_loop" \
  2> >(grep -v "Location .* is ignored" >&2)
build nemo-gym install_nemo_gym \
  "import nemo_gym.server_utils, nemo_gym.base_responses_api_agent" \
  2> >(grep -v "Location .* is ignored" >&2)
