"""Serving test fixtures: one exported tiny model and an in-process server shared by the session."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from capsnet.v1 import capsnet_pb2_grpc
from serving_helpers import ServerThread, server_config


@pytest.fixture(scope="session")
def model_dir(random_tiny_export) -> Path:
    """The tiny model exported with its reconstruction output, shared by every serving test."""
    return random_tiny_export


@pytest.fixture(scope="session")
def int8_model_dir(int8_tiny_export) -> Path:
    """The trained tiny model exported with INT8, for the self-check and precision-gate tests."""
    return int8_tiny_export


@pytest.fixture(scope="session")
def server(model_dir):
    running = ServerThread(server_config(model_dir))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def any_size_server(shared_tiny_export):
    """A server of the `shared-tiny` export, a model of any image size, at FP32 (the answers are compared with the
    FP32 graph)."""
    running = ServerThread(server_config(shared_tiny_export, precision="fp32"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel):
    return capsnet_pb2_grpc.CapsNetServiceStub(channel)
