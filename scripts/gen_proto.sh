#!/usr/bin/env bash
# Regenerates kev/v1/*_pb2*.py(i) from proto/kev/v1/*.proto. The outputs are committed;
# tests/rpc/test_proto_generated.py fails when they drift from what this script produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/kev/v1/*.proto
