#!/usr/bin/env bash
# Regenerates the Python code of every .proto under protos/: protos/capsnet/v1/capsnet.proto ->
# capsnet/v1/capsnet_pb2.py (+ _pb2_grpc.py, .pyi), protos/capsnet/kserve/*.proto -> capsnet/kserve/.
# The generated files are committed; tests/serving checks they match their protos.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root; PYTHON picks the interpreter)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$repo}" && cd "${1:-$repo}" && pwd)
python=${PYTHON:-python3}
cd "$repo"
mapfile -t protos < <(find protos -name '*.proto' | LC_ALL=C sort)
"$python" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${protos[@]}"
