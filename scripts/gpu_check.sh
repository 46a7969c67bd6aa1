#!/usr/bin/env bash
# The GPU check, on a bare GPU machine, in one run: install against the machine's own torch, train the paper model
# briefly on the embedded digits on the GPU, export it, time every engine in one process (the public formulation,
# the model eager and under torch.compile, every served engine; device-resident and numpy in and out; a profiler
# table of each, last, with the fused routing kernels' own device time apart from the convolutions'), serve it on
# the GPU under gRPC and REST load, one-image requests against the bare gRPC floor and 1 and N front-end processes
# (scripts/bench_front_end.py), run the GPU tests. Every step has its own time limit within one budget; a failed
# step does not stop the others; the
# results so far are rewritten after each step to OUT/gpu_check.json and OUT/gpu_check.md (OUT/gpu_check.log: all
# output).
#
#   bash scripts/gpu_check.sh OUT                 # on the GPU machine (budget: GPU_CHECK_BUDGET_S, default 420 s)
#   bash scripts/gpu_check.sh --cpu-dry-run OUT   # every step on the CPU, small sizes: the script walked end to end
#
# Missing Python packages travel as pure-Python wheels in the repository's ignored .whl/ folder and are unpacked,
# without their dependencies, into a folder of their own; the project itself goes on PYTHONPATH as a package tree
# linked to this checkout.
set -uo pipefail

dry=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
    dry=1
    shift
fi
out=${1:?usage: bash scripts/gpu_check.sh [--cpu-dry-run] OUT}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
budget=${GPU_CHECK_BUDGET_S:-$([ $dry = 1 ] && echo 900 || echo 420)}
began=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$work/parts"
exec > >(tee -a "$out/gpu_check.log") 2>&1

if [ $dry = 1 ]; then
    python=${PYTHON:-$repo/.venv/bin/python}
    dry_flag=(--cpu-dry-run)
    export TRITON_INTERPRET=1  # the fused kernels on the CPU: Triton's interpreter
    preset=tiny device=cpu concurrency=(1 16) window=1 threads=2
    engines=(--kinds torch fused --precisions fp32)
else
    python=${PYTHON:-$([ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3)}
    dry_flag=()
    preset=paper device=cuda concurrency=(1 16 64) window=2 threads=4
    # the registry's GPU rows at each precision they serve (aoti: where the export compiled its packages)
    engines=(--kinds torch fused aoti --precisions fp32 bf16 fp16)
fi
# Compiles and the timed runs never share the cores: threads are set for each; inductor compiles on all of them.
cores=$(nproc)
export OMP_NUM_THREADS=$threads PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=$cores
echo "==> gpu_check: $([ $dry = 1 ] && echo 'CPU dry run' || echo GPU), budget ${budget} s, python $python, work $work"

# --- steps: each under `timeout`, recorded in steps.jsonl; the report is rewritten after every one ----------------
report() {
    (cd "$work" && timeout 60 "$python" "$repo/scripts/gpu_check_report.py" --work "$work" --out "$out") \
        || echo "==> report failed"
}
record() {  # step status seconds limit
    printf '{"step": "%s", "status": "%s", "seconds": %s, "limit": %s}\n' "$1" "$2" "$3" "$4" >> "$work/steps.jsonl"
}
step() {  # name limit command...: runs in $work (so the checkout's bare capsnet/ folder never shadows the package)
    local name=$1 limit=$2 left status t0 rc
    shift 2
    left=$((budget - (SECONDS - began) - 15))  # 15 s kept for the last report
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "==> $name: skipped, ${left} s of the budget left"
        record "$name" "skipped: no time left" 0 0
        return 1
    fi
    echo "==> $name (at most ${limit} s)"
    t0=$SECONDS
    (cd "$work" && timeout -k 5 "$limit" "$@")
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out" ;;
        *) status="failed (exit $rc)" ;;
    esac
    echo "==> $name: $status in $((SECONDS - t0)) s"
    record "$name" "$status" $((SECONDS - t0)) "$limit"
    report
    return $rc
}
# the step's commands (`timeout` runs programs, not shell functions)
check=("$python" -m capsnet.bench.gpu_check)
common=(--work "$work" --threads "$threads" "${dry_flag[@]}")
save_tail() {  # part-name log: the end of a step's output as a part of the report
    "$python" -c 'import json, sys; print(json.dumps({"tail": open(sys.argv[1]).read()[-3000:]}))' "$2" \
        > "$work/parts/$1.json" 2>/dev/null
}

# 1. install: each carried wheel whose module is missing here (--no-deps), then the project as a package tree
# shellcheck source=scripts/gpu_machine.sh
source "$repo/scripts/gpu_machine.sh"
install_project() {
    unpack_wheels "$python" "$repo" "$work/site" || return 1
    link_package_tree "$repo" "$work/pkg"
    # what the server, training and export import, from here (the checkout's bare capsnet/ would shadow the tree)
    cd "$work" && "$python" -c "import capsnet.serving.transports.server, capsnet.training.train, capsnet.export.exporter, aiohttp
import torch; print('capsnet', capsnet.__file__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
}
export PYTHONPATH="$work/pkg:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export python repo work
export -f install_project unpack_wheels link_package_tree
step install 90 bash -c install_project || { report; exit 1; }
step facts 40 "${check[@]}" facts "${common[@]}"
step peak 60 "${check[@]}" peak "${common[@]}"

# 2-3. train briefly on the GPU, export ONNX (the CUDA packages come after the timings: compiling loads every core)
step train 60 "$python" -m capsnet train --data embedded --preset $preset --epochs 1 --device $device --threads "$threads" \
    --seed 0 --out "$work/model.ckpt" --no-progress
step export 120 "$python" -m capsnet export "$work/model.ckpt" --out "$work/model" --reconstruction
step flops 30 "${check[@]}" flops "${common[@]}" --model "$work/model"

# 4-5. in process (the benchmark harness): the public formulation, the model eager and compiled, the registry's
# engines kind x precision; then served
step engines 200 "${check[@]}" engines "${common[@]}" --model "$work/model" "${engines[@]}"
step serve 100 "${check[@]}" serve "${common[@]}" --model "$work/model" --concurrency "${concurrency[@]}" --window "$window"
# 6. one-image requests against the bare grpc.aio floor (with and without the engine) and capsnet serve with 1 and N
# front-end processes (the fused engine in fp16 on the GPU), perf_analyzer where carried, else the project's load
# generator: OUT/front-end.md; one round (a whole host of its own does not drift as a shared 2-core one does)
front_end=(--seconds 1 --rounds 1 --concurrency "${concurrency[@]}" --model-dir "$work/model" --out "$out/front-end")
[ $dry = 1 ] || front_end+=(--gpu 0)
[ -x "$repo/.perf-analyzer/bin/perf_analyzer" ] && front_end+=(--perf-analyzer "$repo/.perf-analyzer/bin/perf_analyzer")
step front-end 180 "$python" "$repo/scripts/bench_front_end.py" "${front_end[@]}"

# the GPU tests, where pytest is there and time is left
if (cd "$work" && "$python" -c "import pytest") 2>/dev/null; then
    # on the CPU they skip, each with its reason
    # the GPU backends' tests, and the fused kernels' parity compiled for the GPU (on the CPU: the interpreter); not
    # the kernel report's, which reads the compiler's output on the CPU and needs no GPU time
    step tests 150 "$python" -m pytest -q -rs -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" \
        -k "not cuda_packages" "$repo/tests/serving/engine/test_serving_gpu_backends.py" "$repo/tests/runtime" \
        --ignore "$repo/tests/runtime/test_kernel_report.py" \
        > "$work/tests.log" 2>&1
    save_tail tests "$work/tests.log"
else
    record tests "skipped: pytest is not installed" 0 0
fi
report
echo "==> gpu_check done in $((SECONDS - began)) s: $out/gpu_check.md"
rm -rf "$work"
