#!/usr/bin/env bash
# Every check CI runs: lint, types, proto lint/format/freshness/breaking, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";  ruff check .
echo "== mypy";  mypy server runtime client trainer_adapters
echo "== protos"; bash scripts/check_protos.sh
base=""
if git rev-parse -q --verify origin/main >/dev/null && [ "$(git rev-parse HEAD)" != "$(git rev-parse origin/main)" ]; then
  base=$(git merge-base HEAD origin/main)
elif git rev-parse -q --verify HEAD~1 >/dev/null; then
  base=$(git rev-parse HEAD~1)
fi
if [ -n "$base" ] && git cat-file -e "$base:buf.yaml" 2>/dev/null; then
  echo "== buf breaking against $base"; buf breaking --against ".git#ref=$base"
fi
echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"
