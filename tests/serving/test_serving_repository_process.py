"""`capsnet serve --model-repository` as a process: SIGHUP loads what changed on disk, `--log-format json` writes every
log line as JSON with one access line per request, and with `--otlp-endpoint` the request traces reach an OTLP/gRPC
receiver on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import pytest
from serving_helpers import ServeProcess, add_version, wait_until

from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc

IMAGES = np.random.default_rng(8).random((2, 1, 28, 28), dtype=np.float32)  # (2, 1, 28, 28)
REST_PORT = re.compile(r" rest http://[^ ]+:(\d+)")
ACCESS_FIELDS = {"time", "level", "logger", "message", "api", "method", "model", "version", "status", "duration_ms",
                 "images", "batch_size", "trace_id", "peer"}


class OtlpReceiver:
    """An OTLP/gRPC trace endpoint on loopback (opentelemetry-proto's service), keeping what it receives."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.requests = []
        self._lock = threading.Lock()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with receiver._lock:
                    receiver.requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def spans(self) -> list[tuple[str, str, dict]]:
        """(trace id, span name, resource attributes) of every span received."""
        with self._lock:
            requests = list(self.requests)
        return [(span.trace_id.hex(), span.name, {a.key: a.value.string_value for a in resource.resource.attributes})
                for request in requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    def stop(self) -> None:
        self._server.stop(None)


@pytest.fixture(scope="module")
def receiver():
    try:
        running = OtlpReceiver()
    except ImportError:
        yield None  # the otel extra is not installed: the server runs without tracing
        return
    yield running
    running.stop()


@pytest.fixture(scope="module")
def process(model_dir, tmp_path_factory, receiver):
    root = tmp_path_factory.mktemp("repository-process")
    repository = root / "models"
    add_version(repository, "capsnet", 1, model_dir)
    args = ["--model-repository", str(repository), "--model-control", "explicit", "--log-format", "json",
            "--backend", "onnxruntime", "--max-batch-size", "8", "--threads", "1", "--drain-window", "0"]
    if receiver is not None:
        args += ["--otlp-endpoint", receiver.endpoint]
    served = ServeProcess(*args, stderr=root / "serve.log", env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    served.repository, served.log = repository, root / "serve.log"
    served.rest = f"127.0.0.1:{next(REST_PORT.search(line)[1] for line in served.lines if REST_PORT.search(line))}"
    yield served
    served.stop()


def log_lines(process) -> list[dict]:
    return [json.loads(line) for line in process.log.read_text().splitlines() if line.strip()]


def rest_infer(process, traceparent: str | None = None) -> dict:
    body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(IMAGES.shape),
                                   "data": IMAGES.ravel().tolist()}]}).encode()
    headers = {"traceparent": traceparent} if traceparent else {}
    request = urllib.request.Request(f"http://{process.rest}/v2/models/capsnet/infer", body, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def grpc_infer(process, traceparent: str) -> str:
    request = kserve_pb.ModelInferRequest(
        model_name="capsnet", inputs=[kserve_pb.ModelInferRequest.InferInputTensor(
            name="images", datatype="FP32", shape=list(IMAGES.shape))],
        raw_input_contents=[IMAGES.astype("<f4").tobytes()])
    with grpc.insecure_channel(process.target) as channel:
        answer = kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=30, metadata=[("traceparent", traceparent)])
    return answer.model_version


def test_sighup_loads_a_new_version_from_disk(process, model_dir):
    assert rest_infer(process)["model_version"] == "1"
    add_version(process.repository, "capsnet", 2, model_dir)
    process.process.send_signal(signal.SIGHUP)
    wait_until(lambda: rest_infer(process)["model_version"] == "2", timeout=60, interval=0.2)
    messages = [line["message"] for line in log_lines(process)]
    assert any(message.startswith("model capsnet serves versions 2 (default 2)") for message in messages), messages


def test_json_logs_and_one_access_line_per_request(process):
    rest_id, grpc_id = "5bf92f3577b34da6a3ce929d0e0e4736", "6bf92f3577b34da6a3ce929d0e0e4736"
    rest_infer(process, f"00-{rest_id}-00f067aa0ba902b7-01")
    grpc_infer(process, f"00-{grpc_id}-00f067aa0ba902b7-01")
    wait_until(lambda: {rest_id, grpc_id} <= {line.get("trace_id") for line in log_lines(process)})
    lines = log_lines(process)  # every line parses as JSON
    assert {line["logger"] for line in lines} >= {"capsnet.access", "capsnet.serving.engine.model_manager"}
    by_trace = {line.get("trace_id"): line for line in lines if line["logger"] == "capsnet.access"}
    rest_line, grpc_line = by_trace[rest_id], by_trace[grpc_id]
    assert set(rest_line) == ACCESS_FIELDS | {"http_status"} and set(grpc_line) == ACCESS_FIELDS
    assert {key: rest_line[key] for key in ("api", "method", "model", "status", "http_status", "images")} == {
        "api": "kserve_http", "method": "ModelInfer", "model": "capsnet", "status": "OK", "http_status": 200,
        "images": 2}
    assert {key: grpc_line[key] for key in ("api", "method", "model", "status", "images")} == {
        "api": "kserve", "method": "ModelInfer", "model": "capsnet", "status": "OK", "images": 2}
    for line in (rest_line, grpc_line):
        assert line["version"] in ("1", "2") and line["duration_ms"] > 0 and 2 <= line["batch_size"] <= 8
        assert line["peer"].startswith("127.0.0.1:") and line["time"].endswith("+00:00")


def test_traces_reach_an_otlp_receiver(process, receiver):
    if receiver is None:
        pytest.skip("the otel extra is not installed")
    trace_id = "7bf92f3577b34da6a3ce929d0e0e4736"
    grpc_infer(process, f"00-{trace_id}-00f067aa0ba902b7-01")
    wait_until(lambda: len([s for s in receiver.spans() if s[0] == trace_id]) >= 6, timeout=30)
    spans = [span for span in receiver.spans() if span[0] == trace_id]
    assert {name for _, name, _ in spans} == {"kserve/ModelInfer", "received", "queued", "batched", "backend run",
                                              "answered"}
    assert {resource["service.name"] for _, _, resource in spans} == {"capsnet-serve"}
