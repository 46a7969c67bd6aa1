"""The TensorRT backend on a real GPU (skipped without one): parity with ONNX Runtime, `auto` picks
it, and an engine built for another GPU is refused at startup."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from serving_helpers import ServerThread, onnxruntime_reference, server_config

from capsnet.cli import main
from capsnet.client.api import CapsNetClient
from capsnet.runtime.tensorrt_runner import unavailable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")]


@pytest.fixture(scope="module")
def tensorrt_model_dir(random_tiny_checkpoint, tmp_path_factory):
    from capsnet.export.exporter import export_model

    out = tmp_path_factory.mktemp("served-trt") / "model"
    export_model(random_tiny_checkpoint, out, reconstruction=True, tensorrt=True)
    return out


def test_auto_serves_the_engine_and_matches_onnxruntime(tensorrt_model_dir):
    images = np.random.default_rng(6).random((8, 1, 28, 28), dtype=np.float32)  # (8, 1, 28, 28)
    running = ServerThread(server_config(tensorrt_model_dir, backend="auto"))
    try:
        assert running.server.service.spec.backend == "tensorrt"
        with CapsNetClient(running.target) as client:
            predictions = client.classify(list(images), reconstruction=True)
    finally:
        running.stop()
    expected = onnxruntime_reference(tensorrt_model_dir, images)
    got = np.stack([p.probabilities for p in predictions])  # (8, J)
    # fp32 engines may use TF32 tensor cores: close, not bit-equal.
    np.testing.assert_allclose(got, expected["probabilities"], rtol=0, atol=5e-3)
    np.testing.assert_allclose(np.stack([p.poses for p in predictions]), expected["poses"], rtol=0, atol=5e-3)


def test_engine_for_another_gpu_is_refused_at_startup(tensorrt_model_dir, tmp_path, capsys):
    copy = tmp_path / "model"
    shutil.copytree(tensorrt_model_dir, copy)
    info = json.loads((copy / "model.plan.json").read_text())
    (copy / "model.plan.json").write_text(json.dumps({**info, "gpu_name": "Imaginary GPU",
                                                      "compute_capability": "1.0"}))
    code = main(["serve", "--model", str(copy), "--backend", "tensorrt", "--grpc-port", "0", "--http-port", "0",
                 "--metrics-port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1
    assert "was built for Imaginary GPU (compute capability 1.0)" in errors[0] \
        and "re-export with --tensorrt on this GPU" in errors[0]
