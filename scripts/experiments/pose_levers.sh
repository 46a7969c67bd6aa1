#!/usr/bin/env bash
# The training levers that decide whether a model's poses show in its drawings (docs/experiments/README.md,
# "Poses that show"): each variant is trained on the embedded digits as the quickstart trains (bf16 autocast where
# the CPU has native bf16), timed, then measured by `capsnet eval --pose` on the test split. A variant already
# trained is only measured again. One JSON line per variant goes to OUT/levers.jsonl.
#
# Usage: scripts/experiments/pose_levers.sh OUT VARIANT...   (VARIANT: a name below; default: all of them)
# Run it under `nice -n 10` on a shared machine.
set -euo pipefail

out=${1:?usage: pose_levers.sh OUT [VARIANT...]}
shift
mkdir -p "$out"

declare -A VARIANTS=(
    # the paper's preset at capsnet train's defaults: batch 64, weight 0.0005, shifts of up to 2 pixels
    [paper-3]="--preset paper --epochs 3"
    [paper-3-rw5e-3-b32]="--preset paper --epochs 3 --reconstruction-weight 0.005 --batch-size 32"
    [paper-3-rw5e-3-b32-noshift]="--preset paper --epochs 3 --reconstruction-weight 0.005 --batch-size 32 --max-shift 0"
    # paper-pose: the paper's model, reconstruction weight 0.005, the decoder at 5x the learning rate (the quickstart's)
    [pose-3-b32-noshift]="--preset paper-pose --epochs 3 --batch-size 32 --max-shift 0"
    [half-10-rw5e-3]="--preset paper-half --epochs 10 --reconstruction-weight 0.005"
)
names=("$@")
if [ ${#names[@]} -eq 0 ]; then mapfile -t names < <(printf '%s\n' "${!VARIANTS[@]}" | sort); fi

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
for name in "${names[@]}"; do
    flags=${VARIANTS[$name]:?unknown variant $name}
    checkpoint=$out/$name.ckpt
    if [ ! -f "$checkpoint" ]; then
        start=$(date +%s.%N)
        load_before=$(cut -d' ' -f1-3 /proc/loadavg)
        # shellcheck disable=SC2086  # the flags are words
        capsnet train --data embedded $flags --amp --no-progress --out "$checkpoint" > "$out/$name.train.log" 2>&1
        seconds=$(python -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$start" "$(date +%s.%N)")
        printf '{"seconds": %s, "load_before": "%s", "load_after": "%s"}\n' "$seconds" "$load_before" \
            "$(cut -d' ' -f1-3 /proc/loadavg)" > "$out/$name.time.json"
    fi
    capsnet eval "$checkpoint" --pose --json --pose-out "$out/$name.pose.json" > "$out/$name.eval.json"
    python - "$name" "$flags" "$cpu" "$out" <<'EOF'
import json
import sys
from pathlib import Path

name, flags, cpu, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
evaluation = json.loads((out / f"{name}.eval.json").read_text())
timing = json.loads((out / f"{name}.time.json").read_text())
pose = evaluation["pose"]
line = {"variant": name, "flags": flags, "cpu": cpu, "train_seconds": timing["seconds"],
        "load": [timing["load_before"], timing["load_after"]], "test_accuracy": evaluation["accuracy"],
        "fidelity": pose["fidelity"], "visible_dimensions": pose["visible_dimensions"],
        "median_sensitivity": sorted(pose["sensitivity"])[len(pose["sensitivity"]) // 2]}
with open(out / "levers.jsonl", "a") as stream:
    stream.write(json.dumps(line) + "\n")
print(json.dumps(line))
EOF
done
