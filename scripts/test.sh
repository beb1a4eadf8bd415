#!/usr/bin/env bash
# Every check CI runs: lint, types, proto lint/format/freshness/breaking, then the test suite.
# First the test-only set-up (dev tools, vLLM / verl / NeMo Gym venvs, Ray, Node, Go): a no-op
# once built; ROLLOUT_SKIP_TEST_SETUP=1 skips even the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${ROLLOUT_SKIP_TEST_SETUP:-}" ] || bash scripts/setup_test.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";  ruff check .
# mypy cannot follow setuptools' editable finder, which maps rollout.client onto client/ and so
# on: give it a tree of links with the installed layout instead.
tree=build/typecheck
mkdir -p "$tree/rollout"
for pkg in client entrypoints benchmarks server runtime trainer_adapters; do ln -sfn "../../../$pkg" "$tree/rollout/$pkg"; done
ln -sfn ../../../proto/rollout/v1 "$tree/rollout/v1"
ln -sf ../../../proto/rollout/__init__.py "$tree/rollout/__init__.py"
echo "== mypy";  MYPYPATH="$tree" mypy -p rollout
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
# Two worker processes (ROLLOUT_TEST_WORKERS; 0 runs everything in this process), each taking
# whole files, so a file's module fixtures (a registry, a vLLM, a model) start once. Much of the
# suite waits on subprocesses, so two workers finish in ~60% of one's time on two cores, and on a
# busy machine they hold twice one process's share of the CPU. Files with a test marked `slow` go
# first (tests/conftest.py; xdist's own reorder is off), so no long file is left for the end. The
# slowest tests are listed at the end, so a run that creeps towards CI's budget says where, and
# every test's time is in build/test-report.xml (JUnit XML, which CI systems read; `python
# scripts/test_times.py` sums it per file, to find what to mark slow or trim).
workers=${ROLLOUT_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
mkdir -p build
python -m pytest -q -p no:cacheprovider --durations=25 --junit-xml=build/test-report.xml \
  "${parallel[@]}" "$@"
