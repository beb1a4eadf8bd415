#!/usr/bin/env bash
# Regenerates the committed Python code for proto/rollout/v1 (messages, type stubs, gRPC stubs).
# CI runs it and fails if the committed files differ (scripts/check_protos.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
rm -f proto/rollout/v1/*_pb2.py proto/rollout/v1/*_pb2.pyi proto/rollout/v1/*_pb2_grpc.py
"$PY" -m grpc_tools.protoc -Iproto \
  --python_out=proto --pyi_out=proto --grpc_python_out=proto \
  proto/rollout/v1/*.proto
