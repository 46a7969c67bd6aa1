#!/usr/bin/env bash
# Command 2 of the README: set up everything the tests need, then run the whole suite.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# System tools the tests drive for real: Prometheus (scrapes the server), nginx (gRPC load balancer),
# Chromium (the page at / of the REST port, driven by Playwright from the dev extra, which downloads no browser)
# and Fashion-MNIST IDX files (the real IDX loader test).
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v nginx >/dev/null || missing+=(nginx-light)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "==> apt-get install ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "==> not root: tests needing ${missing[*]} will be skipped"
    fi
fi
# otel too: the tracing tests export spans through the real OpenTelemetry SDK
EXTRAS=dev,otel source scripts/setup-env.sh
# Two workers (pytest-xdist); a file's tests stay on one worker, so its module fixtures (a server, a benchmark run)
# are made once. `-n 0` as an argument runs everything in this process.
exec python -m pytest -n 2 --dist loadfile -ra "$@"
