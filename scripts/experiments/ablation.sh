#!/usr/bin/env bash
# The routing ablation of docs/experiments/README.md: six dynamic-routing configurations x three seeds,
# `paper` preset on the embedded MNIST, the same epoch budget for every run; then the summary table.
# Usage: scripts/experiments/ablation.sh [EPOCHS] [OUT_DIR]   (defaults: 1, models/ablation)
# Runs that already have their last checkpoint are skipped, so the script can be stopped and restarted.
set -euo pipefail
epochs="${1:-1}"
out="${2:-models/ablation}"
mkdir -p "$out"
declare -A variants=(
  [baseline]=""
  [iterations-1]="--routing-iterations 1"
  [no-reconstruction]="--reconstruction-weight 0"
  [leaky]="--routing leaky"
  [su]="--routing su"
  [squash-0.5]="--squash-constant 0.5"
)
for seed in 0 1 2; do
  for name in baseline iterations-1 no-reconstruction leaky su squash-0.5; do
    ckpt="$out/$name-seed$seed.ckpt"
    [[ -f "$out/$name-seed$seed.last.ckpt" ]] && continue
    # shellcheck disable=SC2086  # the variant's flags are meant to split
    nice -n 10 capsnet train --data embedded --preset paper --epochs "$epochs" --batch-size 64 --amp \
      --seed "$seed" --threads 1 --no-progress --out "$ckpt" ${variants[$name]}
  done
done
python scripts/experiments/summarize.py "$out"/*.last.ckpt
