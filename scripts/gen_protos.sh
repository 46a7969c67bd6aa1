#!/usr/bin/env bash
# Regenerates the Python code of every .proto under protos/: protos/capsnet/v1/capsnet.proto ->
# capsnet/v1/capsnet_pb2.py (+ _pb2_grpc.py, .pyi), protos/capsnet/kserve/*.proto -> capsnet/kserve/.
# The generated files are committed; tests/serving checks they match their protos.
# grpcio-tools 1.80 (pyproject's dev extra) writes protobuf 6.31.1 gencode, which runs on protobuf 6.31.1
# and later (7.x too), so the code works beside tritonclient's protobuf < 7.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root; PYTHON picks the interpreter)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$repo}" && cd "${1:-$repo}" && pwd)
python=${PYTHON:-python3}
cd "$repo"
mapfile -t protos < <(find protos -name '*.proto' | LC_ALL=C sort)
"$python" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${protos[@]}"
# Package `inference` is tritonclient's too: register ours in capsnet.kserve.POOL, not protobuf's default
# pool, so both load in one process (protoc has no option for this).
kserve=("$out"/capsnet/kserve/*_pb2.py)
for file in "${kserve[@]}"; do  # each of them: the sed below must find its line in every file
    grep -q '^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(' "$file"
done
sed -i -e 's/^from google.protobuf import descriptor_pool as _descriptor_pool$/from capsnet.kserve import POOL as _POOL/' \
       -e 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/DESCRIPTOR = _POOL.AddSerializedFile(/' "${kserve[@]}"
