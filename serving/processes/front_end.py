"""A front-end process of a server with several (serving/processes/supervisor.py): the whole request path of a
single-process server (gRPC and REST, the interceptor, health, the data plane's checks, statistics, metrics, traces, the
encodings) with its models' versions in the engine process.

Each served version is an InferenceService whose queue (service.VersionQueue) is an EngineQueue: the engine core's
client over shared memory, where a single-process server's is the Batcher itself. The request path runs unchanged
down to the queue's submit(), once, here: the images, checked, are copied into one of the front end's tensor slots
(serving/processes/engine_link.py), the engine batches them with every front end's and writes the outputs into the slot.
The requests' statistics are this process's (the engine adds every front end's to its batches' when asked). When the
engine goes away, requests waiting on it fail UNAVAILABLE and the front end stops.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.batcher import (WAITED_PAST_DEADLINE, BatcherConfig, BatchOutput, BatchRun, Images,
                                            OutputSink)
from capsnet.serving.engine.model_manager import ModelManager, ModelRef, ServedModel, VersionState, VersionStatus
from capsnet.serving.engine.service import InferenceService, ModelSpec, batcher_config
from capsnet.serving.errors import DeadlineExceeded, ServerNotReady, past_deadline
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.observability.statistics import ModelStatistics
from capsnet.serving.processes import engine_link
from capsnet.serving.processes.engine_link import (Answered, Cancel, Failed, Infer, Report, ReportWanted, Slots, Specs,
                                                   Statistics, StatisticsQuery, TensorSlots)
from capsnet.serving.transports.server import CapsNetServer

log = logging.getLogger(__name__)

ENGINE_GONE = "the server's engine process has stopped; retry on another replica"
# How often the in-flight gauge is written to the shared metrics files (the engine's /metrics reads them).
INFLIGHT_REFRESH_S = 0.5


class EngineLink:
    """The front end's end of its engine connection: requests out, answers matched to them by id."""

    def __init__(self, inbox: engine_link.Inbox, writer: asyncio.StreamWriter, specs: list[ModelSpec],
                 slots: TensorSlots):
        self.specs = specs
        self.slots = slots
        self._inbox = inbox
        self._writer = writer
        self._outbox = engine_link.Outbox(writer)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}  # id -> (its answer, its slot)
        self._free = list(range(slots.count))
        self._available = asyncio.Semaphore(slots.count)
        # one request taking several slots (images of several sizes) at a time: two taking them one by one could
        # each hold some and wait for the other's
        self._taking_several = asyncio.Lock()
        self.report: Callable[[], list[dict]] = list  # this process's statistics of its requests, per version
        self.lost = asyncio.Event()  # set once the engine has gone
        self._reading = asyncio.get_running_loop().create_task(self._read(), name="capsnet-engine-link")

    @classmethod
    async def connect(cls, socket_path: str, slots_name: str, config: ServerConfig) -> "EngineLink":
        reader, writer = await asyncio.open_unix_connection(socket_path)
        inbox = engine_link.Inbox(reader)
        (hello,) = await inbox.receive()  # the engine's first message, and its only one until Slots
        assert isinstance(hello, Specs)
        specs = pickle.loads(hello.specs)
        # every request the engine may hold at once (its queue, and a batch computing) has a slot
        slots = TensorSlots.for_specs(slots_name, specs, config.max_queue_size + config.max_batch_size)
        link = cls(inbox, writer, specs, slots)
        link._outbox.send(Slots(slots.name, slots.count, slots.size))
        return link

    async def _read(self) -> None:
        try:
            while True:
                for message in await self._inbox.receive():
                    self._handle(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the engine process has closed its connection: this front end stops")
        finally:
            self.lost.set()
            for reply, _ in self._pending.values():
                if not reply.done():
                    reply.set_exception(ServerNotReady(ENGINE_GONE))
            self._pending.clear()

    def _handle(self, message: engine_link.Message) -> None:
        if isinstance(message, Answered):
            runs = [BatchRun(*run) for run in message.runs]
            for request_id, indices in message.requests:
                self._answer(request_id, [runs[index] for index in indices])
        elif isinstance(message, Failed):
            self._answer(request_id=message.id, error=engine_link.error_from(message.failure, message.message))
        elif isinstance(message, Statistics):
            self._answer(message.id, message.stats)
        elif isinstance(message, ReportWanted):
            self._outbox.send(Report(message.id, self.report()))

    def _answer(self, request_id: int, result: object = None, error: BaseException | None = None) -> None:
        reply, slot = self._pending.pop(request_id)
        if reply.cancelled():  # its caller has gone: the slot is free once the engine is done with it
            self._release(slot)
        elif error is not None:
            reply.set_exception(error)
        else:
            reply.set_result(result)

    def _release(self, slot: int) -> None:
        if slot >= 0:
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
                for slot in taken:
                    self._release(slot)
                raise
            return taken

    def _call(self, message_for: Callable[[int], engine_link.Message], slot: int = -1) -> tuple[int, asyncio.Future]:
        if self.lost.is_set():
            raise ServerNotReady(ENGINE_GONE)
        request_id = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (reply, slot)
        self._outbox.send(message_for(request_id))
        return request_id, reply

    async def infer(self, version: int, groups: list[np.ndarray], deadline: float | None) -> list[BatchOutput]:
        """One request's images, (N, C, H, W) float32 and checked, of one size or several (a group each), through
        the engine's batcher for the version Specs listed at `version`: one slot and one posted request per group,
        answered side by side."""
        slots = await self._take(len(groups))
        return list(await asyncio.gather(*(self._infer_group(version, slot, images, deadline)
                                           for slot, images in zip(slots, groups))))

    async def _infer_group(self, version: int, slot: int, images: np.ndarray,
                           deadline: float | None) -> BatchOutput:
        owned = True  # the slot is released here, unless the engine still holds it
        try:
            self.slots.images(slot, images.shape)[...] = images
            submitted = time.monotonic()
            request_id, reply = self._call(lambda request_id: Infer(request_id, version, slot, images.shape,
                                                                    deadline), slot)
            try:
                runs = await asyncio.wait_for(reply, None if deadline is None else deadline - submitted)
            except (asyncio.CancelledError, asyncio.TimeoutError) as err:
                if reply.cancelled() and not self.lost.is_set():  # the engine is told; its answer frees the slot
                    owned = False
                    past = isinstance(err, asyncio.TimeoutError) or past_deadline(
                        None if deadline is None else deadline - time.monotonic())
                    self._outbox.send(Cancel(request_id, past))
                if isinstance(err, asyncio.TimeoutError):  # an alias of TimeoutError only from Python 3.11
                    raise DeadlineExceeded(WAITED_PAST_DEADLINE) from None
                raise
            spec = self.specs[version]
            shapes = [(len(images), *shape) for shape in spec.output_shapes.values()]
            offsets = self.slots.output_offsets(images.shape, shapes)
            return BatchOutput({name: self.slots.array(slot, offset, shape).copy()
                                for name, shape, offset in zip(spec.output_shapes, shapes, offsets)},
                               runs[0].cut - submitted, runs, submitted)
        finally:
            if owned:
                self._release(slot)

    async def statistics(self, versions: list[int]) -> list[dict]:
        _, reply = self._call(lambda request_id: StatisticsQuery(request_id, versions))
        return await reply

    async def close(self) -> None:
        self._writer.close()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await self._reading
        self.slots.close()
        self.slots.unlink()


class EngineQueue:
    """A version's batcher in the engine process, as the version's InferenceService submits to it (VersionQueue)."""

    def __init__(self, link: EngineLink, version: int, config: BatcherConfig):
        self.link, self.version, self.config = link, version, config

    async def submit(self, images: Images, deadline: float | None = None,
                     sinks: dict[str, OutputSink] | None = None) -> BatchOutput:
        (output,) = await self.submit_sizes([images], deadline, sinks)
        return output

    async def submit_sizes(self, groups: list[Images], deadline: float | None = None,
                           sinks: dict[str, OutputSink] | None = None) -> list[BatchOutput]:
        # client shared memory is not served by front-end processes (serving/processes/supervisor.py): images are in
        # memory
        assert not sinks and all(isinstance(images, np.ndarray) for images in groups)
        return await self.link.infer(self.version, cast(list[np.ndarray], groups), deadline)

    async def drain(self) -> None:
        """The server closes its models after its listeners: no request of this process is left."""


class RemoteModels(ModelManager):
    """The engine's versions, as this front end serves them; the models never change (--model-control none)."""

    def __init__(self, link: EngineLink, source, config: ServerConfig, metrics: Metrics, lifecycle: Lifecycle,
                 check_spec: Callable[[ModelSpec], None]):
        super().__init__(source, config, metrics, lifecycle, check_spec)
        self.link = link
        self._indices: dict[int, int] = {}  # id(service) -> its index in the engine's list
        link.report = self._report

    async def start(self) -> None:
        self.source.check()  # the names it lists (a model and its decoder) are read from model.json
        for index, spec in enumerate(self.link.specs):
            self.check_spec(spec)
            model = self.models.setdefault(spec.name, ServedModel(spec.name))
            queue = EngineQueue(self.link, index, batcher_config(spec, self.config))
            # no backend here: the engine process runs it
            service = InferenceService(spec, None, queue, self.lifecycle,
                                       self.metrics.for_version(spec.name, spec.version),
                                       ModelStatistics(spec.name, spec.version))
            self._indices[id(service)] = index
            model.serving = {**model.serving, spec.version: service}
            model.status[spec.version] = VersionStatus(VersionState.READY)

    def _report(self) -> list[dict]:
        """This process's statistics of its requests, per version in the engine's order."""
        by_index = {self._indices[id(service)]: service for service in self.services()}
        return [by_index[index].stats.to_json() for index in range(len(self.link.specs))]

    async def warmup(self) -> None:
        """The engine warmed the backends up before this front end started."""

    async def close(self) -> None:
        """The server closes its models after its listeners: no request is left; the engine frees the backends."""
        self._closed = True

    async def statistics(self, ref: ModelRef) -> list[dict]:
        """Every front end's requests and the engine's batches, summed by the engine."""
        return await self.link.statistics([self._indices[id(service)] for service in self.selected(ref)])


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
