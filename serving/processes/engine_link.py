"""What a front-end process and its engine process (serving/processes/supervisor.py) say to each other, and where their
tensors lie.

Messages are typed (msgspec structs, each tagged with its Kind, MessagePack-encoded as arrays), framed by a 4-byte
length, over one Unix socket per front-end process; they carry ids, shapes, times and errors, never tensors. A
request's images and its outputs lie in one slot of the front end's tensor slots: a POSIX shared-memory object the
front end creates and the engine maps, so the engine's batcher reads the images in place and writes the outputs
straight into the slot from the batch. A slot belongs to one request from when the front end takes it until the
engine's answer to it arrives (a cancelled request's too: the engine may still be writing into it).

    front end -> engine: Slots once, then Infer and Cancel (many per write: one write per event loop iteration),
                         StatisticsQuery, and Report (its requests' statistics, when the engine asks)
    engine -> front end: Specs once, then Answered (once per batch: its run and the requests it finished), Failed,
                         Statistics, and ReportWanted (when any front end queries the statistics)
"""

from __future__ import annotations

import asyncio
import enum
import math
import mmap
import os
import struct
from typing import Union

import msgspec
import numpy as np

from capsnet.serving import errors
from capsnet.serving.engine.service import ModelSpec

_LENGTH = struct.Struct("<I")
ALIGN = 64  # bytes: each tensor of a slot starts on a cache line
SHM_DIR = "/dev/shm"  # where POSIX shared-memory objects are files (Linux)
# A front end's slots: enough for every request the engine may hold (queued, plus a batch computing), within this
# much shared memory per front end. Only the pages a request writes are ever touched (a 1-image request: a few KiB).
MAX_SLOT_MEMORY = 1 << 30


class Kind(enum.IntEnum):
    """Each message's tag: the first element of its encoded array."""
    SPECS = 1
    SLOTS = 2
    INFER = 3
    CANCEL = 4
    ANSWERED = 5
    FAILED = 6
    STATISTICS_QUERY = 7
    STATISTICS = 8
    REPORT_WANTED = 9
    REPORT = 10


class Failure(enum.IntEnum):
    """Why the engine did not answer a request: each a serving/errors.py kind."""
    QUEUE_FULL = 1
    DEADLINE = 2
    CANCELLED = 3
    INFERENCE = 4
    BACKEND_UNUSABLE = 5


FAILURES: dict[Failure, type[errors.ServingError]] = {
    Failure.QUEUE_FULL: errors.QueueFull, Failure.DEADLINE: errors.DeadlineExceeded,
    Failure.CANCELLED: errors.RequestTimeout, Failure.INFERENCE: errors.InferenceError,
    Failure.BACKEND_UNUSABLE: errors.BackendUnusable}


class Specs(msgspec.Struct, array_like=True, tag=int(Kind.SPECS)):
    """The served versions, in the order Infer's `version` indexes them (pickled once per connection: ModelSpec is
    a tree of dataclasses, and both ends run the same code)."""
    specs: bytes


class Slots(msgspec.Struct, array_like=True, tag=int(Kind.SLOTS)):
    name: str  # the shared-memory object
    count: int
    size: int  # bytes a slot


class Infer(msgspec.Struct, array_like=True, tag=int(Kind.INFER)):
    """Images in `slot`, checked by the front end, for the version Specs lists at `version`."""
    id: int
    version: int
    slot: int
    shape: tuple[int, ...]  # (N, C, H, W)
    deadline: float | None  # time.monotonic(): one clock for every process of the host


class Cancel(msgspec.Struct, array_like=True, tag=int(Kind.CANCEL)):
    """Its caller gave up: it leaves the queue if it is still there (a batch already running it answers it)."""
    id: int
    past_deadline: bool


class Answered(msgspec.Struct, array_like=True, tag=int(Kind.ANSWERED)):
    """Requests whose outputs are all in their slots, with the backend runs they took part in (batcher.BatchRun's
    fields), once per batch: `requests` holds (id, [indices into runs])."""
    runs: list[tuple[int, float, float, float, float]]
    requests: list[tuple[int, list[int]]]


class Failed(msgspec.Struct, array_like=True, tag=int(Kind.FAILED)):
    id: int
    failure: Failure
    message: str


class StatisticsQuery(msgspec.Struct, array_like=True, tag=int(Kind.STATISTICS_QUERY)):
    id: int
    versions: list[int]  # as Specs lists them


class Statistics(msgspec.Struct, array_like=True, tag=int(Kind.STATISTICS)):
    """Triton's statistics of the versions a query named: every front end's requests, the engine's batches."""
    id: int
    stats: list[dict]


class ReportWanted(msgspec.Struct, array_like=True, tag=int(Kind.REPORT_WANTED)):
    id: int


class Report(msgspec.Struct, array_like=True, tag=int(Kind.REPORT)):
    """A front end's statistics of the requests it answered, per version (ModelStatistics.to_json())."""
    id: int
    stats: list[dict]


Message = Union[Specs, Slots, Infer, Cancel, Answered, Failed, StatisticsQuery, Statistics, ReportWanted, Report]
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode


class Outbox:
    """Messages to the other side, written together once per event loop iteration: the answers of one batch, or the
    requests a burst of calls makes, cost one system call, not one each. Never waits: messages are a few hundred
    bytes, and each side reads all it is sent."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def send(self, message: Message) -> None:
        data = _encode(message)
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending += (_LENGTH.pack(len(data)), data)

    def send_now(self, message: Message) -> None:
        """As send(), written at once with what is pending: for a message that is itself the gathering of a loop
        iteration's (a batch's answers), one loop iteration sooner."""
        data = _encode(message)
        self._pending += (_LENGTH.pack(len(data)), data)
        self._flush()

    def _flush(self) -> None:
        if not self._pending:  # send_now() wrote them
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._writer.is_closing():
            self._writer.write(data)


class Inbox:
    """Messages from the other side, as many as each read brings: a front end's burst of requests is handled in one
    wake-up."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader
        self._buffer = bytearray()

    async def receive(self) -> list[Message]:
        """The messages read so far, at least one (waiting for it); asyncio.IncompleteReadError once the other side
        has gone."""
        while True:
            if messages := self._complete():
                return messages
            chunk = await self._reader.read(1 << 16)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(self._buffer), None)
            self._buffer += chunk

    def _complete(self) -> list[Message]:
        buffer, start, messages = self._buffer, 0, []
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if end > len(buffer):
                break
            messages.append(_decode(buffer[start + _LENGTH.size:end]))
            start = end
        del buffer[:start]
        return messages


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

    @classmethod
    def for_specs(cls, name: str, specs: list[ModelSpec], requests: int) -> "TensorSlots":
        size = slot_bytes(specs)
        return cls(name, max(1, min(requests, MAX_SLOT_MEMORY // size)), size, create=True)

    def array(self, slot: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 view of `shape` at `offset` of `slot`."""
        return np.ndarray(shape, np.float32, self._map, slot * self.size + offset)

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


def failure_of(err: BaseException) -> Failed:
    """How a request's error travels (its id: the caller's to set); a fault of no serving kind is an INFERENCE one."""
    for failure, kind in reversed(FAILURES.items()):  # subclasses (BackendUnusable) before their bases
        if isinstance(err, kind):
            return Failed(0, failure, str(err))
    return Failed(0, Failure.INFERENCE, f"{type(err).__name__}: {err}")


def error_from(failure: Failure, message: str) -> errors.ServingError:
    return FAILURES[failure](message)
