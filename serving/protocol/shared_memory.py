"""Triton's shared-memory extensions: regions that clients on this host register, so that tensors travel through
memory instead of inside requests (Triton's docs/protocol/extension_shared_memory.md).

A system region is a POSIX shared-memory object (`shm_open`'s name, "/name", an entry of /dev/shm), opened once when
registered. It is read with pread and written with pwrite, never mapped: a client that shrinks its object while a
request uses it costs that request a short read, which is refused, where a mapping would kill the server with SIGBUS.
A CUDA region is a client's device buffer shared by a cudaIPC handle (`serving/engine/cuda_ipc.py`), registered only
where a GPU engine serves.

Each request that names a region holds it (`held`) from when its tensor is checked until it is answered, and the
batcher holds it again while it copies. An unregistered region leaves the registry at once (requests after it get
NOT_FOUND) and is closed when its last holder lets go: a request never reads a descriptor or device pointer that
has since been reused for something else. Errors carry Triton's codes (`serving/errors.py`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capsnet.serving.errors import (InvalidInput, RegionExists, RegionNotFound, RegionUnopenable, ServingError,
                                    SharedMemoryDisabled)

SHM_DIR = Path("/dev/shm")  # where glibc's shm_open keeps "/name"
# shm_open's names: one leading slash, then up to NAME_MAX (255) bytes without a slash, and not "." or "..", which
# name directories.
POSIX_NAME = re.compile(r"/(?!\.\.?\Z)[^/\x00]{1,254}")
MAX_NAME_CHARS = 256  # a region's own name (Triton sets none; this bounds what a client makes the server keep)
SYSTEM, CUDA = "system", "cuda"


class SharedMemoryFull(ServingError):
    """Registering one more region would pass --max-shm-regions or --max-shm-bytes."""

    grpc_code, http_status = "RESOURCE_EXHAUSTED", 400


class Region:
    """A registered region; its resources are freed once it is closed and no one holds it."""

    kind: str

    def __init__(self, name: str, byte_size: int):
        self.name = name
        self.byte_size = byte_size
        self._lock = threading.Lock()  # holders come and go on the event loop and in the batcher's thread
        self._holders = 0
        self._closed = False  # unregistered: freed once no one holds it
        self._freed = False

    def hold(self) -> bool:
        """Keep it open until release(); False once it has been freed (unregistered, and let go by all)."""
        with self._lock:
            if self._freed:
                return False
            self._holders += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            self._free_if_done()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free_if_done()

    @contextlib.contextmanager
    def in_use(self, field: str) -> Iterator[Region]:
        """Held for the block (a read or write of the batcher's): RegionNotFound, naming the tensor's parameter, once
        it has been freed."""
        if not self.hold():
            raise RegionNotFound(f"{field}.parameters.shared_memory_region: region {self.name!r} was unregistered")
        try:
            yield self
        finally:
            self.release()

    def _free_if_done(self) -> None:
        if self._closed and not self._holders and not self._freed:
            self._freed = True
            self._free()

    def status(self) -> dict:
        raise NotImplementedError

    def read(self, out: np.ndarray, offset: int, field: str) -> None:
        """Fill `out` (contiguous) from the region's bytes at `offset` (within byte_size, checked by the caller)."""
        raise NotImplementedError

    def write(self, data: np.ndarray, offset: int, field: str) -> None:
        raise NotImplementedError

    def write_device(self, data, offset: int, field: str) -> None:
        """`data`, a float32 CUDA tensor, into the region: through the host unless the region is on a device."""
        self.write(data.cpu().numpy(), offset, field)

    def _free(self) -> None:
        raise NotImplementedError


class SystemRegion(Region):
    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int):
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._fd = fd

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def read(self, out: np.ndarray, offset: int, field: str) -> None:
        view = out.data.cast("B")
        got = os.preadv(self._fd, [view], self.offset + offset)
        if got != len(view):
            raise InvalidInput(f"{field}: region {self.name!r} gave {got} of {len(view)} bytes at offset {offset}: its "
                               f"object {self.key!r} was made smaller after it was registered")

    def write(self, data: np.ndarray, offset: int, field: str) -> None:
        end = self.offset + offset + data.nbytes
        if os.fstat(self._fd).st_size < end:  # pwrite would grow the object, which its client sized
            raise InvalidInput(f"{field}: region {self.name!r} cannot take {data.nbytes} bytes at offset {offset}: its "
                               f"object {self.key!r} was made smaller after it was registered")
        os.pwrite(self._fd, np.ascontiguousarray(data).data.cast("B"), self.offset + offset)

    def _free(self) -> None:
        os.close(self._fd)


class CudaRegion(Region):
    kind = CUDA

    def __init__(self, name: str, device_id: int, byte_size: int, buffer):
        """`buffer`: a cuda_ipc.DeviceBuffer."""
        super().__init__(name, byte_size)
        self.device_id = device_id
        self.buffer = buffer

    def status(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def read(self, out: np.ndarray, offset: int, field: str) -> None:
        self.buffer.to_host(out, offset)

    def write(self, data: np.ndarray, offset: int, field: str) -> None:
        self.buffer.from_host(np.ascontiguousarray(data), offset)

    def write_device(self, data, offset: int, field: str) -> None:
        self.buffer.from_device(data, offset)

    def _free(self) -> None:
        self.buffer.close()


@dataclass(frozen=True)
class RegionRef:
    """Where a tensor's parameters place it: shared_memory_region, _offset and _byte_size."""
    name: str
    offset: int
    byte_size: int


PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def region_ref(parameters, field: str) -> RegionRef | None:
    """The region a tensor's parameters name (None: they name none); InvalidInput naming the parameter at fault.
    shared_memory_offset is optional (0), the other two go together, as Triton takes them."""
    given = [key for key in PARAMETERS if key in parameters]
    if not given:
        return None
    if "shared_memory_region" not in parameters or "shared_memory_byte_size" not in parameters:
        raise InvalidInput(f"{field}.parameters: shared memory needs shared_memory_region and shared_memory_byte_size "
                           f"(shared_memory_offset is optional), got {', '.join(given)}")
    name = parameters["shared_memory_region"]
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{field}.parameters.shared_memory_region: expected a region's name, got {name!r:.60}")
    numbers = {}
    for key, default in (("shared_memory_byte_size", None), ("shared_memory_offset", 0)):
        value = parameters.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"{field}.parameters.{key}: expected a number of bytes >= 0, got {value!r:.60}")
        numbers[key] = value
    return RegionRef(name, numbers["shared_memory_offset"], numbers["shared_memory_byte_size"])


class SharedMemory:
    """The regions registered on this server, by name, for both transports; limits and the switch are the config's.
    `on_gpu()`: whether a GPU engine serves now (CUDA regions are taken only then)."""

    def __init__(self, allowed: bool, max_regions: int, max_bytes: int, on_gpu: Callable[[], bool] = lambda: False):
        self.allowed = allowed
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.on_gpu = on_gpu
        self._regions: dict[str, Region] = {}

    @property
    def extensions(self) -> list[str]:
        """Triton's names of the extensions this registry serves."""
        if not self.allowed:
            return []
        return ["system_shared_memory"] + (["cuda_shared_memory"] if self.on_gpu() else [])

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_new(name, byte_size)
        if not POSIX_NAME.fullmatch(key):
            raise InvalidInput(f"key: expected a POSIX shared-memory name, '/' and 1 to 254 characters without '/', "
                               f"got {key[:80]!r}")
        try:  # as shm_open opens it, and never through a symbolic link
            fd = os.open(SHM_DIR / key[1:], os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as err:
            raise RegionUnopenable(f"key: unable to open shared memory region {key!r}: {err.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"key: {key!r} is not a shared-memory object")
            if offset + byte_size > info.st_size:
                raise InvalidInput(f"byte_size: failed to register shared memory region {name!r}: offset {offset} + "
                                   f"byte_size {byte_size} is beyond the end of {key!r} ({info.st_size} bytes)")
            self._check_room(byte_size)
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = SystemRegion(name, key, offset, byte_size, fd)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_cuda_served(name)
        self._check_new(name, byte_size)
        self._check_room(byte_size)
        from capsnet.serving.engine.cuda_ipc import DeviceBuffer  # torch's CUDA, only where a GPU serves

        buffer = DeviceBuffer(raw_handle, device_id, byte_size, name)
        self._regions[name] = CudaRegion(name, device_id, byte_size, buffer)

    def check_cuda_served(self, name: str) -> None:
        """Refuse a CUDA region where no GPU engine serves, as Triton built without GPUs does, before anything else
        of the call is read."""
        if self.allowed and not self.on_gpu():
            raise InvalidInput(f"failed to register CUDA shared memory region: {name[:80]!r}, GPUs not supported: this "
                               "server runs its models on the CPU; use system shared memory")

    def status(self, kind: str, name: str) -> list[dict]:
        """Every region of the kind (empty name), or the one named."""
        if not name:
            return [region.status() for region in self._regions.values() if region.kind == kind]
        return [self._of_kind(kind, name, "name").status()]

    def unregister(self, kind: str, name: str) -> None:
        """One region (unknown names: nothing to do, as Triton), or all of the kind; each closes when its last
        request lets it go."""
        self._check_allowed()
        if name:
            names = [name] if name in self._regions and self._regions[name].kind == kind else []
        else:
            names = [key for key, region in self._regions.items() if region.kind == kind]
        for key in names:
            self._regions.pop(key).close()

    def close(self) -> None:
        """At the server's stop, after its last request."""
        for region in self._regions.values():
            region.close()
        self._regions.clear()

    @contextlib.contextmanager
    def held(self, ref: RegionRef, field: str) -> Iterator[Region]:
        """The region a tensor names, its bounds checked, held until the block ends."""
        region = self._regions.get(ref.name)
        if region is None:
            raise RegionNotFound(f"{field}.parameters.shared_memory_region: unable to find shared memory region "
                                 f"{ref.name[:80]!r}")
        if ref.offset >= region.byte_size:
            raise InvalidInput(f"{field}.parameters.shared_memory_offset: {ref.offset} is outside region {ref.name!r} "
                               f"({region.byte_size} bytes)")
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidInput(f"{field}.parameters.shared_memory_byte_size: offset {ref.offset} + byte size "
                               f"{ref.byte_size} is beyond the end of region {ref.name!r} ({region.byte_size} bytes)")
        with region.in_use(field):  # in the registry, so not freed: it holds
            yield region

    def _of_kind(self, kind: str, name: str, field: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"{field}: unable to find {kind} shared memory region {name[:80]!r}")
        if region.kind != kind:
            raise RegionNotFound(f"{field}: the region named {name!r} is registered as {region.kind} shared memory, "
                                 f"not {kind} shared memory")
        return region

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise SharedMemoryDisabled("client shared memory is disabled on this server (--no-allow-client-shm); "
                                       "send tensors in the request")

    def _check_new(self, name: str, byte_size: int) -> None:
        self._check_allowed()
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidInput(f"name: expected a region name of 1 to {MAX_NAME_CHARS} characters, got {len(name)}")
        if name in self._regions:
            raise RegionExists(f"name: shared memory region {name[:80]!r} already in manager; unregister it first")
        if byte_size <= 0:
            raise InvalidInput(f"byte_size: expected the region's size in bytes, > 0, got {byte_size}")

    def _check_room(self, byte_size: int) -> None:
        if len(self._regions) >= self.max_regions:
            raise SharedMemoryFull(f"name: {len(self._regions)} regions are registered, the most this server takes "
                                   f"(--max-shm-regions {self.max_regions}); unregister one first")
        used = sum(region.byte_size for region in self._regions.values())
        if used + byte_size > self.max_bytes:
            raise SharedMemoryFull(f"byte_size: {byte_size} bytes more would make {used + byte_size} registered, over "
                                   f"--max-shm-bytes {self.max_bytes}; unregister regions first")
