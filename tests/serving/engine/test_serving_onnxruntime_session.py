"""The ONNX Runtime backend's session as the server runs it."""

from __future__ import annotations

import numpy as np

from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends.onnxruntime_backend import OnnxRuntimeBackend


def test_onnxruntime_backend_threads_sleep_between_runs(model_dir):
    """Intra-op threads that spin keep burning the cores between requests, which the server's RPC threads need."""
    backend = OnnxRuntimeBackend(load_artifacts(model_dir), "fp32", threads=2, max_batch_size=8)
    options = backend.session.get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    images = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    assert backend.run(images)["probabilities"].shape == (3, 10)


def test_gpu_providers_run_on_the_device_that_serve_gpu_names(model_dir, monkeypatch):
    """`capsnet serve --gpu N` reaches ONNX Runtime's TensorRT and CUDA providers, which otherwise take device 0.
    onnxruntime-gpu cannot be installed here, so this checks the provider list the session is given."""
    from capsnet.serving.engine.backends import onnxruntime_backend

    monkeypatch.setattr(onnxruntime_backend, "gpu_providers_installed",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider"])
    providers = OnnxRuntimeBackend._providers(load_artifacts(model_dir), "fp32", max_batch_size=8, gpu=3)
    (tensorrt, tensorrt_options), (cuda, cuda_options), cpu = providers
    assert (tensorrt, cuda, cpu) == ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
    assert tensorrt_options["device_id"] == 3 and cuda_options == {"device_id": 3}
