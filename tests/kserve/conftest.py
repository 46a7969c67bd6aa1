"""In-process capsnet servers for the kserve tests, on ephemeral loopback ports, with a tiny exported model: one
shared by all (kserve_target), and more with other settings on request (start_kserve)."""

import asyncio
import contextlib
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import onnxruntime
import pytest
from kserve_messages import MAX_BATCH_SIZE

from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.serving.config import ServerConfig
from capsnet.serving.transports.server import CapsNetServer

# The REST tests (test_kserve_http*.py) reuse the serving tests' helpers (ServerThread exposes every bound port;
# ServeProcess, scrape, metric, wait_until): their folder is on the path only when its own tests are collected.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))


@pytest.fixture(scope="session")
def kserve_model_dir(random_tiny_export):
    """The tiny preset exported with the reconstruction output, so every output can be asked for."""
    return random_tiny_export


@contextlib.contextmanager
def running_server(model_dir, **settings):
    """host:port of a started CapsNetServer (onnxruntime, 1 thread, `settings` over ours), its event loop on a
    background thread; stopped on exit."""
    config = ServerConfig(**{"model_dir": model_dir, "grpc_port": 0, "http_port": 0, "metrics_port": 0,
                             "backend": "onnxruntime", "max_batch_size": MAX_BATCH_SIZE, "threads": 1,
                             "drain_window_s": 0.0, "grace_period_s": 1.0, **settings})
    server = CapsNetServer(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kserve-test-server", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=120)
        yield f"127.0.0.1:{server.grpc_port}"
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture(scope="session")
def kserve_target(kserve_model_dir):
    """host:port of a started CapsNetServer, its event loop on a background thread."""
    with running_server(kserve_model_dir) as target:
        yield target


@pytest.fixture(scope="module")
def kserve_stub(kserve_target):
    with grpc.insecure_channel(kserve_target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="session")
def run_onnx(kserve_model_dir):
    """images -> {output name: array}, straight from ONNX Runtime on the served model.onnx."""
    session = onnxruntime.InferenceSession(str(kserve_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]

    def run(images: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(None, {"images": images})))

    return run


@pytest.fixture(scope="module")
def start_kserve(kserve_model_dir):
    """start_kserve(**settings) -> host:port of one more server of the same model with other ServerConfig settings,
    stopped at the end of the module."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(running_server(kserve_model_dir, **settings))


@pytest.fixture(scope="module")
def kserve_rest(kserve_model_dir):
    """A serving_helpers.ServerThread of the kserve model (onnxruntime, batches of MAX_BATCH_SIZE, a 0.5 ms queue
    delay, which the model config reports): `.server.http_port` for REST, `.target` for gRPC, `.metrics_url`."""
    from serving_helpers import ServerThread, server_config

    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", max_batch_size=MAX_BATCH_SIZE,
                                         max_queue_delay_us=500, grace_period_s=1.0))
    yield running
    running.stop()
