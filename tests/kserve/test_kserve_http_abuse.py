"""The REST endpoint's bounds against hostile or broken clients (serving/transports/kserve_http.py,
serving/transports/http_body.py), each against a real server on loopback: compressed bodies inflated and bounded, the
budget of bodies read at once, clients that leave mid-upload or never read their answers."""

import contextlib
import gzip
import http.client
import json
import logging
import socket
import threading
import time
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient
from kserve_messages import MAX_BATCH_SIZE, images
from serving_helpers import ServerThread, metric, scrape, server_config, wait_until

from capsnet.serving.transports import http_body, kserve_http

INFER = "/v2/models/capsnet/infer"
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def infer_json(count: int, seed: int, outputs=("probabilities",)) -> bytes:
    batch = images(count, seed=seed)
    return json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(batch.shape),
                                   "data": batch.ravel().tolist()}],
                       "outputs": [{"name": name} for name in outputs]}).encode()


def head(length: int, extra: str = "") -> bytes:
    return (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n").encode()


def answer(port: int, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON) of one POST on a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", INFER, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def send_all(client: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server may close the connection first
        client.sendall(data)


def rest_count(running: ServerThread, code: str) -> float:
    return metric(scrape(running.metrics_url), "capsnet_requests_total", api="kserve_http", method="ModelInfer",
                  code=code)


@pytest.fixture
def port(kserve_rest) -> int:
    return kserve_rest.server.http_port


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_bodies_are_answered_as_plain_ones(port, run_onnx, algorithm):
    """tritonclient.http's request compression (gzip, and HTTP's deflate: zlib's format)."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    batch = images(3, seed=71)
    tensor = httpclient.InferInput("images", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer("capsnet", [tensor], request_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("probabilities"), run_onnx(batch)["probabilities"], **TOLERANCE)


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_body_inflating_past_the_limit_is_413(kserve_rest, port, run_onnx, encoding,
                                                                           compress):
    limit = kserve_rest.server.max_message_bytes
    bomb = compress(bytes(64 * 2 ** 20))  # 64 MiB of zeros in about 64 KiB
    assert len(bomb) < limit
    status, error = answer(port, bomb, {"Content-Encoding": encoding})
    assert (status, error) == (413, {"error": f"the request body exceeds the server's limit of {limit} bytes "
                                              "(--max-message-bytes); send fewer images per request, or their data "
                                              "in binary"})
    status, good = answer(port, infer_json(1, seed=72))
    assert status == 200, good


def test_bodies_read_at_once_share_a_budget(kserve_model_dir, monkeypatch, run_onnx):
    """The budget is at least one body of the limit: here exactly that, so a second body arriving while a first of the
    limit's size is read is refused at once, and taken once the first is gone."""
    monkeypatch.setattr(http_body, "BODY_BUDGET_BYTES", 0)
    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", max_batch_size=MAX_BATCH_SIZE))
    try:
        port, limit = running.server.http_port, running.server.max_message_bytes
        stalled = socket.create_connection(("127.0.0.1", port), timeout=30)
        stalled.sendall(head(limit) + b"{")  # the rest never comes
        body = infer_json(1, seed=73)
        wait_until(lambda: answer(port, body)[0] == 503)
        status, error = answer(port, body)
        assert status == 503 and error["error"].startswith(
            f"too many request bodies are arriving at once ({limit} bytes of at most {limit}); retry shortly"), error
        stalled.close()
        wait_until(lambda: answer(port, body)[0] == 200)
        assert rest_count(running, "CANCELLED") >= 1  # the stalled one, when its client left
    finally:
        running.stop()


def test_a_client_leaving_mid_upload_is_counted_cancelled_without_a_traceback(kserve_rest, port, caplog):
    before = rest_count(kserve_rest, "CANCELLED")
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
                client.sendall(head(1000) + b"x" * 10)
                time.sleep(0.05)  # the server is reading the body when the client leaves
        wait_until(lambda: rest_count(kserve_rest, "CANCELLED") - before == 5)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text


def test_answers_a_client_does_not_read_are_dropped_after_the_write_timeout(kserve_rest, port, monkeypatch):
    """Pipelined requests whose large JSON answers are never read: the connection is closed once an answer waits
    WRITE_TIMEOUT_S, instead of holding the answers without end."""
    monkeypatch.setattr(kserve_http, "WRITE_TIMEOUT_S", 0.5)
    body = infer_json(MAX_BATCH_SIZE, seed=74, outputs=("reconstruction", "poses", "probabilities"))  # ~150 KB answers
    requests = 100
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sender = threading.Thread(target=send_all, args=(client, (head(len(body)) + body) * requests))
    try:
        sender.start()  # the server stops reading requests while its answers wait: the sending stalls too
        time.sleep(2.0)  # not reading: the server's writes stall, past its timeout
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(1 << 20):  # ends when the server has closed the connection
                received += chunk
    finally:
        client.close()
        sender.join(30)
    assert 0 < received.count(b"HTTP/1.1 200 OK") < requests
    status, good = answer(port, infer_json(1, seed=75))  # the server carries on
    assert status == 200, good


def test_a_request_aiohttp_cannot_parse_is_one_warning_line(port, caplog):
    """aiohttp answers a header line over 8 KiB with 400 itself and logs an ERROR traceback: the server makes that one
    WARNING line, as a client's mistake."""
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n")
            assert client.recv(100).startswith(b"HTTP/1.0 400 Bad Request")
        wait_until(lambda: any(record.name == "aiohttp.server" for record in caplog.records))
    [record] = [record for record in caplog.records if record.name == "aiohttp.server"]
    assert (record.levelname, record.exc_info) == ("WARNING", None)
    assert record.getMessage().startswith("Error handling request from 127.0.0.1, answered 400: Got more than 8190")
