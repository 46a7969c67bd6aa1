"""A front-end process of a server with several (serving/workers.py): the whole request path of a single-process
server (gRPC and REST, the interceptor, health, the data plane's checks, the encodings) with its models' versions in
the engine process.

Each served version is a RemoteService: an InferenceService whose batcher is the engine's, reached through an
EngineLink. The request path runs unchanged down to the batcher's submit(): the images, checked here, are copied
into one of the front end's tensor slots (serving/engine_link.py), the engine batches them with every front end's,
and the outputs come back in the slot. Statistics are the engine's (it records every request it is given). When the
engine goes away, requests waiting on it fail UNAVAILABLE and the front end stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from capsnet.serving import engine_link
from capsnet.serving.backends.base import Backend
from capsnet.serving.batcher import Batcher, BatcherConfig, BatchOutput, BatchRun, OutputSink
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine_link import CANCEL, INFER, SLOTS, STATISTICS, TensorSlots
from capsnet.serving.errors import ServerNotReady
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.metrics import Metrics
from capsnet.serving.model_manager import ModelManager, ModelRef, ServedModel, VersionState, VersionStatus
from capsnet.serving.observe import CURRENT
from capsnet.serving.server import CapsNetServer
from capsnet.serving.service import InferenceService, ModelSpec, batcher_config
from capsnet.serving.statistics import ModelStatistics

log = logging.getLogger(__name__)

ENGINE_GONE = "the server's engine process has stopped; retry on another replica"
# How often the in-flight gauge is written to the shared metrics files (the engine's /metrics reads them).
INFLIGHT_REFRESH_S = 0.5


class EngineLink:
    """The front end's end of its engine connection: requests out, replies matched to them by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, specs: list[ModelSpec],
                 slots: TensorSlots):
        self.specs = specs
        self.slots = slots
        self._reader, self._writer = reader, writer
        self._outbox = engine_link.Outbox(writer)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, list[int]]] = {}  # id -> (its reply, its slots)
        self._free = list(range(slots.count))
        self._available = asyncio.Semaphore(slots.count)
        # one request taking several slots (images of several sizes) at a time: two taking them one by one could
        # each hold some and wait for the other's
        self._taking_several = asyncio.Lock()
        self.lost = asyncio.Event()  # set once the engine has gone
        self._reading = asyncio.get_running_loop().create_task(self._read(), name="capsnet-engine-link")

    @classmethod
    async def connect(cls, socket_path: str, slots_name: str, config: ServerConfig) -> "EngineLink":
        reader, writer = await asyncio.open_unix_connection(socket_path)
        (specs,) = await engine_link.receive(reader)
        # every request the engine may hold at once (its queue, and a batch computing) has a slot
        slots = TensorSlots.for_specs(slots_name, specs, config.max_queue_size + config.max_batch_size)
        link = cls(reader, writer, specs, slots)
        link._outbox.send((SLOTS, slots.name, slots.count, slots.size))
        return link

    async def _read(self) -> None:
        try:
            while True:
                request_id, error, payload = await engine_link.receive(self._reader)
                reply, slots = self._pending.pop(request_id)
                if reply.cancelled():  # its caller has gone: the slots are free once the engine is done with them
                    self._release(slots)
                elif error is not None:
                    reply.set_exception(engine_link.error_from(error))
                else:
                    reply.set_result(payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the engine process has closed its connection: this front end stops")
        finally:
            self.lost.set()
            for reply, _ in self._pending.values():
                if not reply.done():
                    reply.set_exception(ServerNotReady(ENGINE_GONE))
            self._pending.clear()

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._free.append(slot)
            self._available.release()

    async def _take(self, count: int) -> list[int]:
        if count == 1:
            await self._available.acquire()
            return [self._free.pop()]
        async with self._taking_several:
            taken: list[int] = []
            try:
                for _ in range(count):
                    await self._available.acquire()
                    taken.append(self._free.pop())
            except BaseException:
                self._release(taken)
                raise
            return taken

    def _call(self, message: tuple, slots: list[int]) -> tuple[int, asyncio.Future]:
        if self.lost.is_set():
            raise ServerNotReady(ENGINE_GONE)
        request_id = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (reply, slots)
        self._outbox.send((message[0], request_id, *message[1:]))
        return request_id, reply

    async def infer(self, spec: ModelSpec, groups: list[np.ndarray], deadline: float | None,
                    arrival: float) -> list[BatchOutput]:
        """One request's images, (N, C, H, W) float32 and checked, of one size or several (a group each), through
        the engine's batcher for `spec`'s version: one slot per group, one request to the engine (which counts it
        once)."""
        slots = await self._take(len(groups))
        owned = True  # the slots are released here, unless the engine still holds them
        try:
            for slot, images in zip(slots, groups):
                self.slots.images(slot, images.shape)[...] = images
            request_id, reply = self._call((INFER, spec.name, spec.version,
                                            [(slot, images.shape) for slot, images in zip(slots, groups)], deadline,
                                            arrival), slots)
            try:
                answers = await reply
            except asyncio.CancelledError:
                if reply.cancelled() and not self.lost.is_set():  # the engine is told; its reply frees the slots
                    owned = False
                    self._outbox.send((CANCEL, request_id))
                raise
            outputs = []
            for slot, images, (names, shapes, queue_wait, runs) in zip(slots, groups, answers):
                offsets = self.slots.output_offsets(images.shape, shapes)
                outputs.append(BatchOutput({name: self.slots.array(slot, offset, shape).copy()
                                            for name, shape, offset in zip(names, shapes, offsets)},
                                           queue_wait, [BatchRun(*run) for run in runs], arrival))
            return outputs
        finally:
            if owned:
                self._release(slots)

    async def statistics(self, ref: ModelRef) -> list[dict]:
        _, reply = self._call((STATISTICS, ref.name, ref.version), [])
        return await reply

    async def close(self) -> None:
        self._writer.close()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await self._reading
        self.slots.close()
        self.slots.unlink()


class EngineQueue:
    """The engine's batcher for one version, as the version's InferenceService submits to it."""

    def __init__(self, link: EngineLink, spec: ModelSpec, config: BatcherConfig):
        self.link, self.spec, self.config = link, spec, config

    async def submit(self, images: np.ndarray, deadline: float | None = None,
                     sinks: dict[str, OutputSink] | None = None) -> BatchOutput:
        (output,) = await self.submit_sizes([images], deadline, sinks)
        return output

    async def submit_sizes(self, groups: list[np.ndarray], deadline: float | None = None,
                           sinks: dict[str, OutputSink] | None = None) -> list[BatchOutput]:
        assert not sinks, "client shared memory is not served by front-end processes (serving/workers.py)"
        record = CURRENT.get()
        arrival = record.started if record is not None else time.monotonic()
        return await self.link.infer(self.spec, groups, deadline, arrival)


class RemoteModels(ModelManager):
    """The engine's versions, as this front end serves them; the models never change (--model-control none)."""

    def __init__(self, link: EngineLink, source, config: ServerConfig, metrics: Metrics, lifecycle: Lifecycle,
                 check_spec: Callable[[ModelSpec], None]):
        super().__init__(source, config, metrics, lifecycle, check_spec)
        self.link = link

    async def start(self) -> None:
        self.source.check()  # the names it lists (a model and its decoder) are read from model.json
        for spec in self.link.specs:
            self.check_spec(spec)
            model = self.models.setdefault(spec.name, ServedModel(spec.name))
            queue = cast(Batcher, EngineQueue(self.link, spec, batcher_config(spec, self.config)))
            # no backend here: the engine's runs it; the statistics this process would keep are the engine's
            service = InferenceService(spec, cast(Backend, None), queue, self.lifecycle,
                                       self.metrics.for_version(spec.name, spec.version),
                                       ModelStatistics(spec.name, spec.version))
            model.serving = {**model.serving, spec.version: service}
            model.status[spec.version] = VersionStatus(VersionState.READY)

    async def warmup(self) -> None:
        """The engine warmed the backends up before this front end started."""

    async def close(self) -> None:
        """The server closes its models after its listeners: no request is left; the engine frees the backends."""
        self._closed = True

    async def statistics(self, ref: ModelRef) -> list[dict]:
        return await self.link.statistics(ref)


class FrontEnd(CapsNetServer):
    """One of a server's front-end processes: listens on the server's ports beside the others."""

    REUSE_PORT = True

    def __init__(self, config: ServerConfig, link: EngineLink):
        super().__init__(config)
        self.link = link

    def _model_manager(self, source) -> ModelManager:
        return RemoteModels(self.link, source, self.config, self.metrics, self.lifecycle, self._check_spec)

    def _open_metrics(self, opened: contextlib.AsyncExitStack) -> None:
        """The engine serves /metrics; this process writes its series for it, the in-flight gauge every
        INFLIGHT_REFRESH_S (a gauge computed at scrape time cannot cross processes)."""
        refresh = asyncio.get_running_loop().create_task(self._refresh_inflight(), name="capsnet-inflight-gauge")
        opened.callback(refresh.cancel)

    async def _refresh_inflight(self) -> None:
        gauge, in_flight = self.metrics.inflight, self.lifecycle.in_flight
        while True:
            gauge.set(in_flight.requests())
            await asyncio.sleep(INFLIGHT_REFRESH_S)
