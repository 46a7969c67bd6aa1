"""What a front-end process and its engine process (serving/workers.py) say to each other, and where their tensors
lie.

Messages are small tuples, framed by a 4-byte length, over one Unix socket per front-end process; they carry names,
shapes, times and errors, never tensors. A request's images and its answer's outputs lie in one slot of the front
end's tensor slots: a POSIX shared-memory object the front end creates and the engine maps, so the engine's batcher
reads the images in place and writes the outputs where the front end reads them. A slot belongs to one request from
when the front end takes it until the engine's reply to it arrives (a cancelled request's too: the engine may still
be writing into it).
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import pickle
import struct

import numpy as np

from capsnet.serving import errors
from capsnet.serving.service import ModelSpec

_LENGTH = struct.Struct("<I")
ALIGN = 64  # bytes: each tensor of a slot starts on a cache line
SHM_DIR = "/dev/shm"  # where POSIX shared-memory objects are files (Linux)
# A front end's slots: enough for every request the engine may hold (queued, plus a batch computing), within this
# much shared memory per front end. Only the pages a request writes are ever touched (a 1-image request: a few KiB).
MAX_SLOT_MEMORY = 1 << 30

# message kinds, front end -> engine
INFER, CANCEL, STATISTICS, SLOTS = "infer", "cancel", "statistics", "slots"


class Outbox:
    """Messages to the other side, written together once per event loop iteration: the replies of one batch, or the
    requests a burst of calls makes, cost one system call, not one each. Never waits: messages are a few hundred
    bytes, and each side reads all it is sent."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending += (_LENGTH.pack(len(data)), data)

    def _flush(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._writer.is_closing():
            self._writer.write(data)


async def receive(reader: asyncio.StreamReader) -> tuple:
    """The next message; asyncio.IncompleteReadError once the other side has gone."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def slot_bytes(specs: list[ModelSpec]) -> int:
    """One slot: a full batch of the largest images of any served model, as float32, and then its outputs (a
    reconstruction: of the largest image)."""
    largest = 0
    for spec in specs:
        image = math.prod(spec.sizes.largest)
        outputs = sum(_aligned(4 * spec.max_batch_size * max(math.prod(shape), image if name == "reconstruction"
                                                              else 0))
                      for name, shape in spec.output_shapes.items())
        largest = max(largest, _aligned(4 * spec.max_batch_size * image) + outputs)
    return largest


class TensorSlots:
    """Fixed-size slots in one shared-memory object: the front end creates it (create=True), the engine maps it."""

    def __init__(self, name: str, count: int, size: int, create: bool = False):
        self.name, self.count, self.size = name, count, size
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, count * size)  # sparse: pages are allocated as requests touch them
            self._map = mmap.mmap(fd, count * size)
        finally:
            os.close(fd)
        self._memory = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def for_specs(cls, name: str, specs: list[ModelSpec], requests: int) -> "TensorSlots":
        size = slot_bytes(specs)
        return cls(name, max(1, min(requests, MAX_SLOT_MEMORY // size)), size, create=True)

    def array(self, slot: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 view of `shape` at `offset` of `slot`."""
        count = math.prod(shape)
        start = slot * self.size + offset
        return self._memory[start:start + 4 * count].view(np.float32).reshape(shape)

    def images(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        return self.array(slot, 0, shape)

    def output_offsets(self, images_shape: tuple[int, ...], shapes: list[tuple[int, ...]]) -> list[int]:
        """Where each output goes, after the images; ValueError if they do not fit a slot."""
        offset, offsets = _aligned(4 * math.prod(images_shape)), []
        for shape in shapes:
            offsets.append(offset)
            offset += _aligned(4 * math.prod(shape))
        if offset > self.size:
            raise ValueError(f"the outputs ({offset} bytes with the images) do not fit a slot of {self.size} bytes")
        return offsets

    def close(self) -> None:
        self._memory = np.empty(0, np.uint8)  # drops the view, so the map can close
        try:
            self._map.close()
        except BufferError:  # a view still exported (an array still held): the map goes with the process
            pass

    def unlink(self) -> None:
        unlink_slots(self.name)


def unlink_slots(name: str) -> None:
    """Remove a front end's slots object (its maps stay valid until closed)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _kinds(kind: type[errors.ServingError]) -> dict[str, type[errors.ServingError]]:
    found = {kind.__name__: kind}
    for sub in kind.__subclasses__():
        found.update(_kinds(sub))
    return found


def error_of(exc: BaseException) -> tuple[str, str]:
    """An error as it travels: its serving/errors.py kind's name and its message (other exceptions: INTERNAL)."""
    if isinstance(exc, errors.ServingError):
        return type(exc).__name__, str(exc)
    return errors.InferenceError.__name__, f"{type(exc).__name__}: {exc}"


def error_from(error: tuple[str, str]) -> errors.ServingError:
    """The error a reply carries, as its kind."""
    kind, message = error
    return _kinds(errors.ServingError).get(kind, errors.InferenceError)(message)
