"""KServe v2 over HTTP/REST (serving/transports/kserve_http.py), against real servers on loopback: tritonclient.http and
plain http.client requests, the answers equal to gRPC's and to ONNX Runtime's; routes, readiness, metrics, cancellation,
and `capsnet serve` as a process (SIGTERM drain, --no-http, the REST port in use). Bad requests:
test_kserve_http_errors.py."""

import asyncio
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from kserve_messages import CPU_EXTENSIONS, MAX_BATCH_SIZE, images
from serving_helpers import ServeProcess, ServerThread, metric, scrape, server_config, wait_until

from capsnet import __version__
from capsnet.serving.lifecycle import SHUTTING_DOWN

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # test_kserve_api's: onnxruntime on other batch compositions
BINARY_HEADER = "Inference-Header-Content-Length"
OUTPUTS = ["probabilities", "poses", "reconstruction"]  # the model's, in its order
INT64_FIELDS = {"shape", "dims", "max_queue_delay_microseconds"}
REST_LINE = re.compile(r" rest http://127\.0\.0\.1:(\d+)$")


def call(port: int, method: str, path: str, body: bytes | None = None, headers=None, timeout: float = 30):
    """(status, headers, body) of one request on a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def post_and_hold(port: int, body: bytes, headers: dict) -> socket.socket:
    """A raw connection that has sent an infer request and does not read its answer (close it to give up)."""
    head = "".join(f"{key}: {value}\r\n" for key, value in {**headers, "Content-Length": len(body)}.items())
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.sendall(f"POST /v2/models/capsnet/infer HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
    return client


def in_background(function):
    """Start function() on a thread; returns result(), which waits for it and returns its value or raises its error."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except Exception as err:  # re-raised by result(), in the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout: float = 60):
        thread.join(timeout)
        assert not thread.is_alive(), f"still waiting after {timeout} s"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


def infer_body(batch: np.ndarray, *, datatype: str = "FP32", binary: bool = False, nested: bool = False,
               **fields) -> tuple[bytes, dict]:
    """The body and headers of an infer request with `batch` as the input: JSON `data` (flat or nested as the
    shape) or binary data after the JSON."""
    tensor = {"name": "images", "datatype": datatype, "shape": list(batch.shape)}
    if binary:
        raw = batch.astype("u1" if datatype == "UINT8" else "<f4").tobytes()
        tensor["parameters"] = {"binary_data_size": len(raw)}
    else:
        tensor["data"] = batch.tolist() if nested else batch.ravel().tolist()
    header = json.dumps({**fields, "inputs": [tensor]}).encode()
    if not binary:
        return header, {"Content-Type": "application/json"}
    return header + raw, {BINARY_HEADER: str(len(header))}


def read_answer(headers, body: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The answer's JSON and its outputs as arrays, from JSON `data` or the binary data after the JSON."""
    length = headers.get(BINARY_HEADER)
    header = body if length is None else body[:int(length)]
    answer, offset, arrays = json.loads(header), len(header), {}
    for output in answer["outputs"]:
        assert output["datatype"] == "FP32"
        if "data" in output:
            values = np.array(output["data"], dtype=np.float32)
        else:
            size = output["parameters"]["binary_data_size"]
            values = np.frombuffer(body[offset:offset + size], dtype="<f4")
            offset += size
        arrays[output["name"]] = values.reshape(output["shape"])
    assert offset == len(body), "bytes left over after the outputs"
    return answer, arrays


def assert_equal_outputs(arrays: dict, expected: dict) -> None:
    for name, array in arrays.items():
        np.testing.assert_allclose(array, expected[name], **TOLERANCE, err_msg=name)


@pytest.fixture(scope="module")
def port(kserve_rest) -> int:
    return kserve_rest.server.http_port


@pytest.fixture(scope="module")
def triton_http(port):
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}", network_timeout=30)
    yield client
    client.close()


@pytest.fixture(scope="module")
def triton_grpc(kserve_rest):
    client = grpcclient.InferenceServerClient(url=kserve_rest.target)
    yield client
    client.close()


def numbers(value, key=None):
    """gRPC's JSON writes int64 fields (shape, dims, ...) as strings; REST's are numbers."""
    if isinstance(value, dict):
        return {name: numbers(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return [numbers(item, key) for item in value]
    return int(value) if key in INT64_FIELDS and isinstance(value, str) else value


# --- tritonclient.http ---------------------------------------------------------------------------------------------


def test_tritonclient_http_health_and_metadata_equal_grpcs(triton_http, triton_grpc):
    assert (triton_http.is_server_live(), triton_http.is_server_ready()) == (True, True)
    assert triton_http.is_model_ready("capsnet") and triton_http.is_model_ready("capsnet", "1")
    assert triton_http.get_server_metadata() == {"name": "capsnet-serve", "version": __version__,
                                                 "extensions": CPU_EXTENSIONS}
    assert triton_grpc.get_server_metadata(as_json=True) == {"name": "capsnet-serve", "version": __version__,
                                                             "extensions": CPU_EXTENSIONS}

    metadata = triton_http.get_model_metadata("capsnet")
    assert metadata == numbers(triton_grpc.get_model_metadata("capsnet", as_json=True))
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, 1, 28, 28]}]
    assert [output["name"] for output in metadata["outputs"]] == OUTPUTS
    assert triton_http.get_model_metadata("capsnet", "1") == metadata

    config = triton_http.get_model_config("capsnet")
    assert config == numbers(triton_grpc.get_model_config("capsnet", as_json=True)["config"])
    assert (config["max_batch_size"], config["dynamic_batching"]) == (MAX_BATCH_SIZE,
                                                                      {"max_queue_delay_microseconds": 500})
    assert config["input"] == [{"name": "images", "data_type": "TYPE_FP32", "dims": [1, 28, 28]}]


def test_tritonclient_http_infer_binary_by_default_equals_grpc_and_onnxruntime(triton_http, triton_grpc, run_onnx):
    batch = images(3, seed=21)
    given = httpclient.InferInput("images", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch)  # binary_data=True: raw bytes after the JSON
    result = triton_http.infer("capsnet", [given], request_id="rest-7")
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("rest-7", "capsnet", "1")
    assert [output["name"] for output in response["outputs"]] == OUTPUTS  # none asked: all, in model order
    assert all("data" not in output and output["parameters"]["binary_data_size"] > 0 for output in response["outputs"])

    over_grpc = grpcclient.InferInput("images", list(batch.shape), "FP32")
    over_grpc.set_data_from_numpy(batch)
    grpc_result = triton_grpc.infer("capsnet", [over_grpc], client_timeout=30)
    expected = run_onnx(batch)
    for name in OUTPUTS:
        np.testing.assert_allclose(result.as_numpy(name), grpc_result.as_numpy(name), **TOLERANCE, err_msg=name)
        np.testing.assert_allclose(result.as_numpy(name), expected[name], **TOLERANCE, err_msg=name)


# 2 images: the JSON is parsed and written on the event loop; 8 (over INLINE_JSON_BYTES): in a worker thread.
@pytest.mark.parametrize("outputs, count", [(("poses",), 2), (("reconstruction", "probabilities"), 8)])
def test_tritonclient_http_json_input_and_json_outputs_in_request_order(triton_http, run_onnx, outputs, count):
    batch = images(count, seed=22)
    given = httpclient.InferInput("images", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch, binary_data=False)
    requested = [httpclient.InferRequestedOutput(name, binary_data=False) for name in outputs]
    result = triton_http.infer("capsnet", [given], outputs=requested)
    response = result.get_response()
    assert "id" not in response
    assert tuple(output["name"] for output in response["outputs"]) == outputs
    assert all("parameters" not in output and len(output["data"]) == result.as_numpy(output["name"]).size
               for output in response["outputs"])
    expected = run_onnx(batch)
    assert_equal_outputs({name: result.as_numpy(name) for name in outputs}, expected)


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_uint8_is_scaled_to_unit_range(triton_http, run_onnx, binary):
    pixels = np.random.default_rng(23).integers(0, 256, size=(2, 1, 28, 28), dtype=np.uint8)
    given = httpclient.InferInput("images", list(pixels.shape), "UINT8")
    given.set_data_from_numpy(pixels, binary_data=binary)
    result = triton_http.infer("capsnet", [given], outputs=[httpclient.InferRequestedOutput("probabilities")])
    np.testing.assert_allclose(result.as_numpy("probabilities"),
                               run_onnx(pixels.astype(np.float32) / 255)["probabilities"], **TOLERANCE)


# --- plain HTTP ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/v2/models/capsnet/ready",
                                  "/v2/models/capsnet/versions/1/ready"])
def test_health_and_readiness_are_200_with_an_empty_body(port, path):
    status, _, body = call(port, "GET", path)
    assert (status, body) == (200, b"")


def test_nested_json_data_on_the_version_path_answers_json(port, run_onnx):
    batch = images(2, seed=24)
    body, headers = infer_body(batch, nested=True)
    status, answer_headers, answer_body = call(port, "POST", "/v2/models/capsnet/versions/1/infer", body, headers)
    assert status == 200, answer_body
    assert BINARY_HEADER not in answer_headers and answer_headers["Content-Type"].startswith("application/json")
    answer, arrays = read_answer(answer_headers, answer_body)
    assert (answer["model_name"], answer["model_version"], "id" in answer) == ("capsnet", "1", False)
    assert list(arrays) == OUTPUTS
    assert_equal_outputs(arrays, run_onnx(batch))


def test_binary_data_output_answers_binary_except_outputs_asking_json(port, run_onnx):
    """binary_data_output: true for the whole request; binary_data on an output wins over it."""
    batch = images(2, seed=25)
    outputs = [{"name": "poses", "parameters": {"binary_data": False}}, {"name": "probabilities"}]
    body, headers = infer_body(batch, binary=True, id="mixed", outputs=outputs,
                               parameters={"binary_data_output": True})
    status, answer_headers, answer_body = call(port, "POST", "/v2/models/capsnet/infer", body, headers)
    assert status == 200, answer_body
    answer, arrays = read_answer(answer_headers, answer_body)
    assert answer["id"] == "mixed" and list(arrays) == ["poses", "probabilities"]
    assert "data" in answer["outputs"][0] and answer["outputs"][1]["parameters"] == {"binary_data_size": 2 * 10 * 4}
    assert_equal_outputs(arrays, run_onnx(batch))


@pytest.mark.parametrize("method, path, message", [
    ("GET", "/v2/models/capsnet/versions/2", "model version: model 'capsnet' has no version '2'; expected '' or '1'"),
    ("GET", "/v2/models/capsnet/versions/2/ready",
     "model version: model 'capsnet' has no version '2'; expected '' or '1'"),
    ("GET", "/v2/models/capsnet/versions/2/config",
     "model version: model 'capsnet' has no version '2'; expected '' or '1'"),
    ("POST", "/v2/models/capsnet/versions/2/infer",
     "model version: model 'capsnet' has no version '2'; expected '' or '1'"),
    ("GET", "/v2/models/mnist", "model name: unknown model 'mnist'; this server serves 'capsnet', 'capsnet-decoder'"),
    ("POST", "/v2/models/mnist/infer",
     "model name: unknown model 'mnist'; this server serves 'capsnet', 'capsnet-decoder'"),
    ("GET", "/v3/models", "GET /v3/models: Not Found"),
    ("POST", "/v2/models/capsnet/infer/now", "POST /v2/models/capsnet/infer/now: Not Found"),
])
def test_unknown_model_version_or_route_is_404_with_a_json_error(port, method, path, message):
    body, headers = infer_body(images(1, seed=26))
    status, answer_headers, answer = call(port, method, path, body if method == "POST" else None, headers)
    assert status == 404 and answer_headers["Content-Type"].startswith("application/json")
    assert json.loads(answer) == {"error": message}


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v2/models/capsnet/infer", "POST"),
                                                   ("PUT", "/v2/models/capsnet/versions/1/infer", "POST"),
                                                   ("POST", "/v2/health/live", "GET,HEAD")])
def test_wrong_method_is_405_with_allow(port, method, path, allowed):
    status, headers, answer = call(port, method, path, b"{}" if method != "GET" else None)
    assert status == 405 and json.loads(answer) == {"error": f"{method} {path}: Method Not Allowed"}
    assert sorted(headers["Allow"].split(",")) == sorted(allowed.split(","))


def test_readiness_is_400_while_draining_yet_requests_are_still_answered(kserve_model_dir, run_onnx):
    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", drain_window_s=300.0,
                                         grace_period_s=5.0))
    server = running.server
    stopping = None
    try:
        port = server.http_port
        assert call(port, "GET", "/v2/health/ready")[:3:2] == (200, b"")
        assert call(port, "GET", "/v2/health/live")[1].get("Connection") != "close"  # kept alive while serving
        stopping = asyncio.run_coroutine_threadsafe(server.stop(), running.loop)  # waits out the drain window
        wait_until(lambda: call(port, "GET", "/v2/health/ready")[0] != 200)
        for path in ("/v2/health/ready", "/v2/models/capsnet/ready"):
            assert call(port, "GET", path)[:3:2] == (400, b""), path
        assert call(port, "GET", "/v2/health/live")[:3:2] == (200, b"")
        batch = images(1, seed=27)
        status, headers, body = call(port, "POST", "/v2/models/capsnet/infer", *infer_body(batch))
        assert status == 200, body  # balancers may not have noticed yet: still served
        assert headers["Connection"] == "close"  # but the client reconnects for the next, maybe to another replica
        assert_equal_outputs(read_answer(headers, body)[1], run_onnx(batch))
        assert not stopping.done()
    finally:
        if stopping is not None:
            running.loop.call_soon_threadsafe(server.stop_now)
            stopping.result(timeout=30)
            running.loop.call_soon_threadsafe(running.loop.stop)
            running.thread.join(10)
        else:
            running.stop()


# --- metrics and cancellation --------------------------------------------------------------------------------------


def rest_requests(samples: dict, code: str, method: str = "ModelInfer") -> float:
    return metric(samples, "capsnet_requests_total", api="kserve_http", method=method, code=code)


def test_requests_are_counted_by_their_outcome(kserve_rest, port):
    before = scrape(kserve_rest.metrics_url)
    good, bad = infer_body(images(1, seed=28)), (b'{"inputs": []}', {})
    for body, headers in (good, bad, good, bad, bad):
        call(port, "POST", "/v2/models/capsnet/infer", body, headers)
    call(port, "GET", "/v2/models/capsnet/versions/1/config")
    call(port, "GET", "/v2/nowhere")
    after = scrape(kserve_rest.metrics_url)
    assert rest_requests(after, "OK") - rest_requests(before, "OK") == 2
    assert rest_requests(after, "INVALID_ARGUMENT") - rest_requests(before, "INVALID_ARGUMENT") == 3
    assert rest_requests(after, "OK", "ModelConfig") - rest_requests(before, "OK", "ModelConfig") == 1
    assert rest_requests(after, "UNIMPLEMENTED", "unknown") - rest_requests(before, "UNIMPLEMENTED", "unknown") == 1
    duration = "capsnet_request_duration_seconds_count"
    assert (metric(after, duration, api="kserve_http", method="ModelInfer")
            - metric(before, duration, api="kserve_http", method="ModelInfer")) == 5


@pytest.fixture(scope="module")
def held(kserve_model_dir):
    """A server whose batches wait 60 s for batch-mates: a lone request stays queued until a full batch comes."""
    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", max_batch_size=MAX_BATCH_SIZE,
                                         max_queue_delay_us=60_000_000))
    yield running
    running.stop()


def test_a_queued_rest_request_counts_in_flight(held, run_onnx):
    port, url = held.server.http_port, held.metrics_url
    assert metric(scrape(url), "capsnet_inflight_requests") == 0
    lone, rest = images(1, seed=29), images(MAX_BATCH_SIZE - 1, seed=30)
    lone_answer = in_background(lambda: call(port, "POST", "/v2/models/capsnet/infer", *infer_body(lone, binary=True)))
    try:
        wait_until(lambda: metric(scrape(url), "capsnet_queue_depth") == 1)
        assert metric(scrape(url), "capsnet_inflight_requests") == 1
    finally:  # the rest of a batch: both are computed at once
        status, headers, body = call(port, "POST", "/v2/models/capsnet/infer", *infer_body(rest))
        lone_status, lone_headers, lone_body = lone_answer()
    assert status == 200 and lone_status == 200
    assert_equal_outputs(read_answer(lone_headers, lone_body)[1], run_onnx(lone))
    assert_equal_outputs(read_answer(headers, body)[1], run_onnx(rest))
    assert metric(scrape(url), "capsnet_inflight_requests") == 0


def test_a_client_that_closes_while_queued_is_counted_cancelled(held):
    port, url = held.server.http_port, held.metrics_url
    before = scrape(url)
    with post_and_hold(port, *infer_body(images(1, seed=31), binary=True)):
        wait_until(lambda: metric(scrape(url), "capsnet_queue_depth") == 1)
    wait_until(lambda: rest_requests(scrape(url), "CANCELLED") - rest_requests(before, "CANCELLED") == 1)
    after = scrape(url)
    assert metric(after, "capsnet_queue_depth") == 0 and metric(after, "capsnet_inflight_requests") == 0
    assert (metric(after, "capsnet_dropped_requests_total", reason="cancelled")
            - metric(before, "capsnet_dropped_requests_total", reason="cancelled")) == 1
    assert rest_requests(after, "OK") == rest_requests(before, "OK")


def test_a_full_queue_is_503_with_the_queue_size(kserve_model_dir):
    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", max_queue_delay_us=60_000_000,
                                         max_queue_size=1))
    try:
        port, url = running.server.http_port, running.metrics_url
        with post_and_hold(port, *infer_body(images(1, seed=35), binary=True)):
            wait_until(lambda: metric(scrape(url), "capsnet_queue_depth") == 1)
            status, _, body = call(port, "POST", "/v2/models/capsnet/infer", *infer_body(images(1, seed=36)))
            assert (status, json.loads(body)) == (503, {"error": "queue full: 1 requests are waiting (--max-queue-size "
                                                                 "1); retry later or on another replica"})
            assert rest_requests(scrape(url), "UNAVAILABLE") == 1
        wait_until(lambda: metric(scrape(url), "capsnet_queue_depth") == 0)  # the held request gave up
    finally:
        running.stop()


# --- capsnet serve as a process ------------------------------------------------------------------------------------


def rest_port(served: ServeProcess) -> int:
    ready = next(line for line in served.lines if "ready:" in line).rstrip("\n")
    return int(REST_LINE.search(ready)[1])


def test_sigterm_answers_rest_requests_in_flight_then_refuses_new_ones(kserve_model_dir, run_onnx):
    # Batches wait 5 s for batch-mates, so the first requests are still queued when SIGTERM arrives, and still
    # after the drain window (1 s) and the 2 s that aiohttp's own shutdown would give them (STOP_GRACE_S, twice).
    served = ServeProcess("--model", str(kserve_model_dir), "--backend", "onnxruntime", "--max-queue-delay-us",
                          "5000000", "--drain-window", "1", "--grace-period", "10")
    try:
        port, url = rest_port(served), f"http://127.0.0.1:{served.metrics_port}/metrics"
        batches = {name: images(1, seed=seed) for name, seed in (("first", 32), ("second", 33), ("in window", 34))}
        answers = {}

        def send(name):
            answers[name] = in_background(lambda: call(port, "POST", "/v2/models/capsnet/infer",
                                                       *infer_body(batches[name]), timeout=60))

        send("first")
        send("second")
        wait_until(lambda: metric(scrape(url), "capsnet_queue_depth") == 2, timeout=1.0)
        served.process.send_signal(signal.SIGTERM)
        wait_until(lambda: call(port, "GET", "/v2/health/ready")[0] == 400)
        send("in window")  # within the drain window: still served
        # After the window a request is refused at once (before its body is even parsed: "{}" is refused for
        # being empty until then).
        probes = []
        wait_until(lambda: probes.append(call(port, "POST", "/v2/models/capsnet/infer", b"{}")) or probes[-1][0] != 400)
        status, headers, body = probes[-1]
        assert (status, json.loads(body)) == (503, {"error": SHUTTING_DOWN})
        for name, batch in batches.items():
            status, headers, body = answers[name]()
            assert status == 200, (name, body)
            assert_equal_outputs(read_answer(headers, body)[1], run_onnx(batch))
        assert served.process.wait(timeout=30) == 0
        stderr = served.process.stderr.read()
        assert "capsnet serve: stopped" in stderr and "Traceback" not in stderr, stderr
    finally:
        served.stop()


def test_no_http_serves_no_rest(kserve_model_dir):
    served = ServeProcess("--model", str(kserve_model_dir), "--backend", "onnxruntime", "--no-http")
    try:
        ready = next(line for line in served.lines if "ready:" in line).rstrip("\n")
        assert ready.endswith(f"metrics http://127.0.0.1:{served.metrics_port}/metrics") and " rest " not in ready
    finally:
        served.stop()


@pytest.mark.parametrize("holder", ["another process", "the server's own gRPC port", "its own metrics port"])
def test_rest_port_in_use_is_a_one_line_error(kserve_model_dir, holder):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        others = {"another process": ["--grpc-port", "0", "--metrics-port", "0"],
                  "the server's own gRPC port": ["--grpc-port", str(port), "--metrics-port", "0"],
                  "its own metrics port": ["--grpc-port", "0", "--metrics-port", str(port)]}[holder]
        if holder == "another process":
            held.listen()
        else:
            held.close()  # free again: the server takes it first, then REST cannot
        result = subprocess.run([sys.executable, "-m", "capsnet", "serve", "--model", str(kserve_model_dir),
                                 "--backend", "onnxruntime", *others, "--http-port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"capsnet serve: error: cannot listen on 127.0.0.1:{port}: "
                                                      "Address already in use")
