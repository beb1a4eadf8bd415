#!/usr/bin/env bash
# The official SWE-bench harness package (`swebench`), which grades SWE-bench-style image
# instances (runtime/envs/swe/images.py: their eval script, test commands and log parsers by
# repository), in a venv of its own under the set-up cache:
#
#   swebench-<key>/          swebench==SWEBENCH_VERSION with its dependencies, and in its
#                            swebench5/ folder swebench==SWEBENCH5_VERSION (no dependencies of
#                            its own: it imports with the same ones), and in its swesmith/
#                            folder swesmith==SWESMITH_VERSION (SWE-smith's repository profiles:
#                            test commands and log parsers; likewise without dependencies)
#   current-swebench         a link to it, which the server finds (or $ROLLOUT_SWEBENCH_PYTHON)
#
# Why its own venv: the package's top-level import pulls in docker, datasets, modal and ghapi,
# which the server's venv must not carry; the grader calls this venv's interpreter with
# runtime/envs/swe/swebench_helper.py. Idempotent (a stamp keyed by the recipe), quiet when
# done. ROLLOUT_SKIP_SWEBENCH=1 skips it; the tests that need it then skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLOUT_SKIP_SWEBENCH:-0}" = "1" ]; then
  echo "setup_swebench: skipped (ROLLOUT_SKIP_SWEBENCH=1)"
  exit 0
fi

CACHE=${ROLLOUT_SETUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service}
BASE_PY=$(.venv/bin/python -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
SWEBENCH_VERSION=4.1.0
# SWE-bench 5 moved each instance's eval script, log parser and eval type into the data set
# (the per-repository tables of 4.x are gone): instances in that format are graded with it,
# instances without those fields with 4.x's tables.
SWEBENCH5_VERSION=5.0.2
SWESMITH_VERSION=0.0.9

install_swebench() {  # $1: target directory
  "$BASE_PY" -m venv "$1"
  # (pip.conf find-links that do not exist on this machine make pip warn per package)
  "$1/bin/python" -m pip install -q --disable-pip-version-check "swebench==$SWEBENCH_VERSION" \
    2> >(grep -v "^WARNING: Location" >&2)
  "$1/bin/python" -c "from swebench.harness.test_spec.test_spec import make_test_spec; \
from swebench.harness.grading import get_logs_eval" >/dev/null
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$1/swebench5" \
    "swebench==$SWEBENCH5_VERSION" 2> >(grep -v "^WARNING: Location" >&2)
  PYTHONPATH="$1/swebench5" "$1/bin/python" -c "from swebench.harness.utils import make_test_spec; \
from swebench.harness.grading import get_logs_eval; from swebench.harness.log_parsers import \
PARSER_REGISTRY" >/dev/null
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$1/swesmith" \
    "swesmith==$SWESMITH_VERSION" 2> >(grep -v "^WARNING: Location" >&2)
  (cd / && PYTHONPATH="$1/swesmith" "$1/bin/python" -c "from swesmith.profiles import registry; \
from swesmith.harness.grading import get_eval_tests_report, read_test_output" >/dev/null)
}

want="$({ declare -f install_swebench; echo "$BASE_PY $SWEBENCH_VERSION $SWEBENCH5_VERSION $SWESMITH_VERSION"; } | sha256sum | cut -c1-16)"
dir=$CACHE/swebench-$want
if [ "$(cat "$dir/.setup-stamp" 2>/dev/null)" != "$want" ]; then
  t0=$SECONDS
  mkdir -p "$CACHE"
  rm -rf "$dir"
  install_swebench "$dir"
  echo "$want" > "$dir/.setup-stamp"
  echo "setup_swebench: $dir built in $((SECONDS - t0)) s"
fi
[ "$(readlink "$CACHE/current-swebench" 2>/dev/null)" = "$(basename "$dir")" ] \
  || ln -sfn "$(basename "$dir")" "$CACHE/current-swebench"
