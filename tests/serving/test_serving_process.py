"""`capsnet serve` and `capsnet predict` as real processes: startup errors, graceful shutdown, the CLI
client, and a real Prometheus scraping the server."""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image
from serving_helpers import ServeProcess, free_port, metric, scrape, server_config, wait_until

from capsnet.cli import main
from capsnet.client.api import image_message
from capsnet.serving.lifecycle import SHUTTING_DOWN
from capsnet.serving.transports.server import CapsNetServer
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

IMAGE = np.random.default_rng(5).random((1, 28, 28), dtype=np.float32)  # (1, 28, 28)


def test_missing_model_directory_exits_non_zero(tmp_path):
    result = subprocess.run([sys.executable, "-m", "capsnet", "serve", "--model", str(tmp_path / "nowhere"),
                             "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"capsnet serve: error: model directory {tmp_path / 'nowhere'} does not exist")


@pytest.mark.parametrize("holder", ["another process", "the server's own gRPC port"])
def test_metrics_port_in_use_is_a_one_line_error(model_dir, holder):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if holder == "another process":
            held.listen()
            ports = ["--grpc-port", "0", "--http-port", "0", "--metrics-port", str(port)]
        else:
            held.close()  # free again: gRPC takes it first
            ports = ["--grpc-port", str(port), "--http-port", "0", "--metrics-port", str(port)]
        result = subprocess.run([sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), *ports],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"capsnet serve: error: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_a_batch_size_that_does_not_fit_in_memory_is_a_one_line_error(model_dir):
    """A batch of --max-batch-size images runs before the server serves (auto's race times it where two engines
    serve the precision, the warm-up otherwise, after gRPC and /metrics are listening): the backend's own failure
    becomes one line, and any listener is stopped first (gRPC printed a traceback at exit otherwise)."""
    import resource

    def five_gib_of_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (5 << 30, 5 << 30))

    result = subprocess.run([sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), "--precision", "fp32",
                             "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                             "--max-batch-size", "30000"],
                            capture_output=True, text=True, timeout=120, preexec_fn=five_gib_of_address_space)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith(("capsnet serve: error: warming up batch sizes [1, 2, 4, ",
                            "capsnet serve: error: loading the backend failed: ")), last
    assert last.endswith("(--max-batch-size 30000: a smaller one needs less memory)"), last


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.json").write_text("{not json"), "model.json is damaged: not valid JSON"),
    (lambda d: (d / "model.json").unlink(), "is not a capsnet model directory (no model.json)"),
    (lambda d: (d / "model.onnx").unlink(), "it lists artifacts.onnx 'model.onnx', which is missing"),
    (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:1000]),
     "model.onnx does not match"),  # its recorded sha256
    (lambda d: (d / "model.json").write_text(
        json.dumps({**json.loads((d / "model.json").read_text()), "class_names": []})),
     "model.json is damaged: class_names must be a non-empty list of strings"),
])
def test_damaged_model_directory_is_a_clear_startup_error(model_dir, tmp_path, capsys, damage, message):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    damage(copy)
    code = main(["serve", "--model", str(copy), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors


def test_sigterm_drains_health_first_then_refuses_and_finishes_in_flight(model_dir):
    # Batches wait 1.5 s for batch-mates, so the first request is still in flight when SIGTERM arrives.
    served = ServeProcess("--model", str(model_dir), "--max-queue-delay-us", "1500000", "--drain-window", "1",
                          "--grace-period", "10")
    try:
        with grpc.insecure_channel(served.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            request = pb.ClassifyRequest(images=[image_message(IMAGE)])
            in_flight = stub.Classify.future(request, timeout=60)
            metrics_url = f"http://127.0.0.1:{served.metrics_port}/metrics"
            wait_until(lambda: metric(scrape(metrics_url), "capsnet_queue_depth") == 1, timeout=1.0)

            served.process.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            # Within the drain window a request is still served (balancers may not have noticed yet) ...
            in_window = stub.Classify.future(request, timeout=60)
            # ... after it, a new request is refused, while those that arrived before are answered.
            deadline = time.monotonic() + 10
            while True:
                try:
                    stub.Classify(pb.ClassifyRequest(images=[image_message(IMAGE)], top_k=1), timeout=0.05)
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        assert err.details() == "the server is shutting down; retry on another replica"
                        break
                    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # queued behind the 1.5 s batch
                assert time.monotonic() < deadline, "never refused"
            assert len(in_flight.result(timeout=30).results) == 1
            assert len(in_window.result(timeout=30).results) == 1
        assert served.process.wait(timeout=30) == 0
        assert "capsnet serve: stopped" in served.process.stderr.read()
    finally:
        served.stop()


def sigterm_after_health_watch(served: ServeProcess, channel) -> grpc.Call:
    """SIGTERM, once a health Watch is open; returns the watch once it has seen NOT_SERVING."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    served.process.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    return watch


def test_health_watch_open_at_shutdown_ends_unavailable_without_a_traceback(model_dir):
    served = ServeProcess("--model", str(model_dir), "--drain-window", "0")
    try:
        with grpc.insecure_channel(served.target) as channel:
            watch = sigterm_after_health_watch(served, channel)
            with pytest.raises(grpc.RpcError) as caught:
                next(watch)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert caught.value.details() == "the server is shutting down"
        assert served.process.wait(timeout=30) == 0
        stderr = served.process.stderr.read()
        assert "Traceback" not in stderr and " ERROR " not in stderr, stderr
    finally:
        served.stop()


def test_idle_streams_open_at_shutdown_end_unavailable_instead_of_holding_the_grace_period(model_dir):
    served = ServeProcess("--model", str(model_dir), "--drain-window", "0", "--grace-period", "120")
    classify_requests, reflection_requests = queue.Queue(), queue.Queue()
    try:
        with grpc.insecure_channel(served.target) as channel:
            classify = capsnet_pb2_grpc.CapsNetServiceStub(channel).ClassifyStream(
                iter(classify_requests.get, None), timeout=300)
            classify_requests.put(pb.ClassifyRequest(images=[image_message(IMAGE)], request_id="before"))
            assert next(classify).request_id == "before"
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter(reflection_requests.get, None), timeout=300)
            reflection_requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert next(reflection).HasField("list_services_response")
            signalled = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            # Both streams are idle: nothing of theirs is in progress.
            for stream, details in ((classify, SHUTTING_DOWN), (reflection, "the server is shutting down")):
                with pytest.raises(grpc.RpcError) as caught:
                    next(stream)
                assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE, details)
            assert served.process.wait(timeout=150) == 0
        assert time.monotonic() - signalled < 60, "an idle stream held the shutdown for the grace period"
        stderr = served.process.stderr.read()
        assert "Traceback" not in stderr and " ERROR " not in stderr, stderr
    finally:
        classify_requests.put(None)
        reflection_requests.put(None)
        served.stop()


def test_a_signal_during_startup_stops_the_server_without_serving(model_dir):
    async def start_and_stop() -> tuple[int, bool, float]:
        server = CapsNetServer(server_config(model_dir, drain_window_s=300.0, grace_period_s=300.0))
        stopping = asyncio.Event()
        stopping.set()  # what serve()'s signal handler does when SIGTERM comes while the model loads
        await server.start(stopping)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            status = (await health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status
            watch = health_stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert (await watch.read()).status == status
            began = time.monotonic()
            await asyncio.wait_for(server.stop(), 120)  # a server that had served would wait out the 300 s window
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while True:  # the watch saw nothing but NOT_SERVING, then ended with the server
                    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            return status, ended.value.code(), time.monotonic() - began

    status, watch_end, stop_seconds = asyncio.run(start_and_stop())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert watch_end == grpc.StatusCode.UNAVAILABLE
    assert stop_seconds < 60, "stop() waited for the drain window of a server that never served"


def test_second_signal_cuts_the_drain_short(model_dir):
    served = ServeProcess("--model", str(model_dir), "--drain-window", "300")
    try:
        with grpc.insecure_channel(served.target) as channel:
            sigterm_after_health_watch(served, channel)
            second = time.monotonic()
            served.process.send_signal(signal.SIGINT)
            assert served.process.wait(timeout=30) == 0
        assert time.monotonic() - second < 10
        stderr = served.process.stderr.read()
        assert "stopping at once" in stderr and "Traceback" not in stderr, stderr
    finally:
        served.stop()


def write_pngs(directory, count: int) -> list[str]:
    paths = []
    for index in range(count):
        path = directory / f"digit{index}.png"
        Image.fromarray((np.random.default_rng(index).random((28, 28)) * 255).astype(np.uint8)).save(path)
        paths.append(str(path))
    return paths


def test_predict_prints_classes_without_importing_torch(server, tmp_path):
    paths = write_pngs(tmp_path, 2)
    script = ("import sys; from capsnet.cli import main; code = main(sys.argv[1:]); "
              "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(code)")

    def run(*args):
        return subprocess.run([sys.executable, "-c", script, "predict", *paths, "--server", server.target, *args],
                              capture_output=True, text=True, timeout=120)

    plain = run("--top-k", "2", "--poses")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[-1] == "torch not imported"
    assert lines[0].startswith(f"{paths[0]}: ") and " p=" in lines[0]
    assert lines[1].startswith("  #2: ") and sum(line.startswith("  pose ") for line in lines) == 20
    assert "; present: " in lines[0]  # the classes over 0.5, or none

    as_json = run("--json")
    assert as_json.returncode == 0, as_json.stderr
    items = json.loads(as_json.stdout[:as_json.stdout.rindex("]") + 1])
    assert [item["image"] for item in items] == paths
    for item, path in zip(items, paths):
        pixels = np.asarray(Image.open(path), dtype=np.float32)[None, None] / 255  # (1, 1, 28, 28)
        expected = server.server.service.backend.run(pixels)["probabilities"][0]
        assert item["class"] == int(np.argmax(expected)) and item["name"] == str(item["class"])
        assert item["probability"] == pytest.approx(float(expected.max()), abs=1e-6)


def test_predict_sends_more_files_than_a_batch_in_several_requests(server, tmp_path, capsys):
    paths = write_pngs(tmp_path, 11)  # the test server takes 8 images per request
    assert main(["predict", *paths, "--server", server.target]) == 0
    assert [line.split(": ")[0] for line in capsys.readouterr().out.splitlines()] == paths

    bad = tmp_path / "not-a-png.png"
    bad.write_bytes(b"certainly not a PNG")
    assert main(["predict", *paths[:9], str(bad), "--server", server.target]) == 2  # in the second request
    assert capsys.readouterr().err.strip() == (f"capsnet predict: error: {server.target}: INVALID_ARGUMENT: {bad}: "
                                               "cannot decode (19 bytes): expected a PNG or JPEG file")


def test_predict_into_a_closed_pipe_stops_quietly(server, tmp_path):
    """`capsnet predict --json | head -c 1`: the reader is gone before the answer is printed."""
    reader, writer = os.pipe()
    os.close(reader)  # closed before the child writes: its first write fails with EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "capsnet", "predict", *write_pngs(tmp_path, 3), "--server",
                              server.target, "--json"], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert run.returncode == 141 and run.stderr == ""


def test_predict_against_no_server_is_a_one_line_error(tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["predict", *write_pngs(tmp_path, 1), "--server", f"127.0.0.1:{port}", "--timeout", "5"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet predict: error: ")]
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"capsnet predict: error: 127.0.0.1:{port}: UNAVAILABLE: ")


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian package) is not installed")
def test_prometheus_scrapes_the_server_and_computes_a_latency_quantile(model_dir, tmp_path):
    served = ServeProcess("--model", str(model_dir))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: capsnet\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{served.metrics_port}']\n")
    prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop_load = threading.Event()

    def load() -> None:  # steady traffic, so rate() over the scrapes is non-zero
        with grpc.insecure_channel(served.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            while not stop_load.is_set():
                stub.Classify(pb.ClassifyRequest(images=[image_message(IMAGE)]), timeout=10)
                time.sleep(0.02)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    query = ('histogram_quantile(0.9, sum by (le) '
             '(rate(capsnet_request_duration_seconds_bucket{method="Classify"}[1m])))')
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    value = None
    try:
        deadline = time.monotonic() + 90
        while value is None and time.monotonic() < deadline:
            time.sleep(1)
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    answer = json.load(response)
            except OSError:  # Prometheus still starting
                continue
            results = answer["data"]["result"]
            if answer["status"] == "success" and results and math.isfinite(float(results[0]["value"][1])):
                value = float(results[0]["value"][1])
    finally:
        stop_load.set()
        loader.join(15)
        prometheus.terminate()
        prometheus.wait(30)
        served.stop()
    assert value is not None, "Prometheus never returned the quantile"
    assert 0 < value < 10
