"""`capsnet serve` as a child process on loopback: started, waited for, measured, stopped."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from capsnet.bench.memory import memory_mib
from capsnet.errors import CapsNetError

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
_READY = re.compile(r"capsnet serve: ready: .* grpc://(?P<host>[^:\s]+):(?P<port>\d+) metrics (?P<metrics>\S+)")


class ServerProcess:
    """`with ServerProcess([...serve flags]) as server:` -> server.target ("127.0.0.1:PORT"), .memory(), .scrape()."""

    def __init__(self, flags: list[str]):
        self.command = [sys.executable, "-m", "capsnet", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
                        "--grpc-port", "0", "--metrics-port", "0", *flags]
        self.target: str | None = None
        self.metrics_url: str | None = None
        self._process: subprocess.Popen | None = None
        self._output: list[str] = []

    def __enter__(self) -> "ServerProcess":
        self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        threading.Thread(target=self._read_output, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.1):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._stop()
                tail = " | ".join(self._output[-3:]) or "no output"
                raise CapsNetError(f"capsnet serve did not become ready (exit code {self._process.returncode}): {tail}")
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    @property
    def pid(self) -> int:
        return self._process.pid

    def memory(self) -> dict[str, float]:
        """The server's RSS now and its peak since it started, in MiB."""
        return memory_mib(self._process.pid)

    def scrape(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over their labels: name -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "le" not in sample.labels and "quantile" not in sample.labels:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def _read_output(self, ready: threading.Event) -> None:
        for line in self._process.stdout:
            self._output.append(line.rstrip())
            match = _READY.search(line)
            if match:
                self.target = f"{match['host']}:{match['port']}"
                self.metrics_url = match["metrics"]
                ready.set()

    def _stop(self) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
