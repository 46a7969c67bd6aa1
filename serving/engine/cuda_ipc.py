"""A client's device buffer shared by a cudaIPC handle (Triton's CUDA shared-memory extension), opened with the CUDA
runtime that torch has loaded, so it lives in the same context as the engine, and seen by torch as a uint8 tensor
without a copy. Copies to and from it run on the device: device-to-device into an engine that takes device input
(`DeviceInput`), device-to-host into the batch otherwise.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Protocol

import numpy as np

from capsnet.serving.errors import InvalidInput

if TYPE_CHECKING:
    import torch

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess, the flag Triton opens handles with


class DeviceInput(Protocol):
    """What a backend offers to take a batch already on its device: the CUDA device it runs on, and a run on a
    float32 (N, C, H, W) CUDA tensor there, answering its outputs as CUDA tensors. A backend without it gets its
    batch in host memory."""

    device: torch.device

    def run_device(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """images float32 (N, C, H, W) on `device` -> {output name: float32 (N, ...) on `device`}.

        `images` were written on the calling thread's current CUDA stream: an engine on a stream of its own makes it
        wait for that stream first. It returns once its outputs may be read on the caller's current stream (its
        stream synchronised, or awaited by the current one), and they stay the caller's until the next call."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def _runtime() -> ctypes.CDLL:
    """The libcudart torch has loaded (found in this process's mappings): one runtime, one context per device."""
    import torch

    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    if not paths:
        raise RuntimeError("torch has not loaded a CUDA runtime (libcudart) into this process")
    runtime = ctypes.CDLL(paths[0])
    runtime.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
    runtime.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    runtime.cudaGetErrorString.restype = ctypes.c_char_p
    return runtime


def _allocation_left(pointer: int) -> int:
    """Bytes of the allocation `pointer` lies in from `pointer` on (the driver's cuMemGetAddressRange); 0 if unknown."""
    driver = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    if driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_void_p(pointer)):
        return 0
    return (base.value or 0) + size.value - pointer


class _CudaArray:
    """__cuda_array_interface__ of `size` bytes at `pointer`, for torch.as_tensor to view without copying."""

    def __init__(self, pointer: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "version": 2}


class DeviceBuffer:
    """An opened cudaIPC handle of `byte_size` bytes on device `device_id`; close() closes the handle."""

    _runtime: ctypes.CDLL | None = None

    def __init__(self, raw_handle: bytes, device_id: int, byte_size: int, name: str):
        import torch

        if len(raw_handle) != HANDLE_BYTES:
            raise InvalidInput(f"raw_handle: expected a cudaIPC handle of {HANDLE_BYTES} bytes, got {len(raw_handle)}")
        if not 0 <= device_id < torch.cuda.device_count():
            raise InvalidInput(f"device_id: expected a CUDA device of this server, 0 to "
                               f"{torch.cuda.device_count() - 1}, got {device_id}")
        if DeviceBuffer._runtime is None:
            DeviceBuffer._runtime = _runtime()
        runtime = DeviceBuffer._runtime
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device_id):
            error = runtime.cudaIpcOpenMemHandle(ctypes.byref(pointer), _Handle.from_buffer_copy(raw_handle),
                                                 LAZY_ENABLE_PEER_ACCESS)
        if error:  # a handle of this process, of a freed buffer, of another device: Triton's INVALID_ARGUMENT
            raise InvalidInput(f"raw_handle: failed to register CUDA shared memory region {name[:80]!r}: "
                               f"{runtime.cudaGetErrorString(error).decode()}")
        self.pointer: int = pointer.value or 0
        if (size := _allocation_left(self.pointer)) < byte_size:  # a copy past it would fault the device's context
            runtime.cudaIpcCloseMemHandle(pointer)
            raise InvalidInput(f"byte_size: failed to register CUDA shared memory region {name[:80]!r}: {byte_size} "
                               f"bytes, but the shared allocation holds {size}")
        self.device = torch.device("cuda", device_id)
        self.tensor = torch.as_tensor(_CudaArray(self.pointer, byte_size), device=self.device)  # (byte_size,) uint8

    def view(self, offset: int, size: int):
        """The bytes [offset, offset + size) as a uint8 CUDA tensor (no copy)."""
        return self.tensor[offset:offset + size]

    def to_host(self, out: np.ndarray, offset: int) -> None:
        import torch

        flat = torch.from_numpy(out.reshape(-1).view(np.uint8))
        flat.copy_(self.view(offset, flat.numel()))  # synchronous: a pageable host destination

    def from_host(self, data: np.ndarray, offset: int) -> None:
        import torch

        flat = torch.from_numpy(data.reshape(-1).view(np.uint8))
        self.view(offset, flat.numel()).copy_(flat)
        torch.cuda.synchronize(self.device)  # in the client's buffer before the answer says so

    def from_device(self, data: torch.Tensor, offset: int) -> None:
        """A CUDA tensor's bytes into the buffer, device to device."""
        import torch

        flat = data.contiguous().reshape(-1).view(torch.uint8)
        self.view(offset, flat.numel()).copy_(flat)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        assert DeviceBuffer._runtime is not None
        DeviceBuffer._runtime.cudaIpcCloseMemHandle(ctypes.c_void_p(self.pointer))
