"""OpenTelemetry traces of requests, read back from the SDK's in-memory exporter: one trace per request, a child of
the client's W3C traceparent (gRPC metadata or HTTP header), with the spans of its way through the server."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.sdk.trace import StatusCode
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from serving_helpers import ServerThread, server_config, wait_until

from capsnet.errors import CapsNetError
from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc
from capsnet.serving.observability import tracing

IMAGES = np.random.default_rng(7).random((3, 1, 28, 28), dtype=np.float32)  # (3, 1, 28, 28)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = ["received", "queued", "batched", "backend run", "answered"]


@pytest.fixture(scope="module")
def traced(model_dir):
    """A server whose spans go to an in-memory exporter (`.exporter`)."""
    exporter = InMemorySpanExporter()
    running = ServerThread(server_config(model_dir), tracing=tracing.Tracing(SimpleSpanProcessor(exporter)))
    running.exporter = exporter
    yield running
    running.stop()


def request_spans(exporter: InMemorySpanExporter, trace_id: str) -> dict:
    """name -> spans of the trace `trace_id`."""
    spans = {}
    for span in exporter.get_finished_spans():
        if format(span.context.trace_id, "032x") == trace_id:
            spans.setdefault(span.name, []).append(span)
    return spans


def test_a_grpc_request_is_a_trace_under_the_clients_traceparent(traced):
    request = kserve_pb.ModelInferRequest(
        model_name="capsnet", inputs=[kserve_pb.ModelInferRequest.InferInputTensor(
            name="images", datatype="FP32", shape=list(IMAGES.shape))],
        raw_input_contents=[IMAGES.astype("<f4").tobytes()])
    with grpc.insecure_channel(traced.target) as channel:
        kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30,
                                                                metadata=[("traceparent", TRACEPARENT)])
    wait_until(lambda: "kserve/ModelInfer" in request_spans(traced.exporter, TRACE_ID))
    spans = request_spans(traced.exporter, TRACE_ID)
    [root] = spans["kserve/ModelInfer"]
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    assert root.kind.name == "SERVER" and root.status.status_code != StatusCode.ERROR
    assert {key: root.attributes[key] for key in ("capsnet.model", "capsnet.version", "capsnet.images",
                                                  "capsnet.status")} == {
        "capsnet.model": "capsnet", "capsnet.version": "1", "capsnet.images": 3, "capsnet.status": "OK"}
    assert sorted(spans) == sorted(["kserve/ModelInfer", *CHILDREN])
    children = [span for name in CHILDREN for span in spans[name]]
    assert all(span.parent.span_id == root.context.span_id for span in children)
    assert all(root.start_time <= span.start_time <= span.end_time <= root.end_time for span in children)
    ordered = [spans[name][0] for name in CHILDREN]  # one batch: the phases follow each other
    assert all(a.end_time <= b.start_time + 1000 for a, b in itertools.pairwise(ordered))  # 1 µs of rounding
    assert sum(span.attributes["capsnet.batch_size"] for span in spans["batched"]) >= 3


def test_a_rest_request_takes_the_traceparent_header_and_an_error_is_marked(traced):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28],
                                   "data": [2.0] * 784}]}).encode()  # out of [0, 1]: refused
    request = urllib.request.Request(f"http://127.0.0.1:{traced.server.http_port}/v2/models/capsnet/infer", body,
                                     headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    wait_until(lambda: "kserve_http/ModelInfer" in request_spans(traced.exporter, trace_id))
    spans = request_spans(traced.exporter, trace_id)
    [root] = spans["kserve_http/ModelInfer"]
    assert root.status.status_code == StatusCode.ERROR and root.attributes["capsnet.status"] == "INVALID_ARGUMENT"
    assert list(spans) == ["kserve_http/ModelInfer"]  # it never reached the batcher


def test_a_request_without_traceparent_starts_a_trace(traced):
    before = len(traced.exporter.get_finished_spans())
    with urllib.request.urlopen(f"http://127.0.0.1:{traced.server.http_port}/v2/models/capsnet", timeout=30):
        pass
    wait_until(lambda: len(traced.exporter.get_finished_spans()) > before)
    [root] = [s for s in traced.exporter.get_finished_spans()[before:] if s.name == "kserve_http/ModelMetadata"]
    assert root.parent is None and root.context.trace_id != 0


@pytest.mark.parametrize("env, flag, on", [
    ({}, None, False),
    ({}, "http://127.0.0.1:4317", True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, None, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, None, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, None, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, "http://127.0.0.1:4317", False),
])
def test_tracing_is_on_when_an_endpoint_is_given(env, flag, on):
    assert tracing.wanted(flag, env) is on


def test_an_otlp_protocol_other_than_grpc_is_one_line(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(CapsNetError, match="OTLP over 'http/protobuf' is not supported"):
        tracing.Tracing.from_config("http://127.0.0.1:4318")
