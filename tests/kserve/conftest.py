"""One in-process capsnet server for the kserve tests, on an ephemeral loopback port, with a tiny exported model."""

import asyncio
import threading

import grpc
import numpy as np
import onnxruntime
import pytest

from capsnet.export.exporter import export_model
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.serving.config import ServerConfig
from capsnet.serving.server import CapsNetServer

MAX_BATCH_SIZE = 8  # test_kserve_errors sends 9 images to cross it


@pytest.fixture(scope="session")
def kserve_model_dir(random_tiny_checkpoint, tmp_path_factory):
    """The tiny preset exported with the reconstruction output, so every output can be asked for."""
    out = tmp_path_factory.mktemp("kserve") / "model"
    export_model(random_tiny_checkpoint, out, reconstruction=True)
    return out


@pytest.fixture(scope="session")
def kserve_target(kserve_model_dir):
    """host:port of a started CapsNetServer, its event loop on a background thread."""
    config = ServerConfig(model_dir=kserve_model_dir, grpc_port=0, metrics_port=0, backend="onnxruntime",
                          max_batch_size=MAX_BATCH_SIZE, threads=1, drain_window_s=0.0, grace_period_s=1.0)
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
