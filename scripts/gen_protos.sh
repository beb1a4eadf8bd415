#!/usr/bin/env bash
# Regenerates the committed Python code for proto/rollout/v1 (messages, type stubs, gRPC stubs).
# CI runs it and fails if the committed files differ (scripts/check_protos.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
rm -f proto/rollout/v1/*_pb2.py proto/rollout/v1/*_pb2.pyi proto/rollout/v1/*_pb2_grpc.py \
  proto/rollout/v1/descriptor_set.binpb
"$PY" -m grpc_tools.protoc -Iproto \
  --python_out=proto --pyi_out=proto --grpc_python_out=proto \
  proto/rollout/v1/*.proto
# The descriptor set with comments (source info) that server reflection serves, so that
# `grpcurl describe` shows the documentation (server/api/reflection.py); with the vendored
# google.rpc types, so reflection clients can decode error details. Python's google.rpc code
# comes from googleapis-common-protos, so proto/google is not generated here.
"$PY" -m grpc_tools.protoc -Iproto --include_imports --include_source_info \
  --descriptor_set_out=proto/rollout/v1/descriptor_set.binpb proto/rollout/v1/*.proto \
  proto/google/rpc/*.proto
