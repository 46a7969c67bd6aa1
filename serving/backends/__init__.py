"""Backend and precision choice: `--backend auto` takes the fastest backend that can run here,
`--precision auto` the fastest precision whose self-check passes on this machine; both log why.

On a GPU host without a usable TensorRT plan, auto loads every GPU candidate (the fused routing kernels, torch with
CUDA graphs, ONNX Runtime's GPU providers where installed; see gpu_candidates), self-checks each, times each on a
full batch and serves the fastest; a reduced precision must beat FP32 by AUTO_MIN_SPEEDUP. None passing: the CPU.

Every backend is self-checked on the export's reference images before the server reports SERVING
(serving/self_check.py): a backend that fails is refused with one line, never served.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, replace

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backend_registry import BACKEND_KINDS
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


def gpu_host() -> bool:
    """Whether an NVIDIA driver is there (its /proc entry, or in a container its device node); only then is torch
    asked about CUDA, so that a server on a CPU host that serves ONNX Runtime never imports torch."""
    return any(os.path.exists(path) for path in ("/proc/driver/nvidia/version", "/dev/nvidiactl"))


def choose_backend(artifacts: ModelArtifacts, config: ServerConfig) -> tuple[str | None, str]:
    """(backend name, why): "tensorrt" for a TensorRT plan on its GPU, else None on a host with a CUDA GPU (the
    fastest of gpu_candidates() is measured next), else "onnxruntime" (on its GPU providers if any)."""
    from capsnet.serving.backends.onnxruntime_backend import gpu_providers_installed
    from capsnet.runtime.tensorrt_runner import unavailable_reason

    no_trt: str | None
    if artifacts.tensorrt_plan is None or artifacts.tensorrt_info is None:  # both or neither: see load_artifacts
        no_trt = "no TensorRT plan in the model directory"
    elif config.precision not in ("auto", artifacts.tensorrt_info["precision"]):
        no_trt = (f"the TensorRT plan is {artifacts.tensorrt_info['precision']}, --precision {config.precision} "
                  "was asked")
    else:
        no_trt = unavailable_reason(config.gpu_or_first)
        if no_trt is None:
            return "tensorrt", "a TensorRT plan and a CUDA GPU are present"
    if gpu_host():
        from capsnet.runtime.torch_runner import cuda_unavailable_reason

        no_cuda = cuda_unavailable_reason(config.gpu_or_first)
        if no_cuda is None:
            return None, f"not tensorrt: {no_trt}"
        no_trt += f"; no GPU backend: {no_cuda}"
    gpu = gpu_providers_installed()
    where = f"with {' and '.join(gpu)}" if gpu else "on the CPU (onnxruntime-gpu not installed)"
    return "onnxruntime", f"{where}; not tensorrt: {no_trt}"


def create_backend(name: str, precision: str, artifacts: ModelArtifacts, config: ServerConfig) -> Backend:
    return BACKEND_KINDS[name].backend_class().create(artifacts, precision, config)


def checked(backend: Backend, artifacts: ModelArtifacts, config: ServerConfig) -> SelfCheck:
    check = self_check(backend, artifacts.reference, config.max_batch_size, artifacts)
    log.info("self-check %s: %s", "passed" if check.passed else "FAILED", check.describe())
    return check


def load_backend(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    """The backend to serve with, self-checked; CapsNetError if it cannot load or fails its self-check."""
    name, why = config.backend, "asked for"
    if name == "auto":
        chosen, why = choose_backend(artifacts, config)
        if chosen is None:
            loaded = _fastest_gpu_backend(artifacts, replace(config, gpu=config.gpu_or_first), why)
            if loaded is not None:
                return loaded
            chosen, why = "onnxruntime", "on the CPU: no GPU backend passed its self-check (logged above)"
        name = chosen
        log.info("backend auto: %s %s", name, why)
    if name == "onnxruntime" and config.precision == "auto":
        return _choose_onnxruntime_precision(artifacts, config)
    backend = create_backend(name, config.precision, artifacts, config)
    check = checked(backend, artifacts, config)
    if not check.passed:
        raise refusal(check)
    return LoadedBackend(backend, check, f"{name}: {why}")


def gpu_candidates(artifacts: ModelArtifacts, config: ServerConfig) -> list[tuple[str, str]]:
    """(backend, precision) pairs that can serve on the GPU: the fused kernels where model.json says the model's
    routing runs in them and triton is installed, torch in every precision, ONNX Runtime's exported precisions
    where onnxruntime-gpu is installed. Not the CUDA AOTInductor packages: one loaded in the process that had
    captured the torch backend's CUDA graphs died of a segmentation fault on an H100 (torch 2.11), so they serve
    only when asked for by name."""
    from capsnet.serving.backends.onnxruntime_backend import gpu_providers_installed

    precisions = ("fp32", "fp16", "bf16", "int8") if config.precision == "auto" else (config.precision,)
    candidates = []
    if artifacts.routing.get("gpu_engine") == "fused" and importlib.util.find_spec("triton") is not None:
        candidates += [("fused", p) for p in precisions if p != "int8"]
    candidates += [("torch", p) for p in precisions if p != "int8"]
    if gpu_providers_installed():
        candidates += [("onnxruntime", p) for p in precisions if p in artifacts.onnx]
    return candidates


def _fastest_gpu_backend(artifacts: ModelArtifacts, config: ServerConfig, why: str) -> LoadedBackend | None:
    """Every GPU candidate loaded and self-checked, the fastest of those passing (`_fastest`), or None when none
    passes."""
    passed, refused = [], []
    for name, precision in gpu_candidates(artifacts, config):
        try:
            backend = create_backend(name, precision, artifacts, config)
            check = checked(backend, artifacts, config)
        except Exception as err:  # CapsNetError, or torch's own (a failed graph capture): the next candidate
            refused.append(f"{name} {precision}: {err if isinstance(err, CapsNetError) else repr(err)[:300]}")
            continue
        if check.passed:
            passed.append((backend, check))
        else:
            refused.append(f"{name} {precision}: {refusal(check)}")
            backend.close()
    for reason in refused:
        log.warning("backend auto: GPU %d candidate refused: %s", config.gpu, reason)
    if not passed:
        return None
    best, times = _fastest([backend for backend, _ in passed], artifacts, config)
    backend, check = passed[best]
    table = ", ".join(f"{passed[index][0].name} {passed[index][0].precision} {1e3 * times[index]:.2f} ms"
                      for index in sorted(range(len(passed)), key=times.__getitem__))
    choice = (f"{backend.name} {backend.precision} on GPU {config.gpu}, the fastest of those passing their self-check "
              f"at batch {config.max_batch_size} ({table}){'; refused: ' + str(len(refused)) if refused else ''}; "
              f"{why}")
    log.info("backend auto: %s", choice)
    return LoadedBackend(backend, check, choice)


def _choose_onnxruntime_precision(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    """INT8 where it was exported, passes its self-check here and is measurably faster here (`_fastest`); else
    FP32."""
    fp32 = create_backend("onnxruntime", "fp32", artifacts, config)
    fp32_check = checked(fp32, artifacts, config)
    if not fp32_check.passed:
        raise refusal(fp32_check)
    if "int8" not in artifacts.onnx:
        return _auto(fp32, fp32_check, "no INT8 model in the export")
    int8 = create_backend("onnxruntime", "int8", artifacts, config)
    int8_check = checked(int8, artifacts, config)
    if not int8_check.passed:
        int8.close()
        return _auto(fp32, fp32_check, f"the INT8 self-check failed on this CPU: {refusal(int8_check)}", warn=True)
    best, (fp32_time, int8_time) = _fastest([fp32, int8], artifacts, config)
    timing = (f"batch {config.max_batch_size}: INT8 {1e3 * int8_time:.1f} ms, FP32 {1e3 * fp32_time:.1f} ms "
              f"({fp32_time / int8_time:.2f}x)")
    if best == 0:
        return _auto(fp32, fp32_check, f"INT8 is not {AUTO_MIN_SPEEDUP:g}x faster here ({timing})")
    return _auto(int8, int8_check, f"INT8 passed its self-check and is faster here ({timing})")


def _fastest(backends: list[Backend], artifacts: ModelArtifacts, config: ServerConfig) -> tuple[int, list[float]]:
    """The one chooser of both autos: each backend run once (allocations and kernel choices), then timed in turns on
    a --max-batch-size batch, best of AUTO_TIMING_ROUNDS; the fastest, except that a reduced precision serves only
    when AUTO_MIN_SPEEDUP x faster than the fastest FP32 (one that is not clearly faster changes answers for
    nothing). Returns its index and every backend's time; the others are closed."""
    images = np.zeros((config.max_batch_size, *artifacts.input_shape), dtype=np.float32)  # (B, C, H, W)
    for backend in backends:
        backend.run(images)
    times = best_times(backends, images, AUTO_TIMING_ROUNDS)
    order = sorted(range(len(backends)), key=times.__getitem__)
    best = order[0]
    fp32 = [index for index in order if backends[index].precision == "fp32"]
    if fp32 and backends[best].precision != "fp32" and times[best] * AUTO_MIN_SPEEDUP > times[fp32[0]]:
        best = fp32[0]
    for index, backend in enumerate(backends):
        if index != best:
            backend.close()
    return best, times


def _auto(backend: Backend, check: SelfCheck, why: str, warn: bool = False) -> LoadedBackend:
    log.log(logging.WARNING if warn else logging.INFO, "precision auto: %s: %s", backend.precision, why)
    return LoadedBackend(backend, check, f"onnxruntime, precision auto: {why}")
