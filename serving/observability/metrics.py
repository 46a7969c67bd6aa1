"""Prometheus metrics of the server, in their own registry, served over HTTP on the metrics port.

Request counts and latencies are recorded for every RPC by the gRPC interceptor (`serving/transports/interceptor.py`:
our API, KServe, health and reflection alike) and for every REST request by its middleware
(`serving/transports/kserve_http.py`), through `serving/observability/observe.py`; queue wait, compute time, batch sizes
and images inside each model version's batcher; the model's GPU time per batch, and the GPUs' own metrics under Triton's
names (`serving/observability/gpu_metrics.py`), registered only once a version serves on a GPU. Request and batch series
carry the `model` and `version` that served them, names of the model repository (never a client's text), and a version's
batch series go when it is unloaded. /metrics is prometheus-client's WSGI app behind a server with a few threads, socket
timeouts and a deadline per connection, so idle or slow connections can neither pile up threads nor hold them; it is
meant for Prometheus on a private network, never for the internet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import wsgiref.simple_server
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, make_wsgi_app)
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

# Where the processes of one server write their series (prometheus-client's multiprocess mode): set by
# serving/processes/supervisor.py for its engine and front-end processes, before they import prometheus-client.
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
# 100 µs (a tiny model's batch on a GPU) to 10 s (a deep queue on a CPU), about 2.5x apart.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)
# /metrics: connections served at once (a scrape takes about a millisecond; more connections are closed at
# once), and how long one may stay silent (its request unsent, or its answer unread) before it is closed.
HTTP_WORKERS = 8
HTTP_TIMEOUT_S = 3.0
# How long a connection may last in all, however it trickles bytes (Prometheus' default scrape timeout).
HTTP_DEADLINE_S = 10.0


class Metrics:
    def __init__(self, max_batch_size: int):
        disable_created_metrics()  # no *_created series: Prometheus does not use them, they double the exposition
        self.registry = registry = CollectorRegistry()
        if MULTIPROCESS_DIR in os.environ:
            # One server in several processes (serving/processes/supervisor.py): each writes its series to files there,
            # which prometheus-client's MultiProcessCollector sums into the one /metrics its engine process serves.
            # process_* and python_* describe one process each, so they are not exported then.
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
        else:
            self.exposed = registry
            # process_* (CPU, memory, file descriptors), python_info and python_gc_* of this process
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        # `model` and `version` label what a request was served by: a model of the repository, never a client's
        # text ("" for a request that named none the server has, and for calls that are not for a model).
        self.requests = Counter("capsnet_requests", "Requests finished (gRPC calls, REST requests), by API, method, "
                                "gRPC status code, and the model version that served them",
                                ["api", "method", "code", "model", "version"], registry=registry)
        self.request_duration = Histogram("capsnet_request_duration_seconds",
                                          "Time from receiving an RPC or REST request to its end (a stream: its "
                                          "whole life)",
                                          ["api", "method", "model", "version"], buckets=LATENCY_BUCKETS,
                                          registry=registry)
        self.inflight = Gauge("capsnet_inflight_requests",
                              "Requests being handled: unary RPCs, REST requests, and a stream's requests from "
                              "arrival to answer (health checks and reflection aside)", registry=registry,
                              multiprocess_mode="livesum")
        version = ["model", "version"]
        self.queue_wait = Histogram("capsnet_queue_wait_seconds",
                                    "Time a request waited in the batch queue before its first backend run",
                                    version, buckets=LATENCY_BUCKETS, registry=registry)
        self.compute = Histogram("capsnet_compute_seconds", "Time of one backend run (one batch)", version,
                                 buckets=LATENCY_BUCKETS, registry=registry)
        batch_buckets = sorted({2 ** i for i in range(max_batch_size.bit_length())} | {max_batch_size})
        self.batch_size = Histogram("capsnet_batch_size", "Images per backend run", version,
                                    buckets=batch_buckets, registry=registry)
        self.images = Counter("capsnet_images", "Images inferred", version, registry=registry)
        self.queue_depth = Gauge("capsnet_queue_depth", "Requests waiting in the batch queue", version,
                                 registry=registry, multiprocess_mode="livesum")
        self.dropped = Counter("capsnet_dropped_requests",
                               "Requests that left the queue without being computed, by reason",
                               [*version, "reason"], registry=registry)
        self.model_info = Gauge("capsnet_model_info", "A model version being served (value 1)",
                                ["model", "version", "backend", "precision", "routing_iterations"], registry=registry,
                                multiprocess_mode="livemax")
        self.self_check_agreement = Gauge(
            "capsnet_self_check_argmax_agreement_ratio",
            "Share of the export's reference images the served backend gives the FP32 reference's class (at load)",
            version, registry=registry, multiprocess_mode="livemax")
        self.self_check_diff = Gauge(
            "capsnet_self_check_max_abs_diff", "Largest difference from the FP32 reference outputs at load, by output",
            [*version, "output"], registry=registry, multiprocess_mode="livemax")
        self.model_loads = Counter("capsnet_model_loads",
                                   "Loads of a model version: loaded (self-checked, warmed up, serving) or refused "
                                   "(unreadable or altered files, a failed self-check)",
                                   [*version, "outcome"], registry=registry)
        # registered by the first version that needs them, so a server on the CPU exports neither
        self._gpu_compute: Histogram | None = None
        self._gpus_watched = False

    def gpu_compute(self) -> Histogram:
        """capsnet_gpu_compute_seconds, registered on first use (a version whose backend times its GPU work)."""
        if self._gpu_compute is None:
            self._gpu_compute = Histogram(
                "capsnet_gpu_compute_seconds",
                "GPU time of the model's work in one backend run (one batch), measured on the device with CUDA events "
                "(the copies in and out aside)", ["model", "version"], buckets=LATENCY_BUCKETS, registry=self.registry)
        return self._gpu_compute

    def watch_gpus(self) -> None:
        """A version serves on a GPU: the nv_gpu_* families of the GPUs CUDA sees, read from NVML at each scrape;
        once. Where NVML cannot be read they stay absent, and the log says why."""
        if self._gpus_watched:
            return
        self._gpus_watched = True
        from capsnet.serving.observability.gpu_metrics import GpuCollector, open_nvml

        reader, what = open_nvml(os.environ)
        if reader is None:
            log.warning("no GPU metrics (nv_gpu_*) on /metrics: %s", what)
            return
        self.exposed.register(GpuCollector(reader))
        log.info("GPU metrics (nv_gpu_*) on /metrics for %s", what)

    def for_version(self, model: str, version: str) -> "VersionMetrics":
        return VersionMetrics(self, model, version)

    def serve_http(self, host: str, port: int) -> "MetricsHTTPServer":
        """Start /metrics on a daemon thread; returns the HTTP server (its bound port: server.server_port)."""
        httpd = MetricsHTTPServer((host, port), make_wsgi_app(self.exposed))
        threading.Thread(target=httpd.serve_forever, daemon=True, name="capsnet-metrics-accept").start()
        return httpd


DROP_REASONS = ("deadline", "cancelled")


class VersionMetrics:
    """The series of one model version (its batcher's, its self-check's), removed when it is unloaded: what is
    exported stays bounded by the versions being served."""

    def __init__(self, metrics: Metrics, model: str, version: str):
        self._metrics = metrics
        self.labels = (model, version)
        self.queue_wait = metrics.queue_wait.labels(*self.labels)
        self.compute = metrics.compute.labels(*self.labels)
        self.batch_size = metrics.batch_size.labels(*self.labels)
        self.images = metrics.images.labels(*self.labels)
        self.queue_depth = metrics.queue_depth.labels(*self.labels)
        self.dropped = {reason: metrics.dropped.labels(*self.labels, reason) for reason in DROP_REASONS}
        self.gpu_compute: Histogram | None = None  # its backend's GPU time per run, where the backend measures it
        self._info: tuple[str, ...] | None = None
        self._outputs: tuple[str, ...] = ()

    def record_serving(self, spec, on_gpu: bool, gpu_timed: bool) -> None:
        """The version serves: its model_info and self-check series, and where its backend runs in this process on a
        GPU, the GPUs' series (`on_gpu`) and its GPU time's (`gpu_timed`: the backend measures it)."""
        metrics, check = self._metrics, spec.self_check
        if on_gpu:
            metrics.watch_gpus()
        if gpu_timed:
            self.gpu_compute = metrics.gpu_compute().labels(*self.labels)
        self._info = (*self.labels, spec.backend, spec.precision, str(spec.routing.get("iterations", "")))
        metrics.model_info.labels(*self._info).set(1)
        metrics.self_check_agreement.labels(*self.labels).set(check.argmax_agreement)
        self._outputs = tuple(check.max_abs_diff)
        for output, diff in check.max_abs_diff.items():
            metrics.self_check_diff.labels(*self.labels, output).set(diff)

    def remove(self) -> None:
        """The version is unloaded: its series go (load counts stay: they count the model's history)."""
        metrics = self._metrics
        for family in (metrics.queue_wait, metrics.compute, metrics.batch_size, metrics.images, metrics.queue_depth,
                       metrics.self_check_agreement):
            _remove(family, self.labels)
        for reason in DROP_REASONS:
            _remove(metrics.dropped, (*self.labels, reason))
        for output in self._outputs:
            _remove(metrics.self_check_diff, (*self.labels, output))
        if self._info is not None:
            _remove(metrics.model_info, self._info)
        if self.gpu_compute is not None:
            _remove(metrics.gpu_compute(), self.labels)


def _remove(family, labels: tuple[str, ...]) -> None:
    if MULTIPROCESS_DIR in os.environ:  # series cannot leave the shared files; versions only leave at shutdown there
        return
    with contextlib.suppress(KeyError):  # never set: nothing to remove
        family.remove(*labels)


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # socketserver sets it on each connection: a silent client is dropped

    def log_message(self, format, *args) -> None:  # a scrape every few seconds: no access log
        pass


class MetricsHTTPServer(wsgiref.simple_server.WSGIServer):
    """At most HTTP_WORKERS connections are served at once, each for at most HTTP_TIMEOUT_S of silence and
    HTTP_DEADLINE_S in all; a connection beyond them is closed at once, so neither threads nor sockets pile up."""

    request_queue_size = 64  # the listen backlog: connections the kernel completes before they are accepted

    def __init__(self, address: tuple[str, int], app):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # before binding: a port in use makes socketserver call server_close(), which shuts the pool down
        self._workers = threading.BoundedSemaphore(HTTP_WORKERS)
        self._pool = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="capsnet-metrics")
        self._deadlines: dict[socket.socket, float] = {}  # connection -> time.monotonic() it is cut at
        self._deadlines_lock = threading.Lock()
        super().__init__(address, _QuietHandler)
        self.set_app(app)

    def process_request(self, request, client_address) -> None:
        if not self._workers.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self._deadlines_lock:
            self._deadlines[request] = time.monotonic() + HTTP_DEADLINE_S
        self._pool.submit(self._serve, request, client_address)

    def service_actions(self) -> None:
        """serve_forever() calls this between polls (every 0.5 s): cut the connections past their deadline, so a
        client trickling a byte every few seconds cannot hold a worker."""
        now = time.monotonic()
        with self._deadlines_lock:
            late = [request for request, deadline in self._deadlines.items() if deadline < now]
        for request in late:
            with contextlib.suppress(OSError):  # already closed by its worker
                request.shutdown(socket.SHUT_RDWR)

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:  # timed out or reset by the client: nothing to answer
            pass
        except Exception:
            log.exception("/metrics failed for %s", client_address[0])
        finally:
            with self._deadlines_lock:
                del self._deadlines[request]
            self.shutdown_request(request)
            self._workers.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


