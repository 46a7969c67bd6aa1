"""What the server's bookkeeping of one request costs on the event loop (serving/observability/observe.py), with tracing
and JSON access logs off and on: a RequestRecord made, served by a version, answered from one batch, and ended (metrics;
the access line, to a handler that discards it; the spans, to a BatchSpanProcessor exporting over OTLP/gRPC to
--otlp-endpoint, e.g. scripts/otlp_sink.py), and traced with 1 request in 100 sampled (OTEL_TRACES_SAMPLER
traceidratio, requests without a traceparent). Prints microseconds per request, best of --repeats.

    python scripts/otlp_sink.py --port 4317 &
    python scripts/bench_request_record.py --otlp-endpoint http://127.0.0.1:4317
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from capsnet.serving.engine.batcher import BatchOutput, BatchRun
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.observability.observe import ACCESS_LOG, JsonFormatter, Observer, RequestRecord

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def per_request_us(observer: Observer, requests: int, repeats: int, traceparent: str | None) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(requests):
            now = time.monotonic()
            record = RequestRecord("kserve", "ModelInfer", now, "127.0.0.1:50000", traceparent)
            record.served_by("capsnet", "1")
            run = BatchRun(4, now, now, now, now)
            record.answered(1, BatchOutput({}, 0.0, [run], now))
            observer.end(record, "OK")
        best = min(best, (time.perf_counter() - started) / requests * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--otlp-endpoint", required=True, help="where the spans go (an OTLP/gRPC receiver)")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from capsnet.serving.observability.tracing import Tracing

    handler = logging.StreamHandler(open(os.devnull, "w"))  # formatted and written, to nowhere
    handler.setFormatter(JsonFormatter())
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.setLevel(logging.INFO)
    ACCESS_LOG.propagate = False
    tracing = Tracing.from_config(args.otlp_endpoint)
    os.environ.update(OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0.01")  # read by the next one
    sampled = Tracing.from_config(args.otlp_endpoint)
    settings = {  # name -> (observer, the traceparent requests carry)
        "off (the default)": (Observer(Metrics(32)), TRACEPARENT),
        "--log-format json": (Observer(Metrics(32), access_log=True), TRACEPARENT),
        "--otlp-endpoint": (Observer(Metrics(32), tracing=tracing), TRACEPARENT),
        "both": (Observer(Metrics(32), access_log=True, tracing=tracing), TRACEPARENT),
        "1% sampled": (Observer(Metrics(32), tracing=sampled), None),
    }
    for name, (observer, traceparent) in settings.items():
        took = per_request_us(observer, args.requests, args.repeats, traceparent)
        print(f"{name:>20}: {took:7.1f} µs per request", flush=True)
    tracing.shutdown()
    sampled.shutdown()


if __name__ == "__main__":
    main()
