#!/usr/bin/env bash
# Creates .venv (if missing) and installs capsnet-serve into it. Sourced by quickstart.sh and test.sh.
# EXTRAS selects pip extras, e.g. EXTRAS=dev.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${CAPSNET_VENV:-$repo/.venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv"
    "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "==> installing torch (CPU build)"
    pip install "torch==2.13.0" || pip install "torch>=2.11,<2.14" --index-url https://download.pytorch.org/whl/cpu
fi
echo "==> installing capsnet-serve${EXTRAS:+[$EXTRAS]}"
pip install -e "$repo${EXTRAS:+[$EXTRAS]}"
export PATH="$venv/bin:$PATH"
