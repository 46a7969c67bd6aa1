"""Prometheus metrics of the server, in their own registry, served over HTTP on the metrics port.

Request counts and latencies are recorded for every RPC by a gRPC interceptor (our API, KServe,
health and reflection alike); queue wait, compute time, batch sizes and images inside the batcher.
"""

from __future__ import annotations

import inspect
import time

import grpc
from prometheus_client import (
    GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram,
    disable_created_metrics, start_http_server,
)

# 100 µs (a tiny model's batch on a GPU) to 10 s (a deep queue on a CPU), about 2.5x apart.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# short `api` label values of the services the server hosts
API_NAMES = {
    "capsnet.v1.CapsNetService": "capsnet",
    "inference.GRPCInferenceService": "kserve",
    "grpc.health.v1.Health": "health",
    "grpc.reflection.v1alpha.ServerReflection": "reflection",
}


class Metrics:
    def __init__(self, max_batch_size: int):
        disable_created_metrics()  # no *_created series: Prometheus does not use them, they double the exposition
        self.registry = registry = CollectorRegistry()
        # process_* (CPU, memory, file descriptors), python_info and python_gc_* of this process
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        self.requests = Counter("capsnet_requests", "gRPC requests finished, by API, method and status code",
                                ["api", "method", "code"], registry=registry)
        self.request_duration = Histogram("capsnet_request_duration_seconds",
                                          "Time from receiving an RPC to its end (a stream: its whole life)",
                                          ["api", "method"], buckets=LATENCY_BUCKETS, registry=registry)
        self.inflight = Gauge("capsnet_inflight_requests", "RPCs being handled", registry=registry)
        self.queue_wait = Histogram("capsnet_queue_wait_seconds",
                                    "Time a request waited in the batch queue before its first backend run",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.compute = Histogram("capsnet_compute_seconds", "Time of one backend run (one batch)",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        batch_buckets = sorted({2 ** i for i in range(max_batch_size.bit_length())} | {max_batch_size})
        self.batch_size = Histogram("capsnet_batch_size", "Images per backend run",
                                    buckets=batch_buckets, registry=registry)
        self.images = Counter("capsnet_images", "Images inferred", registry=registry)
        self.queue_depth = Gauge("capsnet_queue_depth", "Requests waiting in the batch queue", registry=registry)
        self.dropped = Counter("capsnet_dropped_requests",
                               "Requests that left the queue without being computed, by reason",
                               ["reason"], registry=registry)
        self.model_info = Gauge("capsnet_model_info", "The served model (value 1)",
                                ["model", "version", "backend", "precision", "routing_iterations"], registry=registry)

        self.self_check_agreement = Gauge(
            "capsnet_self_check_argmax_agreement_ratio",
            "Share of the export's reference images the served backend gives the FP32 reference's class (at startup)",
            registry=registry)
        self.self_check_diff = Gauge(
            "capsnet_self_check_max_abs_diff", "Largest difference from the FP32 reference outputs at startup, by output",
            ["output"], registry=registry)

    def record_self_check(self, check) -> None:
        self.self_check_agreement.set(check.argmax_agreement)
        for output, diff in check.max_abs_diff.items():
            self.self_check_diff.labels(output).set(diff)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _RequestMetricsInterceptor(self)

    def serve_http(self, host: str, port: int):
        """Start /metrics on a daemon thread; returns the HTTP server (its bound port: server.server_port)."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return httpd


class _RequestMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler to count the RPC by its final status and time it."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        api = API_NAMES.get(service, service)
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        return handler._replace(**{kind: self._wrap(getattr(handler, kind), api, method)})

    def _wrap(self, behavior, api: str, method: str):
        metrics = self.metrics

        def start(context) -> list:
            started = time.perf_counter()
            failure: list = []  # an exception that escaped the handler: gRPC answers UNKNOWN
            metrics.inflight.inc()

            def finish(context) -> None:
                metrics.inflight.dec()
                metrics.requests.labels(api, method, _code_name(context, failure)).inc()
                metrics.request_duration.labels(api, method).observe(time.perf_counter() - started)

            context.add_done_callback(finish)
            return failure

        # gRPC tells handler kinds apart by their function type, so the wrapper keeps it.
        if inspect.isasyncgenfunction(behavior):
            async def wrapped(request, context):
                failure = start(context)
                try:
                    async for response in behavior(request, context):
                        yield response
                except Exception as err:
                    failure.append(err)
                    raise
        else:
            async def wrapped(request, context):
                failure = start(context)
                try:
                    return await behavior(request, context)
                except Exception as err:
                    failure.append(err)
                    raise
        return wrapped


def _code_name(context, failure: list) -> str:
    code = context.code()
    if code is not None:
        return code.name
    if context.cancelled():
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    return "UNKNOWN" if failure else "OK"
