#!/usr/bin/env bash
# Makes sure an exported model exists in MODEL_DIR, training and exporting only what is missing:
#   - MODEL_DIR/model.json exists        -> nothing to do (re-runs reuse the model; an older format is exported again)
#   - the checkpoint exists              -> export it
#   - neither                            -> train briefly on the embedded MNIST digits, then export
# Shared by scripts/quickstart.sh and the container images (docker-compose's model-init service, the GPU
# service's TensorRT build), so the quickstart's test exercises the same steps the containers run.
#
# Usage: prepare-model.sh MODEL_DIR [capsnet export flags, e.g. --triton DIR or --tensorrt]
# Environment:
#   CAPSNET_PRESET      model to train: paper-pose (default: the paper's model with a decoder that learns in a short
#                       run), paper or tiny
#   CAPSNET_EPOCHS      training epochs (default 3)
#   CAPSNET_CHECKPOINT  checkpoint to export, trained there if missing (default MODEL_DIR.ckpt)
#   CAPSNET_PROGRESS    0 hides the training progress bar (default 1)
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 MODEL_DIR [capsnet export flags]" >&2
    exit 2
fi
model_dir=${1%/}
shift
checkpoint=${CAPSNET_CHECKPOINT:-$model_dir.ckpt}
preset=${CAPSNET_PRESET:-paper-pose}
epochs=${CAPSNET_EPOCHS:-3}

if [ -f "$model_dir/model.json" ]; then
    if python -c "import sys; from capsnet.model_description.schema import ModelDescription; ModelDescription.read(sys.argv[1])" \
            "$model_dir" 2>/dev/null; then
        echo "==> reusing the model in $model_dir (delete it to train and export again)"
        exit 0
    fi
    echo "==> $model_dir was written by an older capsnet export; exporting again"
fi

if [ ! -f "$checkpoint" ]; then
    echo "==> training the '$preset' preset for $epochs epoch(s) on the embedded MNIST digits -> $checkpoint"
    progress=()
    [ "${CAPSNET_PROGRESS:-1}" = 0 ] && progress=(--no-progress)
    mkdir -p "$(dirname "$checkpoint")"
    start=$SECONDS
    # --amp: bf16 autocast where the CPU has native bf16 (~1.5x faster, same accuracy); fp32 elsewhere (docs/training.md).
    # Batches of 32 and no random shifts: in 3 epochs they gave higher accuracy and a decoder that draws the digit
    # rather than its class's template (docs/experiments/README.md, "Poses that show").
    capsnet train --data embedded --preset "$preset" --epochs "$epochs" --batch-size 32 --max-shift 0 --amp \
        --out "$checkpoint" "${progress[@]}"
    # The last epoch, not the one chosen on the 400 validation digits: in so short a run the decoder still draws
    # better every epoch, while the validation accuracy moves by a digit or two (docs/experiments/README.md).
    name=$(basename "$checkpoint")
    mv "$(dirname "$checkpoint")/${name%.*}.last.ckpt" "$checkpoint"   # capsnet train's name for the last epoch
    echo "==> trained in $((SECONDS - start)) s"
fi

echo "==> exporting $checkpoint -> $model_dir"
# --int8 too: `capsnet serve --precision auto` (the default) serves it where it passes its self-check and is faster.
# A model whose INT8 fails the export's accuracy gate is still served, in FP32. --reconstruction: the decoder too,
# served beside the model, which the page at / redraws moved poses with (docs/serving.md, "The page at /").
if ! capsnet export "$checkpoint" --out "$model_dir" --reconstruction --int8 "$@"; then
    echo "==> exporting again without --int8 (see the error above): the server will run FP32"
    capsnet export "$checkpoint" --out "$model_dir" --reconstruction "$@"
fi
