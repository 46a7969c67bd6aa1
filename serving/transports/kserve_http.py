"""KServe v2 / Open Inference Protocol over HTTP/REST, with Triton's binary tensor data extension: the routes.

The REST face of what `serving/transports/kserve_grpc.py` serves over gRPC, on its own port (Triton's 8000), so that
`tritonclient.http`, KServe's REST clients, curl and HTTP health probes work unchanged. Both go through the one data
plane (`serving/protocol/kserve.py`); here only what is HTTP's: routes, answers and their statuses. A request's body is
read by `serving/transports/http_body.py` (limits, decompression, time, budget) and decoded and encoded by
`serving/transports/kserve_http_codec.py` (JSON and binary data).

Routes (`{model}` is a served model's name; every model route also takes `/versions/{version}` after it):

    GET  /v2/health/live, /v2/health/ready        200, or 400 when not (the protocol's "4xx"), empty body
    GET  /v2                                      server metadata
    GET  /v2/models/{model}[/ready|/config]       model metadata, readiness, Triton's model config
    GET  /v2/models[/{model}]/stats               Triton's statistics: of every model, or of one (or one version)
    POST /v2/models/{model}/infer                 inference
    POST /v2/repository/index                     the repository's models and their versions' states
    POST /v2/repository/models/{model}/load       load or reload a model (--model-control explicit)
    POST /v2/repository/models/{model}/unload     unload a model
    GET  /v2/{kind}sharedmemory[/region/{name}]/status     Triton's shared-memory extensions, `kind` system or cuda:
    POST /v2/{kind}sharedmemory/region/{name}/register     the regions registered, register one, unregister one or
    POST /v2/{kind}sharedmemory[/region/{name}]/unregister all

Errors are `{"error": message}` with the HTTP status their kind carries (`serving/errors.py`). Every request is
recorded (`serving/observability/observe.py`: metrics as gRPC's calls are, under api="kserve_http" and the kind's gRPC
code; an access line and a trace where asked). An answer must be taken by the client within WRITE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from importlib import resources

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from capsnet.serving.errors import InvalidInput, MethodNotAllowed, NoSuchRoute, ServingError, bounded_message
from capsnet.serving.lifecycle import Tracked
from capsnet.serving.observability.observe import CURRENT, TRACEPARENT, Observer, RequestRecord
from capsnet.serving.protocol import kserve
from capsnet.serving.protocol.shared_memory import CUDA, SYSTEM
from capsnet.serving.transports.http_body import BodyReader
from capsnet.serving.transports.kserve_http_codec import BINARY_HEADER, RestDecoder, parse_json

PAGE = resources.files("capsnet.serving") / "ui" / "index.html"  # shipped in the package (pyproject's package-data)
ICON = resources.files("capsnet.serving") / "ui" / "favicon.svg"  # what browsers ask /favicon.ico for, as SVG
log = logging.getLogger(__name__)

API = "kserve_http"
# An idle keep-alive connection is closed after this long (aiohttp's default is an hour).
KEEPALIVE_S = 75.0
# An answer must have been taken by the client this long after it is ready, or the connection is closed: a client that
# sends requests (pipelined) and never reads would otherwise hold their answers in memory without end.
WRITE_TIMEOUT_S = 30.0
# What aiohttp buffers of a connection's body before it stops reading its socket (twice this), whether the body is read
# or not: with aiohttp's default (256 KiB), every connection stalled mid-body holds 512 KiB (docs/experiments).
READ_BUFFER_BYTES = 64 * 1024


class ClientErrorsAsOneLine(logging.Filter):
    """aiohttp logs an ERROR with a traceback for a request it cannot parse (a header line over 8 KiB, a bad
    Content-Length, ...), which it answers 400 itself: a client's mistake, one WARNING line like gRPC's (the server
    installs it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= error.code < 500:
            record.msg, record.args = "%s, answered %d: %s", (record.getMessage(), error.code,
                                                             " ".join(str(error.message).split())[:200])
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


AIOHTTP_SERVER_LOG = logging.getLogger("aiohttp.server")


class KServeHTTP:
    """The REST endpoint: an aiohttp application over the data plane, started and stopped by the server."""

    def __init__(self, plane: kserve.DataPlane, observer: Observer, max_body_bytes: int, ui: bool = True):
        """`ui`: serve the page (serving/ui/index.html) at /."""
        self._plane = plane
        self._observer = observer
        self._bodies = BodyReader(max_body_bytes)
        self._page_bytes = PAGE.read_bytes() if ui else b""  # read once: the file ships with the package
        self._icon_bytes = ICON.read_bytes() if ui else b""
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._middleware])
        self._rpc_of = {}  # route handler -> the RPC it answers, for the metrics' method label
        model = "/v2/models/{model}"
        routes = [
            ("GET", "/v2/health/live", "ServerLive", self._server_live),
            ("GET", "/v2/health/ready", "ServerReady", self._server_ready),
            ("GET", "/v2", "ServerMetadata", self._server_metadata),
            ("GET", "/v2/models/stats", "ModelStatistics", self._model_statistics),  # before a model named "stats"
            ("POST", "/v2/repository/index", "RepositoryIndex", self._repository_index),
            ("POST", "/v2/repository/models/{model}/load", "RepositoryModelLoad", self._repository_load),
            ("POST", "/v2/repository/models/{model}/unload", "RepositoryModelUnload", self._repository_unload),
        ]
        for kind, rpc in ((SYSTEM, "SystemSharedMemory"), (CUDA, "CudaSharedMemory")):
            base = f"/v2/{kind}sharedmemory"
            routes += [
                ("GET", base + "/status", rpc + "Status", self._shm_status),
                ("GET", base + "/region/{name}/status", rpc + "Status", self._shm_status),
                ("POST", base + "/region/{name}/register", rpc + "Register", self._shm_register),
                ("POST", base + "/unregister", rpc + "Unregister", self._shm_unregister),
                ("POST", base + "/region/{name}/unregister", rpc + "Unregister", self._shm_unregister),
            ]
        if ui:
            routes += [("GET", "/", "Page", self._page), ("GET", "/favicon.ico", "Page", self._icon)]
        for prefix in (model, model + "/versions/{version}"):
            routes += [
                ("GET", prefix, "ModelMetadata", self._model_metadata),
                ("GET", prefix + "/ready", "ModelReady", self._model_ready),
                ("GET", prefix + "/config", "ModelConfig", self._model_config),
                ("GET", prefix + "/stats", "ModelStatistics", self._model_statistics),
                ("POST", prefix + "/infer", "ModelInfer", self._model_infer),
            ]
        add = {"GET": app.router.add_get, "POST": app.router.add_post}  # a GET route takes HEAD too
        for method, path, rpc, handler in routes:
            add[method](path, handler)
            self._rpc_of[handler] = rpc
        self._app = app

    @property
    def paths(self) -> list[str]:
        """The routes' paths, `{model}` and `{version}` as they are written."""
        return [resource.canonical for resource in self._app.router.resources()]

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None, shutdown_timeout: float,
                    reuse_port: bool = False) -> None:
        """Listen on host:port (0: any free port, then in `port`); OSError when it cannot. `reuse_port`: share the
        port with the other front-end processes of one server (SO_REUSEPORT)."""
        self._runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True, auto_decompress=False,
                                     read_bufsize=READ_BUFFER_BYTES, keepalive_timeout=KEEPALIVE_S,
                                     shutdown_timeout=shutdown_timeout)
        await self._runner.setup()
        # SO_REUSEADDR (asyncio's default) lets a restarted server bind at once; SO_REUSEPORT only among one server's
        # front-end processes, so a port another server holds is an error, as for gRPC.
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port)
        try:
            await site.start()
        except OSError:
            await self.close()
            raise
        self.port = self._runner.addresses[0][1]

    async def stop_listening(self) -> None:
        """Take no more connections; requests on those open are still answered (refused, by now)."""
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()

    async def close(self) -> None:
        """Close the connections: requests still running get up to the shutdown timeout, then are cancelled."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Counts every request once, by its real outcome, and turns errors into JSON answers: the one place where
        errors are HTTP-shaped."""
        started = time.monotonic()
        rpc = self._rpc_of.get(handler, "unknown")
        record = self._record(request, rpc, started)
        current = CURRENT.set(record)
        code, headers, response = "OK", None, None
        try:  # recorded once the answer is ready, before it is sent, as gRPC's interceptor records a call
            try:
                response = await handler(request)
            except web.HTTPMethodNotAllowed as err:  # aiohttp's router
                headers = {"Allow": err.headers["Allow"]}
                raise MethodNotAllowed(f"{request.method} {request.path}: {err.reason}") from None
            except web.HTTPNotFound as err:
                raise NoSuchRoute(f"{request.method} {request.path}: {err.reason}") from None
        except ServingError as err:
            code = err.grpc_code
            response = web.json_response({"error": bounded_message(err.message)}, status=err.http_status,
                                         headers=headers)
        except asyncio.CancelledError:  # the client closed the connection
            code = "CANCELLED"
            raise
        except ConnectionError:  # the client closed the connection mid-upload: no one to answer
            code = "CANCELLED"
            return web.Response(status=499)  # aiohttp finds the connection closed and sends nothing
        except Exception:
            code = "UNKNOWN"
            log.exception("%s %s failed", request.method, request.path)
            response = web.json_response({"error": "internal server error (logged by the server)"}, status=500)
        finally:
            CURRENT.reset(current)
            self._observer.end(record, code, None if response is None else response.status)
        if not self._plane.ready:  # shutting down (or warming up): the client reconnects, maybe elsewhere
            response.force_close()
        try:
            await asyncio.wait_for(_send(request, response), WRITE_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):  # the client left, or does not read its answer (held no longer)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _page(self, request: web.Request) -> web.Response:
        """The page to draw or drop images and see each class's capsule length: one static file, which calls the
        infer endpoint above like any client. Its policy lets it reach this server only, so nothing is fetched
        from elsewhere even if the file were changed to."""
        return web.Response(body=self._page_bytes, content_type="text/html", charset="utf-8", headers={
            "Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' blob: data:; "
                                       "script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            "Cache-Control": "no-cache"})

    async def _icon(self, request: web.Request) -> web.Response:
        return web.Response(body=self._icon_bytes, content_type="image/svg+xml",
                            headers={"Cache-Control": "max-age=86400"})

    async def _server_live(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._plane.live else 400)

    async def _server_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._plane.ready else 400)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._plane.server_metadata())

    def _model(self, request: web.Request):
        return self._plane.model(_model_ref(request))

    def _record(self, request: web.Request, rpc: str, started: float) -> RequestRecord:
        if not self._observer.wants_details:
            return RequestRecord(API, rpc, started)
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        return RequestRecord(API, rpc, started, f"{peer[0]}:{peer[1]}" if peer else "",
                             request.headers.get(TRACEPARENT))

    async def _model_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._plane.model_ready(_model_ref(request)) else 400)

    async def _model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._plane.model_metadata(_model_ref(request)))

    async def _model_statistics(self, request: web.Request) -> web.Response:
        ref = kserve.ModelRef(request.match_info.get("model", ""), request.match_info.get("version", ""),
                              "model name", "model version")
        return web.json_response(await self._plane.model_statistics(ref))

    async def _repository_index(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"ready: expected true or false, got {str(ready)[:40]}")
        return web.json_response(self._plane.repository_index("", ready))

    async def _repository_load(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        await self._plane.load("", _control_ref(request), _parameters(body), _certified(request))
        return web.json_response({})

    async def _repository_unload(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        await self._plane.unload("", _control_ref(request), _parameters(body), _certified(request))
        return web.json_response({})

    async def _shm_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._plane.shared_memory.status(_shm_kind(request),
                                                                  request.match_info.get("name", "")))

    async def _shm_register(self, request: web.Request) -> web.Response:
        body, name = await self._control_body(request), request.match_info["name"]
        shared_memory = self._plane.shared_memory
        if _shm_kind(request) == SYSTEM:
            key = body.get("key")
            if not isinstance(key, str):
                raise InvalidInput(f"key: expected a POSIX shared-memory name, got {json.dumps(key)[:60]}")
            shared_memory.register_system(name, key, _bytes(body, "offset", 0), _bytes(body, "byte_size"))
        else:
            shared_memory.check_cuda_served(name)
            handle = body.get("raw_handle")
            encoded = handle.get("b64") if isinstance(handle, dict) else None
            try:
                raw = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else None
            except ValueError:
                raw = None
            if raw is None:
                raise InvalidInput('raw_handle: expected {"b64": the cudaIPC handle in base64}')
            shared_memory.register_cuda(name, raw, _bytes(body, "device_id"), _bytes(body, "byte_size"))
        return web.json_response({})

    async def _shm_unregister(self, request: web.Request) -> web.Response:
        self._plane.shared_memory.unregister(_shm_kind(request), request.match_info.get("name", ""))
        return web.json_response({})

    async def _control_body(self, request: web.Request) -> dict:
        """A repository request's JSON object (an empty body: {})."""
        text = await self._bodies.read(request)
        if not text.strip():
            return {}
        body = parse_json(text)
        if not isinstance(body, dict):
            raise InvalidInput("request body: expected a JSON object")
        return body

    async def _model_config(self, request: web.Request) -> web.Response:
        return web.json_response(kserve.model_config(self._model(request)))

    async def _model_infer(self, request: web.Request) -> web.Response:
        self._model(request)  # an unknown model is refused before its body is read
        body = await self._bodies.read(request)
        tracked = Tracked(time.monotonic())  # in flight (and waited for by a drain) from its body's arrival
        in_flight = self._plane.lifecycle.in_flight
        in_flight.add(tracked)
        try:
            decoder = RestDecoder(body, request.headers.get(BINARY_HEADER))
            answer = await self._plane.infer(kserve.InferRequest(_model_ref(request), decoder, tracked.started))
            body, content_type, headers = await decoder.encode(answer)
            return web.Response(body=body, content_type=content_type, headers=headers)
        finally:
            in_flight.remove(tracked)


def _model_ref(request: web.Request) -> kserve.ModelRef:
    return kserve.ModelRef(request.match_info["model"], request.match_info.get("version", ""), "model name",
                           "model version")


def _control_ref(request: web.Request) -> kserve.ModelRef:
    return kserve.ModelRef(request.match_info["model"], name_field="model name")


def _parameters(body: dict) -> dict:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters: expected a JSON object")
    return parameters


def _shm_kind(request: web.Request) -> str:
    return SYSTEM if request.path.startswith("/v2/systemsharedmemory") else CUDA


def _bytes(body: dict, key: str, default: int | None = None) -> int:
    """A register body's count (bytes, an offset, a device), present unless it has a default."""
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{key}: expected a number >= 0, got {json.dumps(value)[:60]}")
    return value


def _certified(request: web.Request) -> bool:
    """Whether the request came over TLS with a client certificate the server verified."""
    return bool(request.transport is not None and request.transport.get_extra_info("peercert"))


async def _send(request: web.Request, response: web.StreamResponse) -> None:
    """Write the answer now (aiohttp would after the handler, without a time limit)."""
    await response.prepare(request)
    await response.write_eof()


