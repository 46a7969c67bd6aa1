"""The one TensorRT engine runner: the server's tensorrt backend serves with it and export's parity check
runs the freshly built engine with it, so the gate checks the code that serves.

An engine runs on one GPU (`gpu`, a CUDA device index as CUDA_VISIBLE_DEVICES numbers them), selected
before anything is allocated and again on every call, since the CUDA current device is per thread and
the batcher calls from its own worker thread. Inputs and outputs go through pinned host buffers (true
async copies) and device buffers sized once for the largest batch; close() frees them all.
CUDA calls go through cuda-python, TensorRT through its Python package (`pip install capsnet-serve[gpu]`).

NOT RUN: TensorRT cannot be installed on the machines this project is developed and tested on, so this
module has only been checked against labelled fakes of `tensorrt` and the CUDA runtime
(tests/export/test_export_tensorrt.py), never against a real engine.
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Any

import numpy as np

from capsnet.errors import CapsNetError


def cudart():
    """The CUDA runtime bindings of cuda-python (ImportError when not installed)."""
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart as runtime
    return runtime


def check(result):
    """cuda-python returns (error, *values): raise on error, else the value(s)."""
    err, *values = result
    if int(err) != 0:
        raise CapsNetError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def unavailable_reason(gpu: int = 0) -> str | None:
    """Why no TensorRT engine can be built or run on CUDA device `gpu` here, or None when it can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed (pip install 'capsnet-serve[gpu]')"
    try:
        runtime = cudart()
    except ImportError:
        return "cuda-python is not installed (pip install 'capsnet-serve[gpu]')"
    err, count = runtime.cudaGetDeviceCount()
    if int(err) != 0 or count == 0:
        return "no CUDA GPU"
    if not 0 <= gpu < count:
        return f"no CUDA GPU {gpu}: this machine has {count} (0 to {count - 1})"
    return None


def gpu_facts(gpu: int) -> tuple[str, str]:
    """(name, compute capability "major.minor") of CUDA device `gpu`, which also becomes this thread's current
    device."""
    runtime = cudart()
    check(runtime.cudaSetDevice(gpu))
    props = check(runtime.cudaGetDeviceProperties(gpu))
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00"), f"{props.major}.{props.minor}"


class _Binding:
    """One engine input/output: a pinned host buffer and a device buffer sized for the largest batch."""

    def __init__(self, runtime, dtype: np.dtype, row_shape: tuple[int, ...], max_batch: int):
        nbytes = max_batch * int(np.prod(row_shape)) * dtype.itemsize
        self.host_ptr = check(runtime.cudaMallocHost(nbytes))
        try:
            self.device_ptr = check(runtime.cudaMalloc(nbytes))
        except CapsNetError:
            check(runtime.cudaFreeHost(self.host_ptr))
            raise
        buffer = (ctypes.c_byte * nbytes).from_address(int(self.host_ptr))
        # ctypes arrays export the buffer protocol, which typeshed's ctypes.Array does not declare
        self.host = np.frombuffer(buffer, dtype=dtype).reshape(  # type: ignore[call-overload]
            max_batch, *row_shape)  # (max_batch, ...)

    def free(self, runtime) -> None:
        self.host = None  # the view dies with the pinned memory
        check(runtime.cudaFree(self.device_ptr))
        check(runtime.cudaFreeHost(self.host_ptr))


class EngineRunner:
    """Runs a serialized engine on CUDA device `gpu` for batches of 1 to `max_batch` images."""

    def __init__(self, plan: bytes, input_name: str, output_names: tuple[str, ...], max_batch: int, gpu: int = 0):
        import tensorrt as trt

        self.input_name, self.output_names, self.max_batch, self.gpu = input_name, tuple(output_names), max_batch, gpu
        self._cudart = cudart()
        self.bindings: dict[str, _Binding] = {}
        self.stream: Any = None  # a cudaStream_t, created below
        check(self._cudart.cudaSetDevice(gpu))
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise CapsNetError("the TensorRT engine could not be deserialized (damaged, or built by another TensorRT)")
        try:
            self.context = self.engine.create_execution_context()
            self.stream = check(self._cudart.cudaStreamCreate())
            # Every engine input/output needs an address, served or not.
            for index in range(self.engine.num_io_tensors):
                name = self.engine.get_tensor_name(index)
                row_shape = tuple(self.engine.get_tensor_shape(name))[1:]  # batch axis is dynamic (-1)
                dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
                self.bindings[name] = _Binding(self._cudart, dtype, row_shape, max_batch)
                self.context.set_tensor_address(name, int(self.bindings[name].device_ptr))
            missing = [name for name in (input_name, *self.output_names) if name not in self.bindings]
            if missing:
                raise CapsNetError(f"the engine has no tensors {', '.join(missing)}; re-export")
        except BaseException:
            self.close()
            raise

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """images (N, C, H, W), 1 <= N <= max_batch -> {output name: float32 (N, ...)}, the caller's to keep."""
        runtime, batch = self._cudart, images.shape[0]
        if not 1 <= batch <= self.max_batch:
            raise CapsNetError(f"the engine runs 1 to {self.max_batch} images at a time, got {batch}")
        check(runtime.cudaSetDevice(self.gpu))  # the current device is per thread
        to_device = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        to_host = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost
        source = self.bindings[self.input_name]
        source.host[:batch] = images  # into pinned memory, so the copy below is a true async DMA
        check(runtime.cudaMemcpyAsync(source.device_ptr, source.host_ptr, source.host[:batch].nbytes, to_device,
                                      self.stream))
        self.context.set_input_shape(self.input_name, tuple(images.shape))
        if not self.context.execute_async_v3(int(self.stream)):
            raise CapsNetError("TensorRT failed to run the engine")
        for name in self.output_names:
            out = self.bindings[name]
            check(runtime.cudaMemcpyAsync(out.host_ptr, out.device_ptr, out.host[:batch].nbytes, to_host, self.stream))
        check(runtime.cudaStreamSynchronize(self.stream))
        # Copies: the pinned buffers are reused by the next batch.
        return {name: self.bindings[name].host[:batch].astype(np.float32) for name in self.output_names}

    def close(self) -> None:
        """Free the buffers and the stream, then the engine; safe to call twice."""
        if getattr(self, "_cudart", None) is None:
            return
        runtime, self._cudart = self._cudart, None
        check(runtime.cudaSetDevice(self.gpu))
        if self.stream is not None:
            check(runtime.cudaStreamSynchronize(self.stream))  # no copy may still target a buffer freed below
        for binding in self.bindings.values():
            binding.free(runtime)
        self.bindings = {}
        if self.stream is not None:
            check(runtime.cudaStreamDestroy(self.stream))
            self.stream = None
        self.context = self.engine = self._runtime = None

    def __enter__(self) -> "EngineRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
