#!/usr/bin/env bash
# Runs both DDP test files RUNS times in a row (default 200) while a busy loop keeps one core occupied, and counts
# the runs that failed: a rank that aborts at exit (SIGABRT, -6) instead of exiting with its own code fails its test
# there. A failing run's pytest output is kept as OUT/failed-N.txt; OUT/runs.txt has a line per run.
# BUSY, if set, is a command of one thread to occupy that core with useful work first (a training run, say);
# the busy loop takes over when it ends.
#
#   bash scripts/ddp_exit_loop.sh OUT [RUNS]
#   BUSY="capsnet train --threads 1 ..." bash scripts/ddp_exit_loop.sh OUT [RUNS]
set -euo pipefail

out=${1:?usage: bash scripts/ddp_exit_loop.sh OUT [RUNS]}
runs=${2:-200}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
mkdir -p "$out"

# the other core kept busy, as CI's neighbours and a test run's own workers do
# in a session of its own, so that the trap ends BUSY's processes too
setsid bash -c "${BUSY:-true}; exec python3 -c 'while True: pass'" > "$out/busy.txt" 2>&1 &
busy=$!
trap 'kill -- -$busy 2>/dev/null' EXIT

failed=0
for run in $(seq 1 "$runs"); do
    if (cd "$repo" && "$python" -m pytest -q -p no:randomly tests/training/test_training_ddp.py \
            tests/training/test_training_ddp_failures.py) > "$out/run.txt" 2>&1; then
        status=passed
    else
        status=failed
        failed=$((failed + 1))
        cp "$out/run.txt" "$out/failed-$run.txt"
    fi
    echo "$run $(date +%T) $status: $(tail -n 1 "$out/run.txt")" | tee -a "$out/runs.txt"
done
echo "$failed of $runs runs failed" | tee -a "$out/runs.txt"
[ "$failed" -eq 0 ]
