"""The server's phase (serving/lifecycle.py) as every part reads it: a backend that can run no more batches fails
that batch's requests with INTERNAL/500 and takes the whole server out of service, on gRPC health, KServe's live
and ready (gRPC and REST) and new requests alike; and the moves the phase may make."""

from __future__ import annotations

import asyncio
import http.client

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import ServerThread, metric, scrape, server_config

from capsnet.client.api import image_message
from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_pb_grpc
from capsnet.serving.errors import BackendUnusable
from capsnet.serving.lifecycle import Lifecycle, Phase
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

IMAGE = np.random.default_rng(23).random((1, 28, 28), dtype=np.float32)  # (1, 28, 28)


def rest_status(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_backend_that_can_run_no_more_fails_its_batch_and_stops_serving(model_dir):
    running = ServerThread(server_config(model_dir))
    try:
        def lost(images):
            raise BackendUnusable("CUDA error: an illegal memory access was encountered")

        running.server.service.backend.run = lost
        request = pb.ClassifyRequest(images=[image_message(IMAGE)])
        with grpc.insecure_channel(running.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            kserve = kserve_pb_grpc.GRPCInferenceServiceStub(channel)
            assert kserve.ServerLive(kserve_pb.ServerLiveRequest(), timeout=10).live
            with pytest.raises(grpc.RpcError) as failed:
                stub.Classify(request, timeout=30)
            assert (failed.value.code(), failed.value.details()) == (
                grpc.StatusCode.INTERNAL, "the onnxruntime backend failed: CUDA error: an illegal memory access was "
                                          "encountered")
            for service in ("", "capsnet.v1.CapsNetService", "inference.GRPCInferenceService"):
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            assert not kserve.ServerLive(kserve_pb.ServerLiveRequest(), timeout=10).live
            assert not kserve.ServerReady(kserve_pb.ServerReadyRequest(), timeout=10).ready
            with pytest.raises(grpc.RpcError) as refused:
                stub.Classify(request, timeout=30)
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.UNAVAILABLE, "the server cannot serve: the onnxruntime backend failed: CUDA error: an "
                                             "illegal memory access was encountered; retry on another replica")
        port = running.server.http_port
        assert (rest_status(port, "/v2/health/live"), rest_status(port, "/v2/health/ready")) == (400, 400)
        samples = scrape(running.metrics_url)
        for code in ("INTERNAL", "UNAVAILABLE"):
            assert metric(samples, "capsnet_requests_total", method="Classify", code=code) == 1, code
    finally:
        running.stop()
    assert running.server.lifecycle.phase is Phase.STOPPED


def test_the_phase_moves_only_forward():
    async def moves() -> list[str]:
        lifecycle, seen = Lifecycle(), []

        async def record(phase: Phase) -> None:
            seen.append(phase.value)

        lifecycle.on_change(record)
        with pytest.raises(RuntimeError, match="cannot go from starting to stopped"):
            await lifecycle.move(Phase.STOPPED)
        await lifecycle.move(Phase.SERVING)
        await lifecycle.fail("the device is gone")
        await lifecycle.fail("and again")  # once: the first reason stays
        await lifecycle.move(Phase.DRAINING)
        await lifecycle.fail("during the shutdown")  # ignored: the shutdown goes on
        with pytest.raises(RuntimeError, match="cannot go from draining to serving"):
            await lifecycle.move(Phase.SERVING)
        await lifecycle.move(Phase.STOPPED)
        assert lifecycle.failure == "the device is gone" and lifecycle.refusing.is_set()
        return seen

    assert asyncio.run(moves()) == ["serving", "failed", "draining", "stopped"]

