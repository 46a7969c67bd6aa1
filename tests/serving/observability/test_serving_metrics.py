"""Prometheus metrics change as requests are served, for every API, and the exposition is valid."""

from __future__ import annotations

import queue
import shutil
import subprocess
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import ServerThread, metric, scrape, server_config, wait_until

from capsnet.client.api import image_message
from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

IMAGES = np.random.default_rng(3).random((3, 1, 28, 28), dtype=np.float32)  # (3, 1, 28, 28)


def test_metrics_change_as_requests_are_served(server, stub, channel):
    before = scrape(server.metrics_url)
    stub.Classify(pb.ClassifyRequest(images=[image_message(i) for i in IMAGES]), timeout=30)
    with pytest.raises(grpc.RpcError):
        stub.Classify(pb.ClassifyRequest(), timeout=30)
    kserve_grpc.GRPCInferenceServiceStub(channel).ServerLive(kserve_pb.ServerLiveRequest(), timeout=30)

    ok = {"api": "capsnet", "method": "Classify", "code": "OK"}
    invalid = {"api": "capsnet", "method": "Classify", "code": "INVALID_ARGUMENT"}
    live = {"api": "kserve", "method": "ServerLive", "code": "OK"}
    # Requests are counted when they end, just after the client has its answer.
    wait_until(lambda: metric(scrape(server.metrics_url), "capsnet_requests_total", **live)
               == metric(before, "capsnet_requests_total", **live) + 1)
    after = scrape(server.metrics_url)
    assert metric(after, "capsnet_requests_total", **ok) == metric(before, "capsnet_requests_total", **ok) + 1
    assert metric(after, "capsnet_requests_total", **invalid) == metric(before, "capsnet_requests_total", **invalid) + 1
    duration = "capsnet_request_duration_seconds_count"
    assert metric(after, duration, api="capsnet", method="Classify") \
        == metric(before, duration, api="capsnet", method="Classify") + 2
    assert metric(after, "capsnet_request_duration_seconds_sum", api="capsnet") \
        > metric(before, "capsnet_request_duration_seconds_sum", api="capsnet")
    assert metric(after, "capsnet_images_total") == metric(before, "capsnet_images_total") + 3
    for name in ("capsnet_queue_wait_seconds_count", "capsnet_compute_seconds_count", "capsnet_batch_size_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "capsnet_inflight_requests") == 0 and metric(after, "capsnet_queue_depth") == 0
    assert metric(after, "capsnet_model_info", model="capsnet", version="1", backend="onnxruntime", precision="fp32",
                  routing_iterations="3") == 1
    assert metric(after, "process_cpu_seconds_total") > 0 and metric(after, "process_resident_memory_bytes") > 0


def test_open_health_watches_are_not_requests_in_flight(server, channel):
    """A load balancer keeps a health Watch open per replica: the in-flight gauge (the HPA's metric) must not
    read it as load, while a unary call in flight would count."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    try:
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # the stream is open
        samples = scrape(server.metrics_url)
        assert metric(samples, "capsnet_inflight_requests") == 0
    finally:
        watch.cancel()


def test_a_stream_counts_its_requests_in_flight_not_itself(model_dir):
    """The HPA scales on the in-flight gauge: an idle ClassifyStream is no load (it counted 1 for its whole life),
    while each request it sent counts until it is answered. The batcher holds them up to its 3 s queue delay."""
    running = ServerThread(server_config(model_dir, max_queue_delay_us=3_000_000))
    requests: queue.Queue = queue.Queue()
    try:
        with grpc.insecure_channel(running.target) as channel:
            responses = capsnet_pb2_grpc.CapsNetServiceStub(channel).ClassifyStream(iter(requests.get, None),
                                                                                    timeout=60)
            requests.put(pb.ClassifyRequest(images=[image_message(IMAGES[i % 3]) for i in range(8)]))  # a full batch
            assert len(next(responses).results) == 8  # answered at once: the stream is open, and idle now
            wait_until(lambda: metric(scrape(running.metrics_url), "capsnet_inflight_requests") == 0, timeout=2)
            for image in IMAGES:  # 3 requests of 1 image wait for a batch of 8
                requests.put(pb.ClassifyRequest(images=[image_message(image)]))
            wait_until(lambda: metric(scrape(running.metrics_url), "capsnet_queue_depth") == 3)
            assert metric(scrape(running.metrics_url), "capsnet_inflight_requests") == 3
            assert len([next(responses) for _ in IMAGES]) == 3
            wait_until(lambda: metric(scrape(running.metrics_url), "capsnet_inflight_requests") == 0)
            requests.put(None)
            assert list(responses) == []
    finally:
        requests.put(None)
        running.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) is not installed")
def test_exposition_passes_promtool(server, stub):
    stub.Classify(pb.ClassifyRequest(images=[image_message(IMAGES[0])]), timeout=30)
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        exposition = response.read()
    assert b"capsnet_request_duration_seconds_bucket" in exposition
    result = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), (result.stdout + result.stderr).decode()
