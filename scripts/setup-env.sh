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
# pip reinstalls an editable package even when nothing changed, and while it does, other processes using this
# environment cannot import it; a stamp of what was installed (pyproject.toml, the extras, this checkout) skips it.
stamp="$venv/.capsnet-serve-installed"
project=$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)
installed_extras=$(awk -v project="$project" '$1 == project { print $2 }' "$stamp" 2>/dev/null || true)
missing_extras=$(comm -23 <(tr ',' '\n' <<<"${EXTRAS:-}" | sed '/^$/d' | sort -u) \
                          <(tr ',' '\n' <<<"${installed_extras#-}" | sed '/^$/d' | sort -u))
origin=$("$venv/bin/python" -c "import importlib.util as u; print(u.find_spec('capsnet').origin)" 2>/dev/null || true)
if [ -z "$installed_extras" ] || [ -n "$missing_extras" ] || [ "$origin" != "$repo/capsnet/__init__.py" ]; then
    echo "==> installing capsnet-serve${EXTRAS:+[$EXTRAS]}"
    pip install -e "$repo${EXTRAS:+[$EXTRAS]}"
    all_extras=$(tr ',' '\n' <<<"${installed_extras#-},${EXTRAS:-}" | sed '/^$/d' | sort -u | paste -sd, -)
    echo "$project -$all_extras" > "$stamp"
else
    echo "==> capsnet-serve${EXTRAS:+[$EXTRAS]} is installed from this checkout"
fi
export PATH="$venv/bin:$PATH"
