#!/usr/bin/env bash
# Four levers for the `paper` model on Fashion-MNIST (docs/experiments/README.md, "Levers not yet ranked"), two
# seeds each, all eight runs side by side on one GPU (fifty epochs: about 20 minutes on an H100 with --compile),
# then the choice on validation (scripts/experiments/summarize.py --choose).
# Usage: scripts/experiments/fashion_levers.sh [DATA_DIR] [OUT_DIR] [EPOCHS]
#   defaults: /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist), models/fashion-levers, 50
#   CAPSNET_DEVICE: cuda (default), cuda:N or cpu; CAPSNET_COMPILE: --compile (default) or empty;
#   CAPSNET_TRAIN_FLAGS: more flags, last (a dry run on a CPU: CAPSNET_DEVICE=cpu CAPSNET_COMPILE=
#   CAPSNET_TRAIN_FLAGS="--preset tiny --threads 1" scripts/experiments/fashion_levers.sh embedded /tmp/levers 1)
set -euo pipefail
data="${1:-/usr/share/datasets/fashion-mnist}"
out="${2:-models/fashion-levers}"
epochs="${3:-50}"
mkdir -p "$out"
common=(--data "$data" --val-fraction 0.08333 --epochs "$epochs" --batch-size 64 --lr 0.001 --hflip
        --routing leaky --preset paper --device "${CAPSNET_DEVICE:-cuda}" ${CAPSNET_COMPILE---compile} --no-progress)
declare -A levers=(
  [base]="--lr-decay 0.94 --max-shift 2"
  [shift4]="--lr-decay 0.94 --max-shift 4"
  [rec2]="--lr-decay 0.94 --max-shift 2 --reconstruction-weight 0.0002"
  [linear]="--lr-schedule linear --max-shift 2"
)
pids=()
for seed in 0 1; do
  for lever in base shift4 rec2 linear; do
    # shellcheck disable=SC2086  # the lever's flags are meant to split
    capsnet train "${common[@]}" ${levers[$lever]} --seed "$seed" ${CAPSNET_TRAIN_FLAGS:-} \
      --out "$out/$lever-seed$seed.ckpt" \
      >"$out/$lever-seed$seed.log" 2>&1 &
    pids+=("$!")
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [ "$failed" = 1 ]; then echo "fashion_levers.sh: a run failed; see $out/*.log" >&2; fi
python scripts/experiments/summarize.py --choose "$out"/*-seed[0-9].ckpt
exit "$failed"
