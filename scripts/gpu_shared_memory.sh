#!/usr/bin/env bash
# CUDA shared memory on a bare GPU machine, in one run: the GPU tests of the shared-memory extension
# (tests/kserve/test_kserve_cuda_shared_memory.py, tritonclient's cuda_shared_memory in a client process), then
# scripts/measure_shared_memory.py --gpu 0: tensors in the request, in system and in CUDA shared memory, beside the
# torch backend in process.
#
#   bash scripts/gpu_shared_memory.sh OUT     # OUT/tests.log, OUT/shared-memory-gpu.{json,md}
#
# The machine lacks tritonclient and its dependencies: they travel as wheels in the ignored .whl/ folder (see
# docs/benchmarks/shared-memory.md) and are unpacked, without dependencies, into a folder of their own; the project
# goes on PYTHONPATH as a package tree linked to this checkout, as scripts/gpu_check.sh does.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_shared_memory.sh OUT}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
python=${PYTHON:-$([ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3)}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-shm.XXXXXX")
# shellcheck source=scripts/gpu_machine.sh
source "$repo/scripts/gpu_machine.sh"
unpack_wheels "$python" "$repo" "$work/site"
link_package_tree "$repo" "$work/pkg"
export PYTHONPATH="$work/pkg:$work/site${PYTHONPATH:+:$PYTHONPATH}"
cd "$work" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout "${TESTS_S:-240}" "$python" -m pytest -q -rs -p no:cacheprovider -m gpu --rootdir "$repo" \
    -c "$repo/pyproject.toml" "$repo/tests/kserve/test_kserve_cuda_shared_memory.py" 2>&1 | tail -40 | tee "$out/tests.log"
timeout "${MEASURE_S:-300}" "$python" "$repo/scripts/measure_shared_memory.py" --gpu 0 --precision fp16 \
    --seconds "${SECONDS_PER_CELL:-4}" --out "$out/shared-memory-gpu" 2>&1 | tail -30
