#!/usr/bin/env bash
# The service on a lent GPU machine, in one prepared run (about 10 of its 15 minutes):
#   bash benchmarks/gpu_run.sh --wheels DIR --model DIR [--out DIR]
#   bash benchmarks/gpu_run.sh --dry-run [--out DIR]      # the same driver on this CPU
# 1. installs this checkout and vLLM from carried wheels (no network there: --no-index);
# 2. starts vLLM on the model and checks itself in seconds (the engine answers one turn
#    directly and through a real server process) before spending minutes;
# 3. measures vLLM behind the service against the same vLLM called directly, multi-turn
#    sessions at 64 and 256 concurrent (tokens/s, p50/p99 turn latency, trajectories per
#    GPU-hour): python -m rollout.benchmarks.gpu;
# 4. runs DAPO steps on the GPU (rollout train dapo, in-process server and engine) and keeps
#    its log, whose step lines carry the step time and the kept groups.
# Everything lands in --out (default ./gpu-out): bench.json, bench.txt, dapo.log, env.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0; WHEELS=""; MODEL=""; OUT="gpu-out"; CONC="64,256"; TURNS=4; DAPO_STEPS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) WHEELS="$2"; shift ;;
    --model) MODEL="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --concurrency) CONC="$2"; shift ;;
    --turns) TURNS="$2"; shift ;;
    --dapo-steps) DAPO_STEPS="$2"; shift ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; uname -a; nproc; cat /proc/loadavg
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/env.txt" 2>&1 || true

if [ "$DRY" = 1 ]; then
  PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
  "$PY" -m rollout.benchmarks.gpu check --dry-run
  "$PY" -m rollout.benchmarks.gpu bench --dry-run --concurrency "$CONC" --turns "$TURNS" \
      --json "$OUT/bench.json" | tee "$OUT/bench.txt"
  echo "dapo: not run in --dry-run (it needs the model's weights and a GPU)" | tee "$OUT/dapo.log"
  echo "dry run done: $OUT"
  exit 0
fi

[ -n "$WHEELS" ] && [ -n "$MODEL" ] || { echo "--wheels DIR and --model DIR are required" >&2; exit 2; }
VENV="${VENV:-/tmp/rollout-gpu-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" vllm
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" -e ".[server]"
fi
PY="$VENV/bin/python"
"$PY" - <<'PYCHECK'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print("cuda:", torch.cuda.get_device_name(0))
PYCHECK

PORT=8001
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name bench \
    --port "$PORT" --logprobs-mode processed_logprobs --max-num-seqs 256 \
    > "$OUT/vllm.log" 2>&1 &
VLLM=$!
trap 'kill $VLLM 2>/dev/null || true; wait $VLLM 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $VLLM 2>/dev/null || { tail -30 "$OUT/vllm.log"; exit 1; }
  sleep 1
done
ENGINE=(--vllm-url "http://127.0.0.1:$PORT" --model bench --tokenizer "$MODEL")
timeout 120 "$PY" -m rollout.benchmarks.gpu check "${ENGINE[@]}"
timeout 420 "$PY" -m rollout.benchmarks.gpu bench "${ENGINE[@]}" --concurrency "$CONC" \
    --turns "$TURNS" --json "$OUT/bench.json" | tee "$OUT/bench.txt"
kill $VLLM; wait $VLLM 2>/dev/null || true; trap - EXIT

timeout 300 "$VENV/bin/rollout" train dapo --config trainer_adapters/dapo/smollm2_cpu.toml \
    --set "model.path=\"$MODEL\"" --set "run.steps=$DAPO_STEPS" --set run.time_limit_s=240 \
    --set "run.dir=\"$OUT/dapo\"" > "$OUT/dapo.log" 2>&1 || echo "dapo exited $?" >> "$OUT/dapo.log"
tail -20 "$OUT/dapo.log"
echo "done: $OUT"
