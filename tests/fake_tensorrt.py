"""FAKES, for unit checks only: stand-ins for the `tensorrt` package and cuda-python's CUDA runtime, which
cannot be installed on the machines this project is tested on. They model what capsnet.runtime.tensorrt_runner
relies on: per-thread current device, pinned and device allocations (real host memory, so copies move real
bytes), async copies, and an "engine" whose kernel is a known function of its input, so a runner that
moves the wrong bytes, uses the wrong device or leaks a buffer fails. They prove nothing about TensorRT."""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import threading
import types

import numpy as np

INPUT, OUTPUTS = "images", ("probabilities", "poses")  # the names export and serving use
ROW_SHAPES = {INPUT: (1, 2, 2), "probabilities": (3,), "poses": (3, 2)}


def kernel(images: np.ndarray, row_shapes: dict[str, tuple[int, ...]] = ROW_SHAPES) -> dict[str, np.ndarray]:
    """What the fake engine computes from (N, ...) images: each output row is the image's pixel sum times
    1, 2, 3, ..."""
    total = images.reshape(len(images), -1).sum(axis=1)  # (N,)
    return {name: (total[:, None] * np.arange(1, int(np.prod(row)) + 1, dtype=np.float32)).reshape(len(images), *row)
            for name, row in row_shapes.items() if name != INPUT}  # (N, *row)


class FakeCudaRuntime:
    class cudaMemcpyKind(enum.IntEnum):  # CUDA's names, as the runner calls them
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    def __init__(self, device_count: int = 2):
        self.device_count = device_count
        self._current = threading.local()
        self.host, self.device, self.streams = {}, {}, set()  # live allocations: address -> (buffer, device)
        self.freed = []

    def current(self) -> int:
        return getattr(self._current, "device", 0)

    def cudaGetDeviceCount(self):
        return 0, self.device_count

    def cudaSetDevice(self, device):
        if not 0 <= device < self.device_count:
            return 101, None  # cudaErrorInvalidDevice
        self._current.device = device
        return (0,)

    def cudaGetDeviceProperties(self, device):
        return 0, types.SimpleNamespace(name=f"Fake GPU {device}".encode() + b"\x00" * 4, major=9, minor=device)

    def _allocate(self, table, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        table[ctypes.addressof(buffer)] = (buffer, self.current())
        return 0, ctypes.addressof(buffer)

    def cudaMallocHost(self, nbytes):
        return self._allocate(self.host, nbytes)

    def cudaMalloc(self, nbytes):
        return self._allocate(self.device, nbytes)

    def cudaFreeHost(self, address):
        self.freed.append(("host", self.host.pop(address)[1]))
        return (0,)

    def cudaFree(self, address):
        self.freed.append(("device", self.device.pop(address)[1]))
        return (0,)

    def cudaStreamCreate(self):
        stream = len(self.streams) + 1
        self.streams.add(stream)
        return 0, stream

    def cudaStreamSynchronize(self, stream):
        return (0,)

    def cudaStreamDestroy(self, stream):
        self.streams.remove(stream)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        device_side = dst if kind == self.cudaMemcpyKind.cudaMemcpyHostToDevice else src
        assert self.device[device_side][1] == self.current(), "copy issued while another GPU is current"
        ctypes.memmove(dst, src, nbytes)
        return (0,)


class _Context:
    def __init__(self, runtime: FakeCudaRuntime, row_shapes: dict[str, tuple[int, ...]]):
        self.runtime, self.row_shapes, self.addresses, self.shape = runtime, row_shapes, {}, None

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def set_input_shape(self, name, shape):
        assert name == INPUT
        self.shape = tuple(shape)

    def execute_async_v3(self, stream):
        assert stream in self.runtime.streams
        count = int(np.prod(self.shape))
        images = np.frombuffer((ctypes.c_float * count).from_address(self.addresses[INPUT]), np.float32)
        for name, values in kernel(images.reshape(self.shape), self.row_shapes).items():
            ctypes.memmove(self.addresses[name], values.astype(np.float32).tobytes(), values.nbytes)
        return True


class _Engine:
    def __init__(self, runtime: FakeCudaRuntime, row_shapes: dict[str, tuple[int, ...]]):
        self.runtime, self.row_shapes, self.names = runtime, row_shapes, tuple(row_shapes)

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_shape(self, name):
        return (-1, *self.row_shapes[name])

    def get_tensor_dtype(self, name):
        return "float32"

    def create_execution_context(self):
        return _Context(self.runtime, self.row_shapes)


def fake_tensorrt(runtime: FakeCudaRuntime, row_shapes: dict[str, tuple[int, ...]] = ROW_SHAPES) -> types.ModuleType:
    """A `tensorrt` module whose Runtime deserializes b"engine" into an engine with these tensors (their shapes
    less the batch axis; INPUT is the input); anything else gives None, as a damaged plan does."""
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # so importlib.util.find_spec finds it
    trt.__version__ = "10.0.0-fake"
    trt.float32 = "float32"
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    trt.nptype = lambda dtype: {"float32": np.float32}[dtype]

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, plan):
            return _Engine(runtime, row_shapes) if plan == b"engine" else None

    trt.Runtime = Runtime
    return trt
