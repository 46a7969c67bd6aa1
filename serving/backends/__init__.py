"""Backend and precision choice: `--backend auto` takes the fastest backend that can run here,
`--precision auto` the fastest precision whose self-check passes on this CPU; both log why.

Every backend is self-checked on the export's reference images before the server reports SERVING
(serving/self_check.py): a backend that fails is refused with one line, never served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import Backend
from capsnet.serving.config import ServerConfig
from capsnet.serving.self_check import SelfCheck, best_times, refusal, self_check

log = logging.getLogger(__name__)

# --precision auto serves INT8 only when it is at least this much faster than FP32 at warm-up:
# the margin keeps timing noise from flipping the choice between runs.
AUTO_MIN_SPEEDUP = 1.1
AUTO_TIMING_ROUNDS = 5


@dataclass
class LoadedBackend:
    backend: Backend
    check: SelfCheck  # the self-check it passed
    why: str  # why this backend and precision


def choose_backend(artifacts: ModelArtifacts, config: ServerConfig) -> tuple[str, str]:
    """(backend name, why): a TensorRT engine on its GPU, else ONNX Runtime (on its GPU providers if any).

    The torch backend is the reference, never the fastest, so auto does not pick it.
    """
    from capsnet.serving.backends.onnxruntime_backend import gpu_providers_installed
    from capsnet.tensorrt_runner import unavailable_reason

    if artifacts.tensorrt_plan is None:
        no_trt = "no TensorRT plan in the model directory"
    elif config.precision not in ("auto", artifacts.tensorrt_info["precision"]):
        no_trt = f"the TensorRT plan is {artifacts.tensorrt_info['precision']}, --precision {config.precision} was asked"
    else:
        no_trt = unavailable_reason(config.gpu)
        if no_trt is None:
            return "tensorrt", "a TensorRT plan and a CUDA GPU are present"
    gpu = gpu_providers_installed()
    where = f"with {' and '.join(gpu)}" if gpu else "on the CPU (onnxruntime-gpu not installed)"
    return "onnxruntime", f"{where}; not tensorrt: {no_trt}"


def create_backend(name: str, precision: str, artifacts: ModelArtifacts, config: ServerConfig) -> Backend:
    if name == "tensorrt":
        from capsnet.serving.backends.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(artifacts, None if precision == "auto" else precision, config.max_batch_size, config.gpu)
    if name == "torch":
        from capsnet.serving.backends.torch_backend import TorchBackend

        return TorchBackend(artifacts, "fp32" if precision == "auto" else precision, config.intra_op_threads)
    from capsnet.serving.backends.onnxruntime_backend import OnnxRuntimeBackend

    return OnnxRuntimeBackend(artifacts, precision, config.intra_op_threads, config.max_batch_size, config.gpu)


def checked(backend: Backend, artifacts: ModelArtifacts, config: ServerConfig) -> SelfCheck:
    check = self_check(backend, artifacts.reference, config.max_batch_size, artifacts)
    log.info("self-check %s: %s", "passed" if check.passed else "FAILED", check.describe())
    return check


def load_backend(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    """The backend to serve with, self-checked; CapsNetError if it cannot load or fails its self-check."""
    name, why = config.backend, "asked for"
    if name == "auto":
        name, why = choose_backend(artifacts, config)
        log.info("backend auto: %s %s", name, why)
    if name == "onnxruntime" and config.precision == "auto":
        return _choose_onnxruntime_precision(artifacts, config)
    backend = create_backend(name, config.precision, artifacts, config)
    check = checked(backend, artifacts, config)
    if not check.passed:
        raise refusal(check)
    return LoadedBackend(backend, check, f"{name}: {why}")


def _choose_onnxruntime_precision(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    """INT8 where it was exported, passes its self-check here and is measurably faster here; else FP32."""
    fp32 = create_backend("onnxruntime", "fp32", artifacts, config)
    fp32_check = checked(fp32, artifacts, config)
    if not fp32_check.passed:
        raise refusal(fp32_check)
    if "int8" not in artifacts.onnx:
        return _auto(fp32, fp32_check, "no INT8 model in the export")
    int8 = create_backend("onnxruntime", "int8", artifacts, config)
    int8_check = checked(int8, artifacts, config)
    if not int8_check.passed:
        return _auto(fp32, fp32_check, f"the INT8 self-check failed on this CPU: {refusal(int8_check)}", warn=True)
    images = np.zeros((config.max_batch_size, *artifacts.input_shape), dtype=np.float32)  # (B, C, H, W)
    for backend in (fp32, int8):
        backend.run(images)  # first runs allocate and pick kernels
    fp32_time, int8_time = best_times([fp32, int8], images, AUTO_TIMING_ROUNDS)
    timing = (f"batch {config.max_batch_size}: INT8 {1e3 * int8_time:.1f} ms, FP32 {1e3 * fp32_time:.1f} ms "
              f"({fp32_time / int8_time:.2f}x)")
    if fp32_time < AUTO_MIN_SPEEDUP * int8_time:
        return _auto(fp32, fp32_check, f"INT8 is not {AUTO_MIN_SPEEDUP:g}x faster here ({timing})")
    return _auto(int8, int8_check, f"INT8 passed its self-check and is faster here ({timing})")


def _auto(backend: Backend, check: SelfCheck, why: str, warn: bool = False) -> LoadedBackend:
    log.log(logging.WARNING if warn else logging.INFO, "precision auto: %s: %s", backend.precision, why)
    return LoadedBackend(backend, check, f"onnxruntime, precision auto: {why}")
