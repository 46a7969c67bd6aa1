"""Helpers for the deployment tests: external tools, free ports, bounded waits for the processes the tests
start, and the repository's deploy/ files (read as they are, or through deploy/local_stack.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_CONF = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "capsnet-serve.json"
# What Grafana puts in place of its variables when the dashboard runs against Prometheus: 1m spans enough
# scrapes for rate() at any scrape interval the configs here use; every replica for $instance.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".+"}


def tool(name: str, why: str) -> str:
    """Path of an external tool: the venv's bin (dev extras such as hadolint) first, then PATH; skip if absent."""
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.is_file() and os.access(venv_bin, os.X_OK):
        return str(venv_bin)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({why})")
    return found


def run_tool(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a validator; the assertion message carries its output, which says what is wrong."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], object], timeout: float, interval: float = 0.25,
             alive: subprocess.Popen | None = None, log: Path | None = None):
    """Poll `check` until it returns something truthy, at most `timeout` seconds; fail early if `alive` exits."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            pytest.fail(f"exited with {alive.returncode} while waiting for {what}{log_tail(log)}")
        try:
            value = check()
            if value:
                return value
        except Exception as err:  # not up yet: connection refused, partial answers
            last_error = err
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error!r}){log_tail(log)}")


def log_tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.is_file():
        return ""
    return f"\n--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-chars:]}"


@contextmanager
def running(args: list[str], log: Path, env: dict | None = None,
            stop_timeout: float = 20) -> Iterator[subprocess.Popen]:
    """Start a process in its own session (output to `log`); on exit SIGTERM it, then SIGKILL if it lingers."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=REPO, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def http_json(url: str, timeout: float = 5) -> dict:
    return json.loads(http_get(url, timeout))


def scrape(metrics_address: str) -> list:
    """Every sample on a server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"http://{metrics_address}/metrics")
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def requests_total(samples: list, api: str, method: str, code: str) -> float:
    return sum(s.value for s in samples if s.name == "capsnet_requests_total"
               and (s.labels.get("api"), s.labels.get("method"), s.labels.get("code")) == (api, method, code))


# --- deploy/ files -------------------------------------------------------------------------------------------

def _load_local_stack():
    """deploy/local_stack.py (a script, not a package module): the tests build their nginx and Prometheus
    configs with the same functions that run the topology natively."""
    spec = importlib.util.spec_from_file_location("capsnet_local_stack", DEPLOY / "local_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


local_stack = _load_local_stack()


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel of the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in as Grafana would."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Series names a query reads (ours start with capsnet_, the GPUs' with Triton's nv_)."""
    return set(re.findall(r"\b((?:capsnet|nv)_[A-Za-z0-9_]+)\b", expr))


def label_names(expr: str) -> set[str]:
    """Label names a query groups by or matches on, less those Prometheus adds (instance, job) and `le`."""
    names: set[str] = set()
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        names |= {name.strip() for name in group.split(",") if name.strip()}
    for selector in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    return names - {"instance", "job", "le"}


class _OneGpu:
    """A GPU reader (serving/observability/gpu_metrics.py's GpuReader) of one GPU reporting every figure."""

    def read(self):
        from capsnet.serving.observability.gpu_metrics import GpuReading

        return [GpuReading("GPU-00000000-0000-0000-0000-000000000000", utilization=0.5, memory_used_bytes=2**30,
                           memory_total_bytes=2**34, power_usage_watts=100.0, power_limit_watts=700.0,
                           energy_joules=1.0)]


def gpu_only_series() -> dict[str, set[str]]:
    """Series name -> label names of what a server exports only while a model serves on a GPU (so no replica of the
    CPU stack has it), as the server's own code registers it: the model's GPU time per batch, and the NVML
    collector's families read from a GPU that reports every figure."""
    from capsnet.serving.observability.gpu_metrics import GpuCollector
    from capsnet.serving.observability.metrics import Metrics

    metrics = Metrics(max_batch_size=8)
    without = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    metrics.gpu_compute().labels("capsnet", "1").observe(0.001)
    metrics.registry.register(GpuCollector(_OneGpu()))
    labels_of: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name not in without:
                labels_of.setdefault(sample.name, set()).update(sample.labels)
    return labels_of
