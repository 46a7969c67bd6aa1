"""The gRPC server: our API, KServe v2, health and reflection on one port; Prometheus on another.

Startup: load and check the model, listen with health NOT_SERVING, warm up, then SERVING.
Shutdown (SIGTERM/SIGINT): NOT_SERVING, refuse new requests, let in-flight ones finish within the
grace period, drain the batcher, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from capsnet.errors import CapsNetError
from capsnet.kserve import reflection_pool
from capsnet.serving import capsnet_api, kserve
from capsnet.serving.config import ServerConfig
from capsnet.serving.metrics import Metrics
from capsnet.serving.service import InferenceService

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# What the health service answers for: "" (the whole server) and each API.
HEALTH_SERVICES = ("", capsnet_api.SERVICE_NAME, kserve.SERVICE_NAME)


class CapsNetServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics(config.max_batch_size)
        self.service: InferenceService | None = None
        self.grpc_port: int | None = None  # bound ports, known after start() (the config may say 0)
        self.metrics_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_http = None

    async def start(self) -> None:
        """Load, listen, warm up. CapsNetError when the model, a port or a TLS file is unusable."""
        config = self.config
        self.service = InferenceService.load(config, self.metrics)
        self._grpc = grpc.aio.server(
            interceptors=[self.metrics.interceptor()],
            options=[("grpc.max_receive_message_length", config.max_message_bytes),
                     ("grpc.max_send_message_length", config.max_message_bytes),
                     # A port already taken is an error, not silently shared with another server.
                     ("grpc.so_reuseport", 0)],
        )
        capsnet_api.add_to_server(self._grpc, self.service)
        kserve.add_to_server(self._grpc, self.service)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(  # kserve's `inference` files live in a pool of their own
            [capsnet_api.SERVICE_NAME, kserve.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._grpc,
            pool=reflection_pool())
        for name in HEALTH_SERVICES:
            await self._health.set(name, NOT_SERVING)

        address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"  # IPv6
        try:
            if config.tls_cert is None:
                self.grpc_port = self._grpc.add_insecure_port(address)
            else:
                self.grpc_port = self._grpc.add_secure_port(address, _server_credentials(config))
        except RuntimeError as err:
            raise CapsNetError(f"cannot listen on {address}: {err}") from None
        await self._grpc.start()
        try:
            self._metrics_http = self.metrics.serve_http(config.host, config.metrics_port)
        except OSError as err:
            await self._grpc.stop(None)
            raise CapsNetError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {err.strerror or err}") from None
        self.metrics_port = self._metrics_http.server_port

        await self.service.warmup()
        for name in HEALTH_SERVICES:
            await self._health.set(name, SERVING)

    async def stop(self) -> None:
        """Graceful: in-flight requests get up to grace_period_s, then are cancelled."""
        await self._health.enter_graceful_shutdown()
        self.service.ready = False
        await self._grpc.stop(self.config.grace_period_s)
        await self.service.close()
        self._metrics_http.shutdown()
        self._metrics_http.server_close()


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    def read(path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as err:
            raise CapsNetError(f"cannot read {path}: {err.strerror or err}") from None

    client_ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(config.tls_key), read(config.tls_cert))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; 0 after a graceful shutdown."""
    server = CapsNetServer(config)
    await server.start()
    spec = server.service.spec
    scheme = "grpcs" if config.tls_cert else "grpc"
    # One line on stdout that scripts (and tests, with port 0) read the bound ports from.
    print(f"capsnet serve: ready: {spec.name} {spec.version} on {spec.backend} ({spec.precision}); "
          f"{scheme}://{config.host}:{server.grpc_port} metrics http://{config.host}:{server.metrics_port}/metrics",
          flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    log.info("shutting down: new requests refused, in-flight ones get %.1f s", config.grace_period_s)
    await server.stop()
    print("capsnet serve: stopped", file=sys.stderr, flush=True)
    return 0
