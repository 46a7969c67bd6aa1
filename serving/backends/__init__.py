"""Backend choice: `--backend auto` takes the fastest one that can run here and logs why."""

from __future__ import annotations

import logging

from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import Backend
from capsnet.serving.config import ServerConfig

log = logging.getLogger(__name__)


def choose_backend(artifacts: ModelArtifacts, config: ServerConfig) -> tuple[str, str]:
    """(backend name, why): a TensorRT engine on its GPU, else ONNX Runtime (on its GPU providers if any).

    The torch backend is the reference, never the fastest, so auto does not pick it.
    """
    from capsnet.serving.backends.onnxruntime_backend import gpu_providers_installed
    from capsnet.tensorrt_runner import unavailable_reason

    if artifacts.tensorrt_plan is None:
        no_trt = "no TensorRT plan in the model directory"
    elif config.precision not in (None, artifacts.tensorrt_info["precision"]):
        no_trt = f"the TensorRT plan is {artifacts.tensorrt_info['precision']}, --precision {config.precision} was asked"
    else:
        no_trt = unavailable_reason(config.gpu)
        if no_trt is None:
            return "tensorrt", "a TensorRT plan and a CUDA GPU are present"
    gpu = gpu_providers_installed()
    where = f"with {' and '.join(gpu)}" if gpu else "on the CPU (onnxruntime-gpu not installed)"
    return "onnxruntime", f"{where}; not tensorrt: {no_trt}"


def load_backend(artifacts: ModelArtifacts, config: ServerConfig) -> Backend:
    name = config.backend
    if name == "auto":
        name, why = choose_backend(artifacts, config)
        log.info("backend auto: %s %s", name, why)
    if name == "tensorrt":
        from capsnet.serving.backends.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(artifacts, config.precision, config.max_batch_size, config.gpu)
    if name == "torch":
        from capsnet.serving.backends.torch_backend import TorchBackend

        return TorchBackend(artifacts, config.precision or "fp32", config.intra_op_threads)
    from capsnet.serving.backends.onnxruntime_backend import OnnxRuntimeBackend

    return OnnxRuntimeBackend(artifacts, config.precision or "fp32", config.intra_op_threads, config.max_batch_size)
