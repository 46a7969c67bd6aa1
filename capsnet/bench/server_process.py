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
from capsnet.children import terminate_with_parent
from capsnet.errors import CapsNetError

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
_READY = re.compile(r"capsnet serve: ready: .* grpc://(?P<host>[^:\s]+):(?P<port>\d+) metrics (?P<metrics>\S+)"
                    r"(?: rest http://(?P<rest>\S+))?")


class ServerProcess:
    """`with ServerProcess([...serve flags]) as server:` -> server.target ("127.0.0.1:PORT"), .memory(), .scrape()."""

    def __init__(self, flags: list[str]):
        self.command = [sys.executable, "-m", "capsnet", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
                        "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", *flags]
        self.target = ""  # HOST:PORT of gRPC, from the ready line
        self.rest_target: str | None = None  # HOST:PORT of KServe REST
        self.metrics_url: str | None = None
        self._started: subprocess.Popen[str] | None = None
        self._output: list[str] = []

    @property
    def _process(self) -> subprocess.Popen[str]:
        assert self._started is not None, "used outside its `with`"
        return self._started

    def __enter__(self) -> "ServerProcess":
        # Its own session: a Ctrl-C in the terminal reaches only `capsnet bench`, which then stops the server in
        # order (SIGTERM, wait) instead of the server draining on its own while the bench still sends to it. A
        # bench that is killed outright cannot stop it: the kernel sends it SIGTERM then.
        self._started = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True, preexec_fn=terminate_with_parent())
        ready = threading.Event()
        threading.Thread(target=self._read_output, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not ready.wait(0.1):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._stop()
                    tail = " | ".join(self._output[-3:]) or "no output"
                    raise CapsNetError(f"capsnet serve did not become ready (exit code {self._process.returncode}): "
                                       f"{tail}")
        except BaseException:  # Ctrl-C meanwhile too: `with` calls no __exit__ when __enter__ raises
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> int:
        """SIGTERM, as a process manager stops a server, then its exit code once it has drained (killed after
        STOP_TIMEOUT_S)."""
        self._stop()
        return self._process.returncode

    def memory(self) -> dict[str, float]:
        """The server's RSS now and its peak since it started, in MiB."""
        return memory_mib(self._process.pid)

    def check_alive(self) -> None:
        """A one-line error (CapsNetError) when the server has exited, with the end of its output."""
        code = self._process.poll()
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            tail = " | ".join(self._output[-3:]) or "no output"
            raise CapsNetError(f"capsnet serve exited during the benchmark ({how}): {tail}")

    def scrape(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over their labels: name -> value."""
        self.check_alive()
        assert self.metrics_url is not None  # read from the ready line
        try:
            return scrape(self.metrics_url)
        except OSError as err:  # URLError, a reset or a timeout: the server died or hangs
            self.check_alive()
            raise CapsNetError(f"cannot read the server's metrics at {self.metrics_url}: "
                               f"{getattr(err, 'reason', err)}") from None

    def _read_output(self, ready: threading.Event) -> None:
        assert self._process.stdout is not None  # a pipe
        for line in self._process.stdout:
            self._output.append(line.rstrip())
            match = _READY.search(line)
            if match:
                self.target = f"{match['host']}:{match['port']}"
                self.metrics_url = match["metrics"]
                self.rest_target = match["rest"]
                ready.set()

    def _stop(self) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            except BaseException:  # a second Ctrl-C while it drains: it is in its own session, so kill it here
                self._process.kill()
                self._process.wait()
                raise


def scrape(metrics_url: str) -> dict[str, float]:
    """A server's Prometheus samples at `metrics_url`, each summed over its labels (a histogram's _sum and _count over
    models and versions; its buckets and a summary's quantiles left out): name -> value. OSError where it cannot be
    read."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels and "quantile" not in sample.labels:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
