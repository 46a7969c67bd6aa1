"""FAKES, for unit checks only: stand-ins for the `tensorrt` package and cuda-python's CUDA runtime, which
cannot be installed on the machines this project is tested on. They model what capsnet.tensorrt_runner
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

INPUT, OUTPUTS = "images", ("probabilities", "poses")
ROW_SHAPES = {INPUT: (1, 2, 2), "probabilities": (3,), "poses": (3, 2)}


def kernel(images: np.ndarray) -> dict[str, np.ndarray]:
    """What the fake engine computes from (N, 1, 2, 2) images."""
    total = images.reshape(len(images), -1).sum(axis=1)  # (N,)
    probabilities = total[:, None] * np.arange(1, 4, dtype=np.float32)  # (N, 3)
    return {"probabilities": probabilities, "poses": np.repeat(probabilities[:, :, None], 2, axis=2)}  # (N, 3, 2)


class FakeCudaRuntime:
    class cudaMemcpyKind(enum.IntEnum):  # noqa: N801 (CUDA's name)
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    def __init__(self, device_count: int = 2):
        self.device_count = device_count
        self._current = threading.local()
        self.host, self.device, self.streams = {}, {}, set()  # live allocations: address -> (buffer, device)
        self.freed = []

    def current(self) -> int:
        return getattr(self._current, "device", 0)

    def cudaGetDeviceCount(self):  # noqa: N802
        return 0, self.device_count

    def cudaSetDevice(self, device):  # noqa: N802
        if not 0 <= device < self.device_count:
            return 101, None  # cudaErrorInvalidDevice
        self._current.device = device
        return (0,)

    def cudaGetDeviceProperties(self, device):  # noqa: N802
        return 0, types.SimpleNamespace(name=f"Fake GPU {device}".encode() + b"\x00" * 4, major=9, minor=device)

    def _allocate(self, table, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        table[ctypes.addressof(buffer)] = (buffer, self.current())
        return 0, ctypes.addressof(buffer)

    def cudaMallocHost(self, nbytes):  # noqa: N802
        return self._allocate(self.host, nbytes)

    def cudaMalloc(self, nbytes):  # noqa: N802
        return self._allocate(self.device, nbytes)

    def cudaFreeHost(self, address):  # noqa: N802
        self.freed.append(("host", self.host.pop(address)[1]))
        return (0,)

    def cudaFree(self, address):  # noqa: N802
        self.freed.append(("device", self.device.pop(address)[1]))
        return (0,)

    def cudaStreamCreate(self):  # noqa: N802
        stream = len(self.streams) + 1
        self.streams.add(stream)
        return 0, stream

    def cudaStreamSynchronize(self, stream):  # noqa: N802
        return (0,)

    def cudaStreamDestroy(self, stream):  # noqa: N802
        self.streams.remove(stream)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):  # noqa: N802
        device_side = dst if kind == self.cudaMemcpyKind.cudaMemcpyHostToDevice else src
        assert self.device[device_side][1] == self.current(), "copy issued while another GPU is current"
        ctypes.memmove(dst, src, nbytes)
        return (0,)


class _Context:
    def __init__(self, runtime: FakeCudaRuntime):
        self.runtime, self.addresses, self.shape = runtime, {}, None

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def set_input_shape(self, name, shape):
        assert name == INPUT
        self.shape = tuple(shape)

    def execute_async_v3(self, stream):
        assert stream in self.runtime.streams
        count = int(np.prod(self.shape))
        images = np.frombuffer((ctypes.c_float * count).from_address(self.addresses[INPUT]), np.float32)
        for name, values in kernel(images.reshape(self.shape)).items():
            ctypes.memmove(self.addresses[name], values.astype(np.float32).tobytes(), values.nbytes)
        return True


class _Engine:
    def __init__(self, runtime: FakeCudaRuntime, names: tuple[str, ...]):
        self.runtime, self.names = runtime, names

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_shape(self, name):
        return (-1, *ROW_SHAPES[name])

    def get_tensor_dtype(self, name):
        return "float32"

    def create_execution_context(self):
        return _Context(self.runtime)


def fake_tensorrt(runtime: FakeCudaRuntime, names: tuple[str, ...] = (INPUT, *OUTPUTS)) -> types.ModuleType:
    """A `tensorrt` module whose Runtime deserializes b"engine" (anything else: None, as a damaged plan)."""
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
            return _Engine(runtime, names) if plan == b"engine" else None

    trt.Runtime = Runtime
    return trt
