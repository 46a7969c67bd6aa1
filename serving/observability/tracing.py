"""OpenTelemetry traces of requests: the optional `otel` extra (`pip install 'capsnet-serve[otel]'`).

On when `--otlp-endpoint` is given or the standard variables name an endpoint (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none; spans go over OTLP/gRPC
in batches from a background thread. The SDK reads the rest of its variables itself (OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_EXPORTER_OTLP_HEADERS, ...). Off, nothing of OpenTelemetry is
imported and a request costs no more than a check that tracing is None.

Each request is one trace, a child of the W3C `traceparent` its client sent (gRPC metadata or HTTP header) when it
sent one. The spans are made when the request ends, from the times the server noted on its way, so nothing is
opened or closed on the request path:

    <api>/<method>         SERVER span, arrival to answer: model, version, status, images
      received             arrival -> queued (decoding, validation)
      queued               queued -> its first batch cut
      batched              a batch cut -> its input gathered; capsnet.batch_size: images in the batch
      backend run          the backend's run of that batch
      answered             its last rows handed over -> the answer ready to send (encoding)

A request split over two batches has two batched and backend run spans.
"""

from __future__ import annotations

import os
import time

from capsnet.errors import CapsNetError
from capsnet.serving.observability.observe import TRACEPARENT, RequestRecord

SERVICE_NAME = "capsnet-serve"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def wanted(endpoint: str | None, env=os.environ) -> bool:
    """Whether tracing is asked for, by the flag or the standard variables."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(endpoint) or any(env.get(name) for name in ENDPOINT_VARS)


class Tracing:
    """Turns ended RequestRecords into spans, handed to `processor` (an OpenTelemetry SpanProcessor)."""

    def __init__(self, processor):
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        resource = Resource.create()  # the standard variables' (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES)
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):  # they name none
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("capsnet.serving")
        self._propagator = TraceContextTextMapPropagator()
        self._error = trace.Status(trace.StatusCode.ERROR)
        self._server = trace.SpanKind.SERVER
        # time.monotonic() -> ns since the epoch, which spans take
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def from_config(cls, endpoint: str | None) -> "Tracing | None":
        """OTLP/gRPC export when asked for (see wanted()); None when not. CapsNetError without the extra."""
        if not wanted(endpoint):
            return None
        protocol = next((os.environ[name] for name in PROTOCOL_VARS if os.environ.get(name)), "grpc")
        if protocol.strip().lower() != "grpc":
            raise CapsNetError(f"OTLP over {protocol!r} is not supported: traces are exported over OTLP/gRPC; unset "
                               f"{' and '.join(PROTOCOL_VARS)} or set it to grpc")
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise CapsNetError("tracing (--otlp-endpoint, or OTEL_EXPORTER_OTLP_ENDPOINT) needs the otel extra: "
                               "pip install 'capsnet-serve[otel]'") from None
        return cls(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))

    def record(self, record: RequestRecord, code: str, ended: float) -> str:
        """The record's spans; returns its trace id (hex)."""
        trace, ns = self._trace, self._ns
        parent = (self._propagator.extract({TRACEPARENT: record.traceparent}) if record.traceparent else None)
        attributes: dict[str, str | int] = {"capsnet.api": record.api, "rpc.method": record.method,
                                            "capsnet.status": code}
        if record.model:
            attributes.update({"capsnet.model": record.model, "capsnet.version": record.version,
                               "capsnet.images": record.images})
        root = self._tracer.start_span(f"{record.api}/{record.method}", context=parent, kind=self._server,
                                       attributes=attributes, start_time=ns(record.started))
        output = record.output
        if output is not None and root.is_recording():  # a trace the sampler dropped gets no child spans either
            inside = trace.set_span_in_context(root)
            self._span("received", inside, record.started, output.submitted)
            self._span("queued", inside, output.submitted, output.runs[0].cut)
            for run in output.runs:
                self._span("batched", inside, run.cut, run.run_start, {"capsnet.batch_size": run.size})
                self._span("backend run", inside, run.run_start, run.run_end)
            self._span("answered", inside, output.runs[-1].delivered, ended)
        if code != "OK":
            root.set_status(self._error)
        root.end(end_time=ns(ended))
        return format(root.get_span_context().trace_id, "032x")

    def _span(self, name: str, context, start: float, end: float, attributes: dict | None = None) -> None:
        self._tracer.start_span(name, context=context, attributes=attributes, start_time=self._ns(start)).end(
            end_time=self._ns(end))

    def _ns(self, monotonic: float) -> int:
        return round(monotonic * 1e9) + self._epoch_offset_ns

    def shutdown(self) -> None:
        """Export what is pending, then stop the exporter's thread."""
        self._provider.shutdown()
