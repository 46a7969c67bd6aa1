"""The server: our API, KServe v2, health and reflection over gRPC on one port; KServe v2 over HTTP/REST on a second
(`serving/transports/kserve_http.py`); Prometheus on a third. Its phase is the lifecycle's (`serving/lifecycle.py`),
which gRPC health follows.

Startup, through one exit stack (a failing step undoes the steps before it, in reverse): check the TLS files, load
and check the models (`--model`'s one, or every model of `--model-repository`: `serving/engine/model_manager.py`),
listen with health NOT_SERVING, warm up, then SERVING. While serving, the models of a repository may change without a
restart (--model-control explicit: the repository extension's load and unload, and SIGHUP; poll: a rescan every
--poll-seconds, and SIGHUP); the server's phase is not theirs: a model without a version is not ready, the server is.
Shutdown (SIGTERM/SIGINT), the pattern of Kubernetes' preStop delay: DRAINING, health NOT_SERVING at once, yet
requests are still served for the drain window, so load balancers stop sending first; then requests that arrive get
UNAVAILABLE while those that arrived before finish (up to the grace period; the drain waits on an event set when the
last of them ends). gRPC cancels calls it holds when it stops, so stopping it while calls still arrive would answer
them CANCELLED: the server goes on refusing until no call has arrived for SETTLE_S. Then open health Watch and
reflection streams end UNAVAILABLE (our API's open streams end once their requests in progress are answered), and
gRPC, HTTP and the model close, through the startup's exit stack. A second signal skips the waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from capsnet.errors import CapsNetError
from capsnet.kserve import reflection_pool
from capsnet.model_description.decoder import DECODER_PART
from capsnet.serving.config import GRPC_INT_MAX, ServerConfig
from capsnet.serving.engine.backend_registry import takes_cuda_shared_memory
from capsnet.serving.engine.model_manager import ModelManager
from capsnet.serving.engine.repository import OneModel, RepositoryDir
from capsnet.serving.engine.service import InferenceService, ModelSpec
from capsnet.serving.lifecycle import Lifecycle, Phase
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.observability.observe import Observer
from capsnet.serving.observability.tracing import Tracing
from capsnet.serving.protocol import capsnet_api, kserve
from capsnet.serving.protocol.images import largest_encoded, max_encoded_bytes
from capsnet.serving.protocol.shared_memory import SharedMemory
from capsnet.serving.transports import kserve_grpc, kserve_http
from capsnet.serving.transports.interceptor import RequestInterceptor
from capsnet.serving.version_policy import VersionPolicy
from capsnet.tls import ServerTLS

try:  # what grpc.aio raises when it cannot send an answer: see _CallEndedFirst
    from grpc._cython.cygrpc import ExecuteBatchError
except ImportError:  # gone from grpcio: the filter matches nothing, and its test fails
    ExecuteBatchError = None

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# What the health service answers for: "" (the whole server) and each API.
HEALTH_SERVICES = ("", capsnet_api.SERVICE_NAME, kserve_grpc.SERVICE_NAME)
# Per image, besides its pixels: protobuf framing and the fields around them. Per message: the rest.
IMAGE_OVERHEAD_BYTES = 1024
MESSAGE_OVERHEAD_BYTES = 64 * 1024
# During shutdown, once the requests that arrived before the refusals have ended, gRPC is stopped when no call has
# arrived for this long: the event loop has taken (and refused) the calls gRPC held.
SETTLE_S = 0.1
# Then what is left are quick calls (refusals, metadata), and health Watch and reflection streams (which clients
# keep open, e.g. gRPC's client-side health checking) while they end: gRPC cancels them after this, not after the
# whole grace period.
STOP_GRACE_S = 1.0


class _CallEndedFirst(logging.Filter):
    """gRPC logs an ERROR with a traceback when an answer cannot be sent because the client cancelled (or its
    deadline passed, or it disconnected) a moment before: a race inside gRPC, which ignores the same failure once it
    has seen the cancellation. A client giving up is ordinary traffic: one WARNING line instead. The record is
    known by its exception (ExecuteBatchError), not by its wording; the method is the gRPC path it names."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if ExecuteBatchError is not None and isinstance(error, ExecuteBatchError):
            method = RPC_PATH.search(record.getMessage())
            record.msg = "could not answer %s: the call had ended first (cancelled, past its deadline or disconnected)"
            record.args = (method[0] if method else "a call",)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


GRPC_CORE_LOG = logging.getLogger("grpc._cython.cygrpc")
RPC_PATH = re.compile(r"/[\w.]+/\w+")  # /package.Service/Method


def quiet_client_errors() -> None:
    """Clients' mistakes that gRPC and aiohttp log as tracebacks become one line; once per process (loggers are)."""
    for logger, filter_type in [(GRPC_CORE_LOG, _CallEndedFirst),
                                (kserve_http.AIOHTTP_SERVER_LOG, kserve_http.ClientErrorsAsOneLine)]:
        if not any(isinstance(installed, filter_type) for installed in logger.filters):
            logger.addFilter(filter_type())


def message_limit(spec: ModelSpec, max_image_scale: int) -> int:
    """The default --max-message-bytes: a full batch of the largest accepted images, as float32 tensors or
    encoded (max_encoded_bytes), or of their float32 outputs, whichever is largest, with framing."""
    per_image = _float32_image_bytes(spec)
    if spec.part != DECODER_PART:  # a decoder takes no encoded images
        per_image = max(per_image, max_encoded_bytes(largest_encoded(spec.sizes, spec.input_shape, max_image_scale)))
    return spec.max_batch_size * (per_image + IMAGE_OVERHEAD_BYTES) + MESSAGE_OVERHEAD_BYTES


def least_message_limit(spec: ModelSpec) -> int:
    """Below this --max-message-bytes, one image as a float32 tensor, or its answer, cannot pass: every
    request of that kind would be refused."""
    return _float32_image_bytes(spec) + IMAGE_OVERHEAD_BYTES


def _float32_image_bytes(spec: ModelSpec) -> int:
    """The largest image as a float32 tensor (KServe FP32, raw or typed; our tensor), or its float32 outputs."""
    output_values = sum(math.prod(shape) for shape in spec.output_shapes.values())
    if spec.part == DECODER_PART and spec.decoder is not None:  # its poses and an int64 class index
        return 4 * max(math.prod(spec.decoder.pose_shape) + 2, output_values)
    return 4 * max(math.prod(spec.sizes.largest), output_values)  # a model of any size: its largest image


def checked_message_limit(config: ServerConfig, specs: list[ModelSpec]) -> int:
    """--max-message-bytes, or the limit derived from the models (the largest); CapsNetError when one cannot serve."""
    limit = config.max_message_bytes or max(message_limit(spec, config.max_image_scale) for spec in specs)
    for spec in specs:  # only a given limit can be too small here
        check_message_limit(config, limit, spec)
    if limit > GRPC_INT_MAX:  # only a derived limit gets here: config checks a given one
        raise CapsNetError(f"the message limit derived from --max-batch-size {config.max_batch_size} and "
                           f"--max-image-scale {config.max_image_scale} is {limit} bytes, over gRPC's limit of "
                           f"{GRPC_INT_MAX}: lower them, or set --max-message-bytes")
    return limit


def check_message_limit(config: ServerConfig, limit: int, spec: ModelSpec) -> None:
    """CapsNetError when messages of `limit` bytes cannot carry one float32 image of `spec`, or its answer (a version
    loaded later may take larger images than the models the limit was derived from)."""
    least = least_message_limit(spec)
    if limit < least:
        what = (f"--max-message-bytes {limit}" if config.max_message_bytes
                else f"the message limit derived from the models at start ({limit} bytes)")
        raise CapsNetError(f"{what} cannot hold one float32 image of this model or its answer; it must be at least "
                           f"{least}")


class CapsNetServer:
    # front-end processes (serving/processes/supervisor.py) listen on one port together, through SO_REUSEPORT
    REUSE_PORT = False

    def __init__(self, config: ServerConfig, tracing: Tracing | None = None):
        """`tracing`: spans to this Tracing (tests: an in-memory exporter); None: as the config and the OTEL_*
        variables say (serving/observability/tracing.py)."""
        self.config = config
        self.metrics = Metrics(config.max_batch_size)
        self.lifecycle = Lifecycle()
        self.lifecycle.on_change(self._follow_phase)
        self.models: ModelManager | None = None
        self._tracing = tracing
        self.observer: Observer | None = None
        self.max_message_bytes: int | None = None  # config's, or derived from the models at start()
        self.grpc_port: int | None = None  # bound ports, known after start() (the config may say 0)
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # None: no HTTP/REST (--no-http)
        self._grpc: grpc.aio.Server | None = None
        self._http: kserve_http.KServeHTTP | None = None
        self._interceptor: RequestInterceptor | None = None
        self._health = health.aio.HealthServicer()
        self._opened = contextlib.AsyncExitStack()  # what start() opened, closed by stop() in reverse
        self._grpc_grace: float | None = None  # how long gRPC's stop lets calls finish; None: cancelled at once
        self._cut_short = asyncio.Event()  # stop_now(): the waits of stop() end

    @property
    def service(self) -> InferenceService:
        """The default version of the server's one model (with several, the first model's)."""
        assert self.models is not None, "start() first"
        service = next(iter(self.models.models.values())).default
        assert service is not None, "start() loads at least one version"
        return service

    async def start(self, stopping: asyncio.Event | None = None) -> None:
        """Load, listen, warm up, then SERVING unless `stopping` was set meanwhile (a signal during startup:
        stop() follows). CapsNetError when a model, a port or a TLS file is unusable; what was opened is closed."""
        config = self.config
        quiet_client_errors()
        tls = (None if config.tls_cert is None or config.tls_key is None  # both or neither: ServerConfig checks
               else ServerTLS.load(config.tls_cert, config.tls_key, config.tls_client_ca))
        async with contextlib.AsyncExitStack() as opened:
            tracing = self._tracing or Tracing.from_config(config.otlp_endpoint)
            if tracing is not None:
                opened.callback(tracing.shutdown)  # the last step of stop(): spans of the last requests go out
            self.observer = Observer(self.metrics, access_log=config.log_format == "json", tracing=tracing)
            source: OneModel | RepositoryDir
            if config.model_repository is not None:
                source = RepositoryDir(config.model_repository, VersionPolicy.parse(config.version_policy))
            else:
                assert config.model_dir is not None  # ServerConfig holds exactly one of the two
                source = OneModel(config.model_dir)
            self.models = self._model_manager(source)
            opened.push_async_callback(self.models.close)
            await self.models.start()
            self.max_message_bytes = checked_message_limit(config, [s.spec for s in self.models.services()])
            self.metrics.inflight.set_function(self.lifecycle.in_flight.requests)
            shared_memory = SharedMemory(config.allow_client_shm, config.max_shm_regions, config.max_shm_bytes,
                                         self._on_gpu)
            opened.callback(shared_memory.close)  # after the listeners close (a stack): no request holds a region
            plane = kserve.DataPlane(self.models, self.lifecycle, shared_memory,
                                     client_certificates=config.tls_client_ca is not None)
            self._grpc = await self._listen_grpc(plane, tls)
            opened.push_async_callback(self._close_listeners)
            self._open_metrics(opened)
            if config.http:
                self._http = await self._listen_http(plane, tls)
            await self.models.warmup()
            # What startup made (torch, ONNX Runtime, the models: hundreds of thousands of objects) lives as long as
            # the server. Left in the collector's oldest generation, every full collection scans it again and holds
            # the GIL for hundreds of ms (docs/experiments), stalling the event loop: requests wait, and calls
            # with short deadlines expire before their handler runs. Frozen, a collection scans only what came after.
            gc.collect()
            gc.freeze()
            if config.model_control == "poll":
                poll = asyncio.get_running_loop().create_task(self._poll(), name="capsnet-repository-poll")
                opened.callback(poll.cancel)
            self._opened = opened.pop_all()
        if stopping is None or not stopping.is_set():
            await self.lifecycle.move(Phase.SERVING)

    def _model_manager(self, source: OneModel | RepositoryDir) -> ModelManager:
        """The models this process serves: loaded here (a front-end process of serving/processes/supervisor.py asks its
        engine)."""
        return ModelManager(source, self.config, self.metrics, self.lifecycle, self._check_spec)

    def _open_metrics(self, opened: contextlib.AsyncExitStack) -> None:
        """/metrics on the metrics port, closed with the rest (front-end processes leave it to their engine)."""
        opened.callback(self._close_metrics, self._listen_metrics())

    def _check_spec(self, spec: ModelSpec) -> None:
        """A version loaded while serving must fit the message limit the listeners were started with."""
        if self.max_message_bytes is not None:
            check_message_limit(self.config, self.max_message_bytes, spec)

    async def rescan(self) -> None:
        """SIGHUP: the repository as on disk now (--model-control explicit or poll); logged, and ignored, otherwise."""
        if self.lifecycle.phase is not Phase.SERVING:
            log.warning("SIGHUP ignored: the server is %s", self.lifecycle.phase.value)
        elif self.config.model_control == "none":
            log.warning("SIGHUP ignored: model control is off (--model-control none); the models serve as loaded "
                        "at start")
        else:
            log.info("rescanning the model repository %s", self.config.model_repository)
            assert self.models is not None  # made by start(), before the phase leaves STARTING
            await self.models.rescan()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            await self.rescan()

    async def _listen_grpc(self, plane: kserve.DataPlane, tls: ServerTLS | None) -> grpc.aio.Server:
        config = self.config
        # set by start() before listening
        assert self.observer is not None and self.max_message_bytes is not None and self.models is not None
        self._interceptor = RequestInterceptor(self.observer, self.max_message_bytes, self.lifecycle.in_flight)
        server = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     ("grpc.max_send_message_length", self.max_message_bytes),
                     # Calls gRPC holds until the event loop takes them; past the soft limit gRPC would cut
                     # some at random, past the hard one all, with CANCELLED: one limit, well above the queue.
                     ("grpc.server.max_pending_requests", config.max_pending_rpcs),
                     ("grpc.server.max_pending_requests_hard_limit", config.max_pending_rpcs),
                     # A port already taken is an error, not silently shared with another server (front-end
                     # processes share theirs: REUSE_PORT).
                     ("grpc.so_reuseport", int(self.REUSE_PORT))],
        )
        capsnet_api.add_to_server(server, self.models, config.max_image_scale)
        kserve_grpc.add_to_server(server, plane)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(  # kserve's `inference` files live in a pool of their own
            [capsnet_api.SERVICE_NAME, kserve_grpc.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server,
            pool=reflection_pool())
        for name in HEALTH_SERVICES:
            await self._health.set(name, NOT_SERVING)
        address = _address(config.host, config.grpc_port)
        try:
            if tls is None:
                self.grpc_port = server.add_insecure_port(address)
            else:
                self.grpc_port = server.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError as err:
            raise CapsNetError(f"cannot listen on {address}: {err}") from None
        await server.start()
        return server

    def _listen_metrics(self):
        config = self.config
        try:
            metrics_http = self.metrics.serve_http(config.host, config.metrics_port)
        except OSError as err:
            raise CapsNetError(f"cannot listen on {_address(config.host, config.metrics_port)}: "
                               f"{err.strerror or err}") from None
        self.metrics_port = metrics_http.server_port
        return metrics_http

    async def _listen_http(self, plane: kserve.DataPlane, tls: ServerTLS | None) -> kserve_http.KServeHTTP:
        assert self.observer is not None and self.max_message_bytes is not None  # set by start() before listening
        config = self.config
        http = kserve_http.KServeHTTP(plane, self.observer, self.max_message_bytes, ui=config.ui)
        try:
            await http.start(config.host, config.http_port, None if tls is None else tls.context, STOP_GRACE_S,
                             reuse_port=self.REUSE_PORT)
        except OSError as err:  # asyncio's strerror holds the address again: the errno's own text
            raise CapsNetError(f"cannot listen on {_address(config.host, config.http_port)}: "
                               f"{os.strerror(err.errno) if err.errno else err}") from None
        self.http_port = http.port
        return http

    async def _close_listeners(self) -> None:
        """gRPC, and REST once it listens, together: the shutdown's last step takes STOP_GRACE_S, not twice that."""
        assert self._grpc is not None  # registered with the exit stack once gRPC listens
        await asyncio.gather(self._grpc.stop(self._grpc_grace), *([self._http.close()] if self._http else []))

    @staticmethod
    def _close_metrics(metrics_http) -> None:
        metrics_http.shutdown()
        metrics_http.server_close()

    async def _follow_phase(self, phase: Phase) -> None:
        """gRPC health follows the phase: SERVING only while serving."""
        if phase is Phase.SERVING or phase is Phase.FAILED:
            for name in HEALTH_SERVICES:
                await self._health.set(name, SERVING if phase is Phase.SERVING else NOT_SERVING)
        elif phase is Phase.DRAINING:
            await self._health.enter_graceful_shutdown()  # NOT_SERVING, for good

    def _on_gpu(self) -> bool:
        """Whether a model version serves on a CUDA device with a backend that takes CUDA shared memory there."""
        return self.models is not None and any(
            service.backend is not None and takes_cuda_shared_memory(service.backend)
            for service in self.models.services())

    async def stop(self) -> None:
        """Drain (see the module's docstring); requests still running after the grace period are cancelled.
        stop_now() meanwhile cuts the waits short: every call still running is cancelled at once."""
        config, lifecycle = self.config, self.lifecycle
        served = lifecycle.phase is Phase.SERVING
        await lifecycle.move(Phase.DRAINING)
        if served:  # balancers that saw SERVING may still send for a moment
            await self._until(time.monotonic() + config.drain_window_s)
        refusing_from = lifecycle.refuse_new()
        deadline = refusing_from + config.grace_period_s
        await self._until(deadline, lifecycle.in_flight.drained(refusing_from))
        if self._http is not None:
            await self._http.stop_listening()
        await self._until(max(deadline, time.monotonic() + SETTLE_S), lifecycle.in_flight.quiet(SETTLE_S))
        if self._interceptor is not None:  # None: start() failed before gRPC listened
            await self._interceptor.end_open_streams(STOP_GRACE_S)
        if not self._cut_short.is_set():
            self._grpc_grace = min(STOP_GRACE_S, max(0.0, deadline - time.monotonic()))
        await self._opened.aclose()
        await lifecycle.move(Phase.STOPPED)

    async def _until(self, deadline: float, awaitable=None) -> None:
        """Wait for `awaitable` (None: for nothing) until `deadline` (time.monotonic()), or until stop_now()."""
        waits = {asyncio.ensure_future(self._cut_short.wait())}
        if awaitable is not None:
            waits.add(asyncio.ensure_future(awaitable))
        try:
            await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def stop_now(self) -> None:
        """During stop(): give up draining (an operator's second signal)."""
        log.warning("stopping at once: requests still in flight are cancelled")
        self._cut_short.set()


def _address(host: str, port: int | None) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets


def _print_ready(line: str) -> None:
    print(line, flush=True)


async def serve(config: ServerConfig, server: CapsNetServer | None = None,
                announce: Callable[[str], None] = _print_ready) -> int:
    """Run until SIGTERM or SIGINT; 0 after a graceful shutdown. A signal during startup (Kubernetes stops pods
    that are still warming up) stops the server once the startup step under way ends, without serving. `server`: a
    front-end process's (serving/processes/front_end.py), which announces its ready line to its supervisor."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    server = server or CapsNetServer(config)
    rescans: set[asyncio.Task] = set()

    def rescan() -> None:  # SIGHUP (its default action would end the process)
        task = loop.create_task(server.rescan(), name="capsnet-sighup-rescan")
        rescans.add(task)
        task.add_done_callback(rescans.discard)

    loop.add_signal_handler(signal.SIGHUP, rescan)
    await server.start(stopping)
    if stopping.is_set():
        log.info("a signal arrived during startup: stopping without serving")
    else:
        assert server.models is not None  # start() made it
        served = ", ".join(f"{s.spec.name} {s.spec.version} on {s.spec.backend} ({s.spec.precision})"
                           for s in server.models.services())
        secure = "s" if config.tls_cert else ""
        rest = "" if server.http_port is None else f" rest http{secure}://{_address(config.host, server.http_port)}"
        # One line on stdout that scripts (and tests, with port 0) read the bound ports from.
        announce(f"capsnet serve: ready: {served}; "
                 f"grpc{secure}://{_address(config.host, server.grpc_port)} "
                 f"metrics http://{_address(config.host, server.metrics_port)}/metrics{rest}")
        await stopping.wait()
        log.info("shutting down: health NOT_SERVING; requests still served for %.1f s, then refused; those that "
                 "arrived before get up to %.1f s more", config.drain_window_s, config.grace_period_s)
    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal: stop at once
        loop.add_signal_handler(signum, server.stop_now)
    await server.stop()
    print("capsnet serve: stopped", file=sys.stderr, flush=True)
    return 0
