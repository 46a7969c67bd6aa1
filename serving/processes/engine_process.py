"""The engine process of a server with several front-end processes (serving/processes/supervisor.py): it holds the
models, their batchers and backends (the engine core that one process runs in process), answers the front ends over Unix
sockets, and serves the one /metrics of the server.

Each front end connects once: the engine sends it the served versions' specs, the front end answers with its tensor
slots (serving/processes/engine_link.py), then posts requests, many in one write. Every request was handled in its front
end (decoded, checked, counted, traced); here it is only taken into its version's batcher: its images are read in place
from its slot into the batch, and the batcher writes its outputs straight from the batch into the slot. The engine
answers each front end once per batch (Answered: the run, and the requests it finished). It keeps no statistics of
requests: a statistics query gathers every front end's and adds the batches' (Triton's statistics extension stays exact
across processes); the metrics of batches are the engine's, those of requests the front ends' (prometheus' multiprocess
mode sums them). A front end that goes away has its queued requests withdrawn (they leave the queue uncomputed).

The engine ignores SIGINT (the supervisor stops it once the front ends have drained) and stops on SIGTERM: its
batchers finish what they hold, then the backends close.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import itertools
import logging
import os
import pickle
import signal

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.batcher import Batcher, BatchOutput, BatchRun, OutputSink
from capsnet.serving.engine.model_manager import ModelManager
from capsnet.serving.engine.repository import OneModel, RepositoryDir
from capsnet.serving.engine.service import InferenceService
from capsnet.serving.errors import ServingError
from capsnet.serving.lifecycle import Lifecycle, Phase
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.processes import engine_link
from capsnet.serving.processes.engine_link import (Answered, Cancel, Failed, Infer, Report, ReportWanted, Slots, Specs,
                                                   Statistics, StatisticsQuery, TensorSlots)
from capsnet.serving.version_policy import VersionPolicy

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: ServerConfig, socket_path: str):
        self.config = config
        self.socket_path = socket_path
        self.metrics = Metrics(config.max_batch_size)
        self.lifecycle = Lifecycle()
        self.models: ModelManager | None = None
        self.versions: list[InferenceService] = []  # the served versions, as Infer messages index them
        self.batchers: list[Batcher] = []  # theirs
        self.metrics_port: int | None = None
        self._front_ends: set[FrontEndConnection] = set()
        self._failed = asyncio.Event()
        self.lifecycle.on_change(self._follow_phase)

    async def run(self, announce, stopping: asyncio.Event) -> None:
        """Load, warm up, listen; announce(metrics port) once serving; serve until `stopping`, then drain."""
        config = self.config
        source: OneModel | RepositoryDir = (
            RepositoryDir(config.model_repository, VersionPolicy.parse(config.version_policy))
            if config.model_repository is not None else OneModel(config.model_dir))  # type: ignore[arg-type]
        async with contextlib.AsyncExitStack() as opened:
            self.models = ModelManager(source, config, self.metrics, self.lifecycle)
            opened.push_async_callback(self.models.close)
            await self.models.start()
            await self.models.warmup()
            self.versions = self.models.services()
            self.batchers = [service.batcher for service in self.versions
                             if isinstance(service.batcher, Batcher)]  # every one: this process runs them
            for batcher in self.batchers:
                batcher.overlap_loop_work = False
            try:
                metrics_http = self.metrics.serve_http(config.host, config.metrics_port)
            except OSError as err:
                raise CapsNetError(f"cannot listen on {config.host}:{config.metrics_port}: "
                                   f"{err.strerror or err}") from None
            opened.callback(metrics_http.server_close)
            opened.callback(metrics_http.shutdown)
            self.metrics_port = metrics_http.server_port
            listener = await asyncio.start_unix_server(self._serve_front_end, self.socket_path)
            opened.callback(listener.close)
            gc.collect()
            gc.freeze()  # as CapsNetServer.start: full collections never rescan the models
            await self.lifecycle.move(Phase.SERVING)
            announce(self.metrics_port)
            waits = [asyncio.ensure_future(self._failed.wait()), asyncio.ensure_future(stopping.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            if self._failed.is_set():  # a backend that can no longer run: the supervisor stops the server
                raise CapsNetError(f"the engine cannot serve: {self.lifecycle.failure}")
            listener.close()
            for front_end in list(self._front_ends):  # front ends have stopped: nothing should be left
                front_end.close()
            await self.lifecycle.move(Phase.DRAINING)

    async def _follow_phase(self, phase: Phase) -> None:
        if phase is Phase.FAILED:
            self._failed.set()

    async def _serve_front_end(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front_end = FrontEndConnection(self, writer)
        self._front_ends.add(front_end)
        inbox = engine_link.Inbox(reader)
        try:
            front_end.outbox.send(Specs(pickle.dumps([service.spec for service in self.versions])))
            while True:
                for message in await inbox.receive():
                    front_end.handle(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end stopped (or died: its supervisor restarts it)
        finally:
            self._front_ends.discard(front_end)
            front_end.close()
            writer.close()

    async def statistics(self, versions: list[int]) -> list[dict]:
        """Triton's statistics of `versions`: the batches this process ran, and every front end's requests."""
        reports = await asyncio.gather(*(front_end.report() for front_end in list(self._front_ends)))
        totals = []
        for index in versions:
            total = copy.deepcopy(self.versions[index].stats)  # the batches; requests are counted by front ends
            for report in reports:
                if report:  # empty from a front end that went away meanwhile
                    total.add_requests(report[index])
            totals.append(total.to_json())
        return totals


class SlotRows:
    """A request's output in its slot (OutputSink): the batcher writes its rows there from the batch, once."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array  # (N, ...) float32, a view of the slot

    def write(self, rows, start: int) -> None:
        self.array[start:start + len(rows)] = rows if isinstance(rows, np.ndarray) else rows.cpu().numpy()


class Posted:
    """A posted request's end (batcher.Completion), answered to its front end."""

    __slots__ = ("front_end", "id", "ended")

    def __init__(self, front_end: "FrontEndConnection", request_id: int):
        self.front_end, self.id, self.ended = front_end, request_id, False

    def done(self) -> bool:
        return self.ended

    def set_result(self, output: BatchOutput) -> None:
        self.ended = True
        self.front_end.answered(self.id, output.runs)

    def set_exception(self, err: BaseException) -> None:
        self.ended = True
        self.front_end.failed(self.id, err)


class FrontEndConnection:
    """One front end's connection: its slots, the requests it posted, and its answers, gathered once per batch."""

    def __init__(self, engine: Engine, writer: asyncio.StreamWriter):
        self.engine = engine
        self.outbox = engine_link.Outbox(writer)
        self.slots: TensorSlots | None = None
        self.posted: dict[int, tuple[Batcher, object]] = {}  # request id -> its batcher and its handle there
        self._runs: dict[BatchRun, int] = {}  # the runs the answers being gathered took part in -> their index
        self._answers: list[tuple[int, list[int]]] = []
        self._reports: dict[int, asyncio.Future] = {}  # statistics reports asked of this front end
        self._report_ids = itertools.count()
        self._queries: set[asyncio.Task] = set()  # statistics queries being answered (held: a task needs a reference)
        # slot -> ((version, shape), its images, its outputs' sinks): the views of a slot's last request, which
        # its next request of the same shape takes again (one-image traffic always does) instead of making them
        self._views: dict[int, tuple[tuple, np.ndarray, dict[str, OutputSink]]] = {}
        self.closed = False

    def handle(self, message: engine_link.Message) -> None:
        if isinstance(message, Infer):
            self._infer(message)
        elif isinstance(message, Cancel):
            if (posted := self.posted.get(message.id)) is not None:
                batcher, handle = posted
                batcher.withdraw(handle, "deadline" if message.past_deadline else "cancelled")
        elif isinstance(message, Report):
            if (report := self._reports.pop(message.id, None)) is not None and not report.done():
                report.set_result(message.stats)
        elif isinstance(message, StatisticsQuery):
            query = asyncio.ensure_future(self._statistics(message))
            self._queries.add(query)
            query.add_done_callback(self._queries.discard)
        elif isinstance(message, Slots):
            self.slots = TensorSlots(message.name, message.count, message.size)

    def _infer(self, message: Infer) -> None:
        batcher = self.engine.batchers[message.version]
        images, sinks = self._slot_views(message.slot, message.version, message.shape)
        try:
            handle = batcher.post(images, message.deadline, sinks, Posted(self, message.id))
        except ServingError as err:  # queue full
            self.failed(message.id, err)
            return
        self.posted[message.id] = (batcher, handle)

    def _slot_views(self, slot: int, version: int, shape: tuple[int, ...]) -> tuple[np.ndarray, dict[str, OutputSink]]:
        """The images of a request in `slot` and the sinks of its outputs there, for the version's outputs."""
        key = (version, shape)
        views = self._views.get(slot)
        if views is not None and views[0] == key:
            return views[1], views[2]
        slots = self.slots
        assert slots is not None  # sent before any request
        rows = list(self.engine.versions[version].spec.output_shapes.items())
        offsets = slots.output_offsets(shape, [(shape[0], *row) for _, row in rows])
        sinks: dict[str, OutputSink] = {name: SlotRows(slots.array(slot, offset, (shape[0], *row)))
                                        for (name, row), offset in zip(rows, offsets)}
        images = slots.images(slot, shape)
        self._views[slot] = (key, images, sinks)
        return images, sinks

    def answered(self, request_id: int, runs: list[BatchRun]) -> None:
        """Its outputs are in its slot: answered with the others of this batch, in one message."""
        self.posted.pop(request_id, None)
        if not self._answers:
            asyncio.get_running_loop().call_soon(self._send_answers)
        self._answers.append((request_id, [self._runs.setdefault(run, len(self._runs)) for run in runs]))

    def _send_answers(self) -> None:
        runs = [(run.size, run.cut, run.run_start, run.run_end, run.delivered) for run in self._runs]
        self.outbox.send_now(Answered(runs, self._answers))
        self._runs, self._answers = {}, []
        self._close_slots_if_done()

    def failed(self, request_id: int, err: BaseException) -> None:
        self.posted.pop(request_id, None)
        if not isinstance(err, ServingError):
            log.error("request failed in the engine: %s", err)
        failure = engine_link.failure_of(err)
        self.outbox.send(Failed(request_id, failure.failure, failure.message))
        self._close_slots_if_done()

    async def report(self) -> list[dict]:
        """This front end's statistics of its requests, per version ([] once it has gone)."""
        if self.closed:
            return []
        report_id = next(self._report_ids)
        reply = self._reports[report_id] = asyncio.get_running_loop().create_future()
        self.outbox.send(ReportWanted(report_id))
        return await reply

    async def _statistics(self, query: StatisticsQuery) -> None:
        self.outbox.send(Statistics(query.id, await self.engine.statistics(query.versions)))

    def close(self) -> None:
        """The front end has gone: its queued requests leave their queues; its slots close once no batch writes into
        them."""
        if self.closed:
            return
        self.closed = True
        for report in self._reports.values():
            if not report.done():
                report.set_result([])
        for batcher, handle in list(self.posted.values()):
            batcher.withdraw(handle, "cancelled")
        self._close_slots_if_done()

    def _close_slots_if_done(self) -> None:
        if self.closed and not self.posted and self.slots is not None:
            self._views.clear()  # views of the map would keep it from closing
            self.slots.close()
            self.slots = None


async def run_engine(config: ServerConfig, socket_path: str, announce) -> int:
    """The engine's life: 0 after SIGTERM and a drain, 2 when it cannot start or its backend fails."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    engine = Engine(config, socket_path)
    try:
        await engine.run(announce, stopping)
    except CapsNetError as err:
        log.error("engine: %s", err)
        return 2
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    return 0
