"""An OTLP/gRPC trace receiver on loopback that counts what it receives: a stand-in for an OpenTelemetry Collector
where none runs, for trying `capsnet serve --otlp-endpoint` and for measuring what tracing costs (serving_ab.py).

    python scripts/otlp_sink.py --port 4317 [--print]

Prints one line per second with the spans received so far (--print: each span's trace id, name and duration too);
stops on SIGINT or SIGTERM. Needs the otel extra (opentelemetry-proto and grpcio).
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, show: bool):
        self.spans = 0
        self._show = show
        self._lock = threading.Lock()

    def Export(self, request, context):
        spans = [span for resource in request.resource_spans for scope in resource.scope_spans for span in scope.spans]
        with self._lock:
            self.spans += len(spans)
        if self._show:
            for span in spans:
                took_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
                print(f"{span.trace_id.hex()} {span.name} {took_ms:.3f} ms", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4317, help="loopback port (default 4317, OTLP/gRPC's)")
    parser.add_argument("--print", dest="show", action="store_true", help="print every span")
    args = parser.parse_args()
    sink = Sink(args.show)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"otlp sink: listening on 127.0.0.1:{args.port}", flush=True)
    while not stop.wait(1.0):
        if not args.show:
            print(f"otlp sink: {sink.spans} spans", flush=True)
    server.stop(None)
    print(f"otlp sink: {sink.spans} spans in all", flush=True)


if __name__ == "__main__":
    main()
