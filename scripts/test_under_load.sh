#!/usr/bin/env bash
# The README's test command beside a CPU hog, as a busy CI machine or a shared workstation runs
# it: HOGS busy loops (default 8, which holds a 2-core machine at load >= 8) for the whole run,
# then the wall time and the load averages seen. Extra arguments go to pytest.
#   bash scripts/test_under_load.sh                 # everything, at load >= 8
#   HOGS=4 bash scripts/test_under_load.sh tests/server -x
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=${HOGS:-8}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq "$hogs"); do
  ( while :; do :; done ) &
  pids+=($!)
done
# Let the 1-minute load average climb to the hog count before the suite starts (at most two
# minutes), so the figures describe a run that was loaded from its first test.
for _ in $(seq 24); do
  awk -v h="$hogs" '{exit !($1 < h)}' /proc/loadavg || break
  sleep 5
done
loads=$(mktemp)
( while sleep 30; do cut -d' ' -f1 /proc/loadavg >> "$loads"; done ) &
pids+=($!)
start=$SECONDS
rc=0
bash scripts/test.sh "$@" || rc=$?
summary=$(sort -n "$loads" | awk '{a[NR]=$1} END {if (NR) printf "load min %s median %s max %s", a[1], a[int((NR+1)/2)], a[NR]; else print "load not sampled"}')
echo "== test_under_load: exit $rc, $((SECONDS - start)) s wall, $hogs CPU hogs, $summary"
rm -f "$loads"
exit $rc
