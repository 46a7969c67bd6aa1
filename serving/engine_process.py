"""The engine process of a server with several front-end processes (serving/workers.py): it loads the models, runs
their batchers and backends, answers the front ends over Unix sockets, and serves the one /metrics of the server.

Each front end connects once: the engine sends it the served versions' specs, the front end answers with its tensor
slots (serving/engine_link.py), then sends requests. A request names its model version, its slot and image shape,
its deadline and arrival (time.monotonic(): one clock for every process of the host); the engine runs it through the
version's InferenceService.infer, the path a single-process server takes (values checked, batched, statistics
recorded), with the images read in place from the slot, writes its outputs into the slot and replies with their
shapes, its queue wait and its batches. A front end that goes away has its requests cancelled (they leave the queue
uncomputed).

The engine ignores SIGINT (the supervisor stops it once the front ends have drained) and stops on SIGTERM: its
batchers finish what they hold, then the backends close.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal

from capsnet.errors import CapsNetError
from capsnet.serving import engine_link
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine_link import CANCEL, INFER, SLOTS, STATISTICS, TensorSlots
from capsnet.serving.errors import ServingError
from capsnet.serving.lifecycle import Lifecycle, Phase, Tracked
from capsnet.serving.metrics import Metrics
from capsnet.serving.model_manager import ModelManager, ModelRef
from capsnet.serving.repository import OneModel, RepositoryDir, VersionPolicy

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: ServerConfig, socket_path: str):
        self.config = config
        self.socket_path = socket_path
        self.metrics = Metrics(config.max_batch_size)
        self.lifecycle = Lifecycle()
        self.models: ModelManager | None = None
        self.metrics_port: int | None = None
        self._connections: set[asyncio.Task] = set()
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
            for connection in list(self._connections):  # front ends have stopped: nothing should be left
                connection.cancel()
            await self.lifecycle.move(Phase.DRAINING)

    async def _follow_phase(self, phase: Phase) -> None:
        if phase is Phase.FAILED:
            self._failed.set()

    async def _serve_front_end(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self.models is not None
        self._connections.add(task)
        requests: dict[int, asyncio.Task] = {}
        slots: TensorSlots | None = None
        outbox = engine_link.Outbox(writer)
        try:
            outbox.send(([service.spec for service in self.models.services()],))
            while True:
                message = await engine_link.receive(reader)
                kind = message[0]
                if kind == INFER:
                    assert slots is not None  # sent before any request
                    requests[message[1]] = self._handle(self._infer(message, slots, outbox, requests), message[-1])
                elif kind == CANCEL:
                    if (request := requests.get(message[1])) is not None:
                        request.cancel()
                elif kind == STATISTICS:
                    requests[message[1]] = asyncio.ensure_future(self._statistics(message, outbox, requests))
                elif kind == SLOTS:
                    _, name, count, size = message
                    slots = TensorSlots(name, count, size)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end stopped (or died: its supervisor restarts it)
        finally:
            for request in requests.values():
                request.cancel()
            if requests:
                await asyncio.gather(*requests.values(), return_exceptions=True)
            if slots is not None:
                slots.close()
            writer.close()
            self._connections.discard(task)

    async def _infer(self, message: tuple, slots: TensorSlots, outbox: engine_link.Outbox,
                     requests: dict[int, asyncio.Task]) -> None:
        _, request_id, name, version, parts, deadline, arrival = message  # parts: (slot, image shape) per size
        assert self.models is not None
        reply: tuple  # (request id, None or the error, None or the answer)
        try:
            with self.models.use(ModelRef(name, version)) as service:
                # every output the model has: the front end answers those its request asked for; images of several
                # sizes side by side, counted as one request (as in a single-process server)
                results = await service.infer_sizes([slots.images(slot, shape) for slot, shape in parts],
                                                    field="inputs[0]",
                                                    reconstruction="reconstruction" in service.spec.output_names,
                                                    deadline=deadline, arrival=arrival)
            answers = []
            for (slot, shape), result in zip(parts, results):
                names = list(result.outputs)
                shapes = [result.outputs[output].shape for output in names]
                for output, offset in zip(names, slots.output_offsets(shape, shapes)):
                    slots.array(slot, offset, result.outputs[output].shape)[...] = result.outputs[output]
                answers.append((names, shapes, result.queue_seconds, [tuple(run) for run in result.runs]))
            reply = (request_id, None, answers)
        except asyncio.CancelledError:
            reply = (request_id, ("RequestTimeout", "cancelled"), None)
        except Exception as err:  # a request's error goes back to its front end, which answers it
            if not isinstance(err, ServingError):
                log.exception("request failed in the engine")
            reply = (request_id, engine_link.error_of(err), None)
        finally:
            requests.pop(request_id, None)
        outbox.send(reply)

    def _handle(self, infer, arrival: float) -> asyncio.Task:
        """A received request's task, counted in the engine's load (what its batchers read) from its receipt to its
        end, cancelled before it starts or not: requests read together from a front end are known to be handled
        before the first of them reaches its batcher, so that they queue for one batch instead of each running
        alone."""
        handled = Tracked(arrival)
        self.lifecycle.in_flight.add(handled)
        task = asyncio.ensure_future(infer)
        task.add_done_callback(lambda _: self.lifecycle.in_flight.remove(handled))
        return task

    async def _statistics(self, message: tuple, outbox: engine_link.Outbox,
                          requests: dict[int, asyncio.Task]) -> None:
        _, request_id, name, version = message
        assert self.models is not None
        reply: tuple
        try:
            reply = (request_id, None, await self.models.statistics(ModelRef(name, version, "name", "version")))
        except Exception as err:
            reply = (request_id, engine_link.error_of(err), None)
        finally:
            requests.pop(request_id, None)
        outbox.send(reply)


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
