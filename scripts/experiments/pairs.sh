#!/usr/bin/env bash
# The pairs test of docs/experiments/pairs.md: the any-size capsule model (`shared`) and its CNN baseline (`gap-cnn`)
# trained on single MNIST digits at the same budget over three seeds, each chosen on the validation split, then
# scored on single test digits and on pairs of different test digits side by side (28x56); then the summary.
# Usage: scripts/experiments/pairs.sh MNIST_DIR [EPOCHS] [OUT_DIR]   (defaults: 3, models/pairs)
# Runs that already have their last checkpoint, and scores already written, are skipped, so the script can be
# stopped and restarted, and run again with more EPOCHS to train the same runs on (the learning rate decays per
# epoch, so a resumed run follows the schedule of a longer one). Two runs go side by side with one thread each, the
# next starting as soon as one ends (on a shared 2-core machine that trained faster than one run on two threads).
set -euo pipefail
data="${1:?usage: scripts/experiments/pairs.sh MNIST_DIR [EPOCHS] [OUT_DIR]}"
epochs="${2:-3}"
out="${3:-models/pairs}"
mkdir -p "$out"
train() {  # train PRESET SEED: from the start, or on to EPOCHS from a run that trained fewer (its scores redone)
  local run="$out/$1-seed$2"
  if [[ -f "$run.last.ckpt" ]]; then
    (( $(python -c 'import sys; from capsnet.models.checkpoint import load_checkpoint as load
print(load(sys.argv[1]).epoch)' "$run.last.ckpt") < epochs )) || return 0
    rm -f "$run.pairs.json"
    nice -n 10 capsnet train --resume "$run.last.ckpt" --data "$data" --epochs "$epochs" --threads 1 --no-progress \
      --out "$run.ckpt" >> "$run.log"
    return
  fi
  nice -n 10 capsnet train --data "$data" --preset "$1" --epochs "$epochs" --batch-size 128 --seed "$2" \
    --threads 1 --no-progress --out "$run.ckpt" > "$run.log"
}
export -f train
export data epochs out
for seed in 0 1 2; do printf 'shared %s\ngap-cnn %s\n' "$seed" "$seed"; done | xargs -P 2 -L 1 bash -c 'train "$@"' _
for run in "$out"/*-seed?.ckpt; do
  scores="${run%.ckpt}.pairs.json"
  [[ -f "$scores" ]] || OMP_NUM_THREADS=2 nice -n 10 capsnet eval "$run" --data "$data" --pairs side-by-side --json \
    > "$scores"
done
python scripts/experiments/pairs_summary.py "$out" docs/experiments
