"""TensorRT: runs the serialized engine (model.plan) with pinned host buffers and a CUDA stream.

An engine only runs on the TensorRT version and GPU it was built for, so model.plan.json is checked
against this machine before the plan is deserialized: a mismatch is a clear startup error instead of
a deserialization failure (or silently slow kernels on a different GPU model).
CUDA calls go through cuda-python (`pip install capsnet-serve[gpu]`).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import Backend

log = logging.getLogger(__name__)


def _cudart():
    """The CUDA runtime bindings of cuda-python (ImportError when not installed)."""
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart as runtime
    return runtime


def _check(result):
    """cuda-python returns (error, *values): raise on error, else the value(s)."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else tuple(values)


def unavailable_reason() -> str | None:
    """Why the TensorRT backend cannot run here, or None when it can."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt package is not installed (pip install 'capsnet-serve[gpu]')"
    try:
        cudart = _cudart()
    except ImportError:
        return "cuda-python is not installed (pip install 'capsnet-serve[gpu]')"
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count == 0:
        return "no CUDA GPU"
    return None


def _device() -> tuple[str, str]:
    """(name, compute capability "major.minor") of CUDA device 0."""
    props = _check(_cudart().cudaGetDeviceProperties(0))
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00"), f"{props.major}.{props.minor}"


class _Binding:
    """One engine input/output: a pinned host buffer and a device buffer sized for the largest batch."""

    def __init__(self, cudart, dtype: np.dtype, row_shape: tuple[int, ...], max_batch: int):
        nbytes = max_batch * int(np.prod(row_shape)) * dtype.itemsize
        self.host_ptr = _check(cudart.cudaMallocHost(nbytes))
        self.device_ptr = _check(cudart.cudaMalloc(nbytes))
        buffer = (ctypes.c_byte * nbytes).from_address(int(self.host_ptr))
        self.host = np.frombuffer(buffer, dtype=dtype).reshape(max_batch, *row_shape)  # (max_batch, ...)


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, artifacts: ModelArtifacts, precision: str | None, max_batch_size: int):
        plan, info = artifacts.tensorrt_plan, artifacts.tensorrt_info
        if plan is None:
            raise CapsNetError(f"{artifacts.directory} has no TensorRT plan; export it with --tensorrt on the serving GPU")
        problem = unavailable_reason()
        if problem:
            raise CapsNetError(f"the tensorrt backend cannot run here: {problem}")
        import tensorrt as trt

        cudart = _cudart()
        gpu_name, capability = _device()
        self._check_plan_matches(plan, info, trt.__version__, gpu_name, capability)
        if precision not in (None, info["precision"]):
            raise CapsNetError(f"{plan} is a {info['precision']} engine; --precision {precision} needs another export")
        if int(info["min_batch"]) != 1 or max_batch_size > int(info["max_batch"]):
            raise CapsNetError(f"the engine takes batches of {info['min_batch']} to {info['max_batch']} images, the batcher "
                               f"makes 1 to --max-batch-size {max_batch_size}; lower it or re-export")
        self.precision = info["precision"]
        self.output_names = artifacts.output_names
        self.input_name = artifacts.input_name
        self._cudart = cudart

        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise CapsNetError(f"{plan} could not be deserialized (damaged, or built by another TensorRT)")
        self.context = self.engine.create_execution_context()
        self.stream = _check(cudart.cudaStreamCreate())
        # Every engine input/output needs an address, served or not; buffers are sized once, for the largest batch.
        self.bindings: dict[str, _Binding] = {}
        for index in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(index)
            row_shape = tuple(self.engine.get_tensor_shape(name))[1:]  # batch axis is dynamic (-1)
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            self.bindings[name] = _Binding(cudart, dtype, row_shape, max_batch_size)
            self.context.set_tensor_address(name, int(self.bindings[name].device_ptr))
        missing = [name for name in (self.input_name, *self.output_names) if name not in self.bindings]
        if missing:
            raise CapsNetError(f"{plan} has no tensors {', '.join(missing)} (listed in model.json); re-export")
        self.description = f"{plan.name} ({self.precision}) on {gpu_name}, TensorRT {trt.__version__}"

    @staticmethod
    def _check_plan_matches(plan, info: dict, trt_version: str, gpu_name: str, capability: str) -> None:
        if info["tensorrt_version"] != trt_version:
            raise CapsNetError(f"{plan} was built with TensorRT {info['tensorrt_version']}, this machine has {trt_version}; "
                               "re-export with --tensorrt here")
        if str(info["compute_capability"]) != capability:
            raise CapsNetError(f"{plan} was built for {info['gpu_name']} (compute capability {info['compute_capability']}), "
                               f"this GPU is {gpu_name} ({capability}); re-export with --tensorrt on this GPU")
        if info["gpu_name"] != gpu_name:
            # Same architecture: TensorRT loads it, but kernels were timed on the other model.
            log.warning("%s was built on %s, running on %s: re-export on this GPU for best speed",
                        plan, info["gpu_name"], gpu_name)

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        cudart, batch = self._cudart, images.shape[0]
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        source = self.bindings[self.input_name]
        source.host[:batch] = images  # into pinned memory, so the copy below is a true async DMA
        _check(cudart.cudaMemcpyAsync(source.device_ptr, source.host_ptr, source.host[:batch].nbytes, to_device, self.stream))
        self.context.set_input_shape(self.input_name, images.shape)
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execution failed")
        for name in self.output_names:
            out = self.bindings[name]
            _check(cudart.cudaMemcpyAsync(out.host_ptr, out.device_ptr, out.host[:batch].nbytes, to_host, self.stream))
        _check(cudart.cudaStreamSynchronize(self.stream))
        # Copies: the pinned buffers are reused by the next batch.
        return {name: self.bindings[name].host[:batch].astype(np.float32) for name in self.output_names}
