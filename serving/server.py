"""The server: our API, KServe v2, health and reflection over gRPC on one port; KServe v2 over HTTP/REST on a second
(`serving/kserve_http.py`); Prometheus on a third.

Startup: load and check the model, listen with health NOT_SERVING, warm up, then SERVING.
Shutdown (SIGTERM/SIGINT), the pattern of Kubernetes' preStop delay: health NOT_SERVING at once, yet
requests are still served for the drain window, so load balancers stop sending first; then requests
that arrive get UNAVAILABLE while those that arrived before finish (up to the grace period), and only
when none is left do gRPC and HTTP stop. gRPC cancels calls it holds when it stops, so stopping it while
calls still arrive would answer them CANCELLED; the server's own refusal keeps taking them meanwhile.
Open health Watch and reflection streams are ended with UNAVAILABLE just before; our API's open streams end
once their requests in progress are answered. A second signal skips the waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from capsnet.errors import CapsNetError
from capsnet.kserve import reflection_pool
from capsnet.serving import capsnet_api, kserve_grpc, kserve_http
from capsnet.serving.config import GRPC_INT_MAX, ServerConfig
from capsnet.serving.images import max_encoded_bytes
from capsnet.serving.interceptor import RequestInterceptor
from capsnet.serving.metrics import Metrics
from capsnet.serving.service import InferenceService, ModelSpec
from capsnet.serving.tls import ServerTLS

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# What the health service answers for: "" (the whole server) and each API.
HEALTH_SERVICES = ("", capsnet_api.SERVICE_NAME, kserve_grpc.SERVICE_NAME)
# Per image, besides its pixels: protobuf framing and the fields around them. Per message: the rest.
IMAGE_OVERHEAD_BYTES = 1024
MESSAGE_OVERHEAD_BYTES = 64 * 1024
# During shutdown, after the last request that arrived before the refusals has ended, gRPC is stopped
# this much later: time for the event loop to take (and refuse) the calls gRPC still holds.
SETTLE_S = 0.1
# Then what is left are quick calls (refusals, metadata), and health Watch and reflection streams (which clients
# keep open, e.g. gRPC's client-side health checking) while they end: gRPC cancels them after this, not after the
# whole grace period.
STOP_GRACE_S = 1.0


class _CallEndedFirst(logging.Filter):
    """gRPC logs an ERROR with a traceback when an answer cannot be sent because the client cancelled (or its
    deadline passed, or it disconnected) a moment before: a race inside gRPC, which ignores the same failure once it
    has seen the cancellation. A client giving up is ordinary traffic: one WARNING line instead."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith(self.PREFIX):
            record.msg = "could not answer %s: the call had ended first (cancelled, past its deadline or disconnected)"
            record.args = (text[len(self.PREFIX):].strip(" []"),)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


GRPC_CORE_LOG = logging.getLogger("grpc._cython.cygrpc")


def message_limit(spec: ModelSpec, max_image_scale: int) -> int:
    """The default --max-message-bytes: a full batch of the largest accepted images, as float32 tensors or
    encoded (max_encoded_bytes), or of their float32 outputs, whichever is largest, with framing."""
    per_image = max(_float32_image_bytes(spec), max_encoded_bytes(spec.input_shape, max_image_scale))
    return spec.max_batch_size * (per_image + IMAGE_OVERHEAD_BYTES) + MESSAGE_OVERHEAD_BYTES


def least_message_limit(spec: ModelSpec) -> int:
    """Below this --max-message-bytes, one image as a float32 tensor, or its answer, cannot pass: every
    request of that kind would be refused."""
    return _float32_image_bytes(spec) + IMAGE_OVERHEAD_BYTES


def _float32_image_bytes(spec: ModelSpec) -> int:
    """One image as a float32 tensor (KServe FP32, raw or typed; our tensor), or its float32 outputs."""
    output_values = sum(math.prod(shape) for shape in spec.output_shapes.values())
    return 4 * max(math.prod(spec.input_shape), output_values)


class CapsNetServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics(config.max_batch_size)
        self.service: InferenceService | None = None
        self.max_message_bytes: int | None = None  # config's, or derived from the model at start()
        self.grpc_port: int | None = None  # bound ports, known after start() (the config may say 0)
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # None: no HTTP/REST (--no-http)
        self._grpc: grpc.aio.Server | None = None
        self._http: kserve_http.KServeHTTP | None = None
        self._interceptor: RequestInterceptor | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_http = None
        self._served = False  # whether health ever said SERVING
        self._stop_now = asyncio.Event()

    async def start(self, stopping: asyncio.Event | None = None) -> None:
        """Check the TLS files, load, listen, warm up, then SERVING unless `stopping` was set meanwhile (a signal
        during startup: stop() follows). CapsNetError when the model, a port or a TLS file is unusable."""
        config = self.config
        tls = None if config.tls_cert is None else ServerTLS.load(config.tls_cert, config.tls_key, config.tls_client_ca)
        self.service = InferenceService.load(config, self.metrics)
        self.max_message_bytes = config.max_message_bytes or message_limit(self.service.spec, config.max_image_scale)
        least = least_message_limit(self.service.spec)
        if self.max_message_bytes < least:  # only a given limit can be this small
            raise CapsNetError(f"--max-message-bytes {self.max_message_bytes} cannot hold one float32 image of this "
                               f"model or its answer; it must be at least {least}")
        if self.max_message_bytes > GRPC_INT_MAX:  # only a derived limit gets here: config checks a given one
            raise CapsNetError(f"the message limit derived from --max-batch-size {self.service.spec.max_batch_size} and "
                               f"--max-image-scale {config.max_image_scale} is {self.max_message_bytes} bytes, over "
                               f"gRPC's limit of {GRPC_INT_MAX}: lower them, or set --max-message-bytes")
        self._interceptor = RequestInterceptor(self.metrics, self.max_message_bytes)
        self.metrics.inflight.set_function(self._requests_in_flight)
        # Clients' mistakes logged by gRPC and aiohttp as tracebacks become one line; once per process (loggers are).
        quieted = [(GRPC_CORE_LOG, _CallEndedFirst), (kserve_http.AIOHTTP_SERVER_LOG, kserve_http.ClientErrorsAsOneLine)]
        for logger, filter_type in quieted:
            if not any(isinstance(f, filter_type) for f in logger.filters):
                logger.addFilter(filter_type())
        self._grpc = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     ("grpc.max_send_message_length", self.max_message_bytes),
                     # Calls gRPC holds until the event loop takes them; past the soft limit gRPC would cut
                     # some at random, past the hard one all, with CANCELLED: one limit, well above the queue.
                     ("grpc.server.max_pending_requests", config.max_pending_rpcs),
                     ("grpc.server.max_pending_requests_hard_limit", config.max_pending_rpcs),
                     # A port already taken is an error, not silently shared with another server.
                     ("grpc.so_reuseport", 0)],
        )
        capsnet_api.add_to_server(self._grpc, self.service, config.max_image_scale)
        kserve_grpc.add_to_server(self._grpc, self.service)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(  # kserve's `inference` files live in a pool of their own
            [capsnet_api.SERVICE_NAME, kserve_grpc.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._grpc,
            pool=reflection_pool())
        for name in HEALTH_SERVICES:
            await self._health.set(name, NOT_SERVING)

        address = _address(config.host, config.grpc_port)
        try:
            if tls is None:
                self.grpc_port = self._grpc.add_insecure_port(address)
            else:
                self.grpc_port = self._grpc.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError as err:
            raise CapsNetError(f"cannot listen on {address}: {err}") from None
        await self._grpc.start()
        try:
            self._metrics_http = self.metrics.serve_http(config.host, config.metrics_port)
        except OSError as err:
            await self._grpc.stop(None)
            raise CapsNetError(f"cannot listen on {_address(config.host, config.metrics_port)}: {err.strerror or err}") from None
        self.metrics_port = self._metrics_http.server_port

        try:
            if config.http:
                self._http = kserve_http.KServeHTTP(self.service, self.metrics, self.max_message_bytes)
                try:
                    await self._http.start(config.host, config.http_port, None if tls is None else tls.context,
                                           STOP_GRACE_S)
                except OSError as err:  # asyncio's strerror holds the address again: the errno's own text
                    raise CapsNetError(f"cannot listen on {_address(config.host, config.http_port)}: "
                                       f"{os.strerror(err.errno) if err.errno else err}") from None
                self.http_port = self._http.port
            await self.service.warmup()
        except BaseException:  # the one-line error, not gRPC's traceback about a server left running at exit
            await self._grpc.stop(None)
            if self._http is not None:
                await self._http.stop()
            self._metrics_http.shutdown()
            raise
        if stopping is not None and stopping.is_set():
            return
        for name in HEALTH_SERVICES:
            await self._health.set(name, SERVING)
        self._served = True

    async def stop(self) -> None:
        """Drain (see the module's docstring); requests still running after the grace period are cancelled.
        stop_now() meanwhile cuts the waits short: every call still running is cancelled at once."""
        await self._health.enter_graceful_shutdown()
        self.service.ready = False
        if self._served:  # balancers that saw SERVING may still send for a moment
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_now.wait(), self.config.drain_window_s)
        refusing_since = self.service.refuse_new_requests()
        deadline = refusing_since + self.config.grace_period_s
        while self._busy_before(refusing_since) and time.monotonic() < deadline and not self._stop_now.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(SETTLE_S)
        await self._interceptor.end_open_streams(STOP_GRACE_S)
        grace = None if self._stop_now.is_set() else min(STOP_GRACE_S, max(0.0, deadline - time.monotonic()))
        if self._http is not None:
            await self._http.stop()
        await self._grpc.stop(grace)
        await self.service.close()
        self._metrics_http.shutdown()
        self._metrics_http.server_close()

    def _busy_before(self, moment: float) -> bool:
        """Whether a request (gRPC or HTTP) that began before `moment` is still running."""
        return self._interceptor.busy_before(moment) or (self._http is not None and self._http.busy_before(moment))

    def _requests_in_flight(self) -> int:
        return self._interceptor.requests_in_flight() + (0 if self._http is None else self._http.requests_in_flight())

    def stop_now(self) -> None:
        """During stop(): give up draining (an operator's second signal)."""
        log.warning("stopping at once: requests still in flight are cancelled")
        self._stop_now.set()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; 0 after a graceful shutdown. A signal during startup (Kubernetes stops pods
    that are still warming up) stops the server once the startup step under way ends, without serving."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    server = CapsNetServer(config)
    await server.start(stopping)
    if stopping.is_set():
        log.info("a signal arrived during startup: stopping without serving")
    else:
        spec = server.service.spec
        secure = "s" if config.tls_cert else ""
        rest = "" if server.http_port is None else f" rest http{secure}://{_address(config.host, server.http_port)}"
        # One line on stdout that scripts (and tests, with port 0) read the bound ports from.
        print(f"capsnet serve: ready: {spec.name} {spec.version} on {spec.backend} ({spec.precision}); "
              f"grpc{secure}://{_address(config.host, server.grpc_port)} "
              f"metrics http://{_address(config.host, server.metrics_port)}/metrics{rest}", flush=True)
        await stopping.wait()
        log.info("shutting down: health NOT_SERVING; requests still served for %.1f s, then refused; those that "
                 "arrived before get up to %.1f s more", config.drain_window_s, config.grace_period_s)
    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal: stop at once
        loop.add_signal_handler(signum, server.stop_now)
    await server.stop()
    print("capsnet serve: stopped", file=sys.stderr, flush=True)
    return 0
