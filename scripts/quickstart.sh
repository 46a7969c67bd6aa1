#!/usr/bin/env bash
# Command 1 of the README: set up, get a model, serve it.
#   1. scripts/setup-env.sh: creates .venv (or uses $CAPSNET_VENV) and installs capsnet-serve into it, with the
#      bench and visualize extras the README's benchmark and pictures use (EXTRAS= for none);
#   2. deploy/prepare-model.sh: if the model folder has no exported model, trains the `paper-pose` preset briefly on
#      the embedded MNIST digits (progress bar) and exports it to ONNX; a re-run reuses the model;
#   3. writes a few sample digit PNGs, prints how to send a request, and runs `capsnet serve` in the
#      foreground (KServe v2 REST on 127.0.0.1:8000, gRPC on 127.0.0.1:8001, Prometheus metrics on 127.0.0.1:8002)
#      until Ctrl-C / SIGTERM.
#
# Usage: bash scripts/quickstart.sh [--model-dir DIR] [--preset paper-pose|paper|tiny] [--epochs N] [-- capsnet serve flags]
# Environment (the same knobs, for scripts and tests):
#   CAPSNET_MODEL_DIR  exported model folder (default models/quickstart in the repository)
#   CAPSNET_PRESET     model to train when there is none (default paper-pose)
#   CAPSNET_EPOCHS     training epochs (default 3)
#   CAPSNET_VENV       environment to create or reuse (default .venv in the repository)
#   CAPSNET_HOST, CAPSNET_HTTP_PORT, CAPSNET_GRPC_PORT, CAPSNET_METRICS_PORT   where `capsnet serve` listens
set -euo pipefail

quickstart_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model_dir=${CAPSNET_MODEL_DIR:-$quickstart_repo/models/quickstart}
serve_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --model-dir) model_dir=${2:?--model-dir needs a folder}; shift 2 ;;
        --preset) export CAPSNET_PRESET=${2:?--preset needs a name}; shift 2 ;;
        --epochs) export CAPSNET_EPOCHS=${2:?--epochs needs a number}; shift 2 ;;
        --) shift; serve_args=("$@"); break ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "quickstart.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
model_dir=${model_dir%/}

EXTRAS=${EXTRAS-bench,visualize}
# shellcheck source=scripts/setup-env.sh
source "$quickstart_repo/scripts/setup-env.sh"   # puts the environment's bin/ first on PATH

bash "$quickstart_repo/deploy/prepare-model.sh" "$model_dir"

# A few digits the model has not trained on (the embedded test split), to send as requests.
samples=$model_dir-samples
if [ ! -d "$samples" ]; then
    mkdir -p "$samples"
    python - "$samples" <<'EOF'
import sys
from pathlib import Path

from PIL import Image

from capsnet.training.data import load_embedded

test = load_embedded().test
for index in (0, 100, 200):
    Image.fromarray(test.images[index, 0]).save(Path(sys.argv[1]) / f"digit-{index}-label-{test.labels[index]}.png")
EOF
fi

host=${CAPSNET_HOST:-127.0.0.1}
grpc_port=${CAPSNET_GRPC_PORT:-8001}
http_port=${CAPSNET_HTTP_PORT:-8000}
metrics_port=${CAPSNET_METRICS_PORT:-8002}
# Clients dial loopback when the server listens on every interface.
client_host=$host
if [ "$host" = 0.0.0.0 ]; then client_host=127.0.0.1; fi
venv_bin=${CAPSNET_VENV:-$quickstart_repo/.venv}/bin
sample=$(find "$samples" -name '*.png' | sort | head -n 1)
cat <<EOF

==> serving $model_dir on $host:$grpc_port (gRPC) and $host:$http_port (REST); metrics: http://$client_host:$metrics_port/metrics; Ctrl-C stops it.
    In another terminal (after: source $venv_bin/activate):
      capsnet predict $sample --server $client_host:$grpc_port
      curl -s http://$client_host:$metrics_port/metrics | grep ^capsnet_requests_total
    KServe v2 over REST (tritonclient.http works too):
      curl -s http://$client_host:$http_port/v2/models/capsnet
    With grpcurl (the server has reflection):
      grpcurl -plaintext $client_host:$grpc_port list
      grpcurl -plaintext $client_host:$grpc_port grpc.health.v1.Health/Check

EOF
exec capsnet serve --model "$model_dir" "${serve_args[@]}"
