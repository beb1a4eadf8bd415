#!/usr/bin/env bash
# Fails when the committed generated code is stale, or when buf lint / buf format complain.
set -euo pipefail
cd "$(dirname "$0")/.."
buf lint
buf format --diff --exit-code
bash scripts/gen_protos.sh
if ! git diff --quiet --exit-code -- proto/; then
  echo "generated code in proto/ is stale: run scripts/gen_protos.sh and commit" >&2
  git diff --stat -- proto/ >&2
  exit 1
fi
