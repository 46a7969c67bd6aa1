"""KServe v2 / Open Inference Protocol over HTTP/REST, with Triton's binary tensor data extension.

The REST face of what `serving/kserve_grpc.py` serves over gRPC, on its own port (Triton's 8000), so that
`tritonclient.http`, KServe's REST clients, curl and HTTP health probes work unchanged. What a request must hold and
what is answered come from `serving/kserve.py`, shared with gRPC; the request goes the one path every API takes
(`InferenceService.infer`: validate, batcher, backend).

Routes (`{model}` is the served model's name; every model route also takes `/versions/{version}` after it):

    GET  /v2/health/live, /v2/health/ready        200, or 400 when not ready (the protocol's "4xx"), empty body
    GET  /v2                                      server metadata
    GET  /v2/models/{model}[/ready|/config]       model metadata, readiness, Triton's model config
    POST /v2/models/{model}/infer                 inference

An inference request is a JSON object; with the `Inference-Header-Content-Length` header it is that many bytes of
JSON followed by the input's raw little-endian bytes (`parameters.binary_data_size` on the input). Outputs asked with
`parameters.binary_data: true` (or all, with the request's `binary_data_output: true`) are answered the same way,
the others as JSON `data`. Errors are `{"error": message}` with the HTTP status their kind carries (`serving/errors.py`),
counted in the same metrics as gRPC's calls, under api="kserve_http" and the kind's gRPC code.

Bounds against hostile clients (docs/serving.md): a body over --max-message-bytes is refused from its
Content-Length, and the bodies being read at once share a budget; a body must arrive within BODY_TIMEOUT_S and an
answer be taken within WRITE_TIMEOUT_S; JSON with more values than a full batch is refused before it is parsed;
gzip and deflate bodies are inflated here, bounded, off the event loop (aiohttp's own inflating runs on the loop,
and goes on inflating a refused body's rest).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
import zlib
from collections.abc import Mapping

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from capsnet.serving import kserve
from capsnet.serving.lifecycle import Tracked
from capsnet.serving.errors import (
    InvalidInput, MethodNotAllowed, NoSuchRoute, QueueFull, RequestTimeout, ServingError, TooLarge, UnsupportedEncoding,
    bounded_message,
)
from capsnet.serving.metrics import Metrics
from capsnet.serving.service import InferenceService

log = logging.getLogger(__name__)

API = "kserve_http"
BINARY_HEADER = "Inference-Header-Content-Length"
# JSON bodies larger than this are parsed, and JSON answers this large written, in a worker thread, as gRPC's typed
# contents are converted: about 10 ms a megabyte that every other call on the event loop would wait for.
INLINE_JSON_BYTES = 64 * 1024
# An idle keep-alive connection is closed after this long (aiohttp's default is an hour).
KEEPALIVE_S = 75.0
# A request body must have arrived this long after its headers (a full batch is about 1.7 MB): a client that sends
# it slowly, or never, gets 408 instead of holding its request, and the shutdown waiting for it, without end.
BODY_TIMEOUT_S = 30.0
# An answer must have been taken by the client this long after it is ready, or the connection is closed: a client that
# sends requests (pipelined) and never reads would otherwise hold their answers in memory without end.
WRITE_TIMEOUT_S = 30.0
# Request bodies being read at once hold at most this much memory together (declared sizes; a chunked body counts as
# the limit); a request past it gets 503 at once. 1,000 connections each sending 1.6 MB of a body and stalling took the
# server to 2 GB before.
BODY_BUDGET_BYTES = 128 * 2 ** 20
# What aiohttp buffers of a connection's body before it stops reading its socket (twice this), whether the body is read
# or not: 1,000 connections stalled mid-body held 512 KiB each with aiohttp's default (256 KiB).
READ_BUFFER_BYTES = 64 * 1024
# Commas a request's JSON may hold beyond one per value of a full batch (its other fields). json.loads and numpy hold
# the GIL while they read a body: 1.7 MB of `[[],[],...]` held it 300 ms, so that gRPC health checks timed out.
JSON_FIELD_COMMAS = 1024
# Content-Encoding of request bodies, and zlib's wbits for each: gzip's header, and zlib's (HTTP's "deflate").
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


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
    """The REST endpoint: an aiohttp application over the shared InferenceService, started and stopped by the server."""

    def __init__(self, service: InferenceService, metrics: Metrics, max_body_bytes: int):
        self._service = service
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self._body_budget = max(BODY_BUDGET_BYTES, max_body_bytes)
        self._reading_bytes = 0  # declared sizes of the bodies being read
        # values a request's JSON may hold: a full batch of images
        self._max_values = service.spec.max_batch_size * math.prod(service.spec.input_shape)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._middleware])
        self._rpc_of = {}  # route handler -> the RPC it answers, for the metrics' method label
        for path, rpc, handler in [
            ("/v2/health/live", "ServerLive", self._server_live),
            ("/v2/health/ready", "ServerReady", self._server_ready),
            ("/v2", "ServerMetadata", self._server_metadata),
        ]:
            app.router.add_get(path, handler)
            self._rpc_of[handler] = rpc
        for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            for suffix, rpc, handler in [
                ("", "ModelMetadata", self._model_metadata),
                ("/ready", "ModelReady", self._model_ready),
                ("/config", "ModelConfig", self._model_config),
            ]:
                app.router.add_get(model + suffix, handler)
                self._rpc_of[handler] = rpc
            app.router.add_post(model + "/infer", self._model_infer)
        self._rpc_of[self._model_infer] = "ModelInfer"
        self._app = app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None, shutdown_timeout: float) -> None:
        """Listen on host:port (0: any free port, then in `port`); OSError when it cannot."""
        self._runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True, auto_decompress=False,
                                     read_bufsize=READ_BUFFER_BYTES, keepalive_timeout=KEEPALIVE_S,
                                     shutdown_timeout=shutdown_timeout)
        await self._runner.setup()
        # SO_REUSEADDR (asyncio's default) lets a restarted server bind at once; no SO_REUSEPORT, so a port another
        # server holds is an error, as for gRPC.
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, reuse_port=False)
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
        code, headers = "OK", None
        try:  # counted once the answer is ready, before it is sent, as gRPC's interceptor counts a call
            try:
                response = await handler(request)
            except web.HTTPMethodNotAllowed as err:  # aiohttp's router
                headers = {"Allow": err.headers["Allow"]}
                raise MethodNotAllowed(f"{request.method} {request.path}: {err.reason}") from None
            except web.HTTPNotFound as err:
                raise NoSuchRoute(f"{request.method} {request.path}: {err.reason}") from None
        except ServingError as err:
            code = err.grpc_code
            response = _error(err.http_status, err.message, headers=headers)
        except asyncio.CancelledError:  # the client closed the connection
            code = "CANCELLED"
            raise
        except ConnectionError:  # the client closed the connection mid-upload: no one to answer
            code = "CANCELLED"
            return web.Response(status=499)  # aiohttp finds the connection closed and sends nothing
        except Exception:
            code = "UNKNOWN"
            log.exception("%s %s failed", request.method, request.path)
            response = _error(500, "internal server error (logged by the server)")
        finally:
            self._metrics.requests.labels(API, rpc, code).inc()
            self._metrics.request_duration.labels(API, rpc).observe(time.monotonic() - started)
        if not self._service.ready:  # shutting down (or warming up): the client reconnects, maybe elsewhere
            response.force_close()
        try:
            await asyncio.wait_for(_send(request, response), WRITE_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):  # the client left, or does not read its answer (held no longer)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _server_live(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._service.lifecycle.live else 400)

    async def _server_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._service.ready else 400)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(kserve.server_metadata())

    def _check_model(self, request: web.Request) -> None:
        kserve.check_model(self._service.spec, request.match_info["model"], request.match_info.get("version", ""),
                           "model name", "model version")

    async def _model_ready(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return web.Response(status=200 if self._service.ready else 400)

    async def _model_metadata(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return web.json_response(kserve.model_metadata(self._service.spec))

    async def _model_config(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return web.json_response(kserve.model_config(self._service))

    async def _model_infer(self, request: web.Request) -> web.Response:
        self._check_model(request)
        body = await self._read_body(request)
        tracked = Tracked(time.monotonic())  # in flight (and waited for by a drain) from its body's arrival
        in_flight = self._service.lifecycle.in_flight
        in_flight.add(tracked)
        try:
            return await self._infer(request, body, tracked.started)
        finally:
            in_flight.remove(tracked)

    async def _read_body(self, request: web.Request) -> bytes:
        """The request's body, inflated; refused (413) from its declared size before a byte is read when that is over
        the limit, and at once (503) when the bodies being read would take more than their budget."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", *ENCODINGS):
            raise UnsupportedEncoding(f"Content-Encoding {encoding[:40]!r} is not taken; send the body as is, or as "
                                      f"{' or '.join(ENCODINGS)}")
        if (request.content_length or 0) > self._max_body_bytes:
            raise self._too_large()
        reserved = self._max_body_bytes if request.content_length is None else request.content_length
        if self._reading_bytes + reserved > self._body_budget:
            raise QueueFull(f"too many request bodies are arriving at once ({self._reading_bytes} bytes of at most "
                            f"{self._body_budget}); retry shortly, or on another replica")
        self._reading_bytes += reserved
        try:  # all of it, or HTTPRequestEntityTooLarge past client_max_size (a chunked body)
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:  # not TimeoutError: Python 3.10's is another class
            raise RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s of its headers") from None
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except web.RequestPayloadError as err:  # a malformed chunked body
            raise InvalidInput(f"request body: {err}") from None
        finally:
            self._reading_bytes -= reserved
        if encoding == "identity":
            return body
        inflated = await asyncio.to_thread(_inflate, body, encoding, self._max_body_bytes)
        if inflated is None:
            raise self._too_large()
        return inflated

    def _too_large(self) -> TooLarge:
        return TooLarge(f"the request body exceeds the server's limit of {self._max_body_bytes} bytes "
                        "(--max-message-bytes); send fewer images per request, or their data in binary")

    async def _infer(self, request: web.Request, body: bytes, arrival: float) -> web.Response:
        service, spec = self._service, self._service.spec
        service.check_arrival(arrival)
        header, binary = _split_body(body, request.headers.get(BINARY_HEADER))
        if (commas := header.count(b",")) > self._max_values + JSON_FIELD_COMMAS:
            raise InvalidInput(f"request body: the JSON holds {commas} commas, more than a full batch of "
                               f"{spec.max_batch_size} images has values ({self._max_values}); send fewer images "
                               "per request, or their data in binary")
        document = await _in_a_thread_if_large(len(header), _parse_json, header)
        inputs, outputs, parameters = _request_fields(document)
        tensor, given = _input_tensor(spec, inputs)
        service.check_batch_size(tensor.shape[0], "inputs[0].shape[0]")
        names = kserve.requested_outputs(spec, [(_name(output, f"outputs[{index}]"), output.get("parameters", {}))
                                                for index, output in enumerate(outputs)])
        binary_outputs = _binary_outputs(names, outputs, parameters)
        if isinstance(given, int):  # binary_data_size
            values = kserve.raw_values(_binary_input(binary, given), tensor, "inputs[0] binary data")
        else:
            if binary:
                raise InvalidInput(f"request body: {len(binary)} bytes of binary data follow the JSON, but no input "
                                   "has parameters.binary_data_size")
            values = await _in_a_thread_if_large(tensor.count * 8, _json_values, given, tensor)
        images = kserve.images_from_values(values, tensor)
        result = await service.infer(images, field="inputs[0]", reconstruction="reconstruction" in names,
                                     arrival=arrival)
        arrays = {"probabilities": result.probabilities, "poses": result.poses,
                  "reconstruction": result.reconstruction}
        answer = {"model_name": spec.name, "model_version": spec.version}
        if "id" in document:
            answer["id"] = document["id"]
        size = sum(arrays[name].size for name in names if name not in binary_outputs) * 20  # JSON: ~20 bytes a value
        return await _in_a_thread_if_large(size, _response, answer, {name: arrays[name] for name in names},
                                           binary_outputs)


async def _send(request: web.Request, response: web.StreamResponse) -> None:
    """Write the answer now (aiohttp would after the handler, without a time limit)."""
    await response.prepare(request)
    await response.write_eof()


def _inflate(body: bytes, encoding: str, limit: int) -> bytes | None:
    """A gzip or deflate body inflated; None when it inflates to more than `limit` bytes (read no further)."""
    inflater = zlib.decompressobj(ENCODINGS[encoding])
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise InvalidInput(f"request body: not valid {encoding} data ({err})") from None
    if len(inflated) > limit:
        return None
    if not inflater.eof or inflater.unused_data:
        raise InvalidInput(f"request body: not one complete {encoding} stream")
    return inflated


async def _in_a_thread_if_large(size: int, function, *args):
    """`function(*args)`, in a worker thread when its JSON is `size` bytes or more."""
    if size > INLINE_JSON_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def _error(status: int, message: str, headers=None) -> web.Response:
    return web.json_response({"error": bounded_message(message)}, status=status, headers=headers)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON part of the body and the binary data after it."""
    if header_length is None:
        return body, b""
    length = int(header_length) if header_length.isascii() and header_length.isdigit() else -1  # no sign, space or _
    if not 0 <= length <= len(body):
        raise InvalidInput(f"{BINARY_HEADER}: expected the length of the JSON part, 0 to {len(body)} bytes (the body's "
                           f"size), got {header_length[:40]!r}")
    return body[:length], body[length:]


def _parse_json(text: bytes):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the interpreter's stack
        raise InvalidInput(f"request body: not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None


def _request_fields(document) -> tuple[list, list, Mapping]:
    if not isinstance(document, dict):
        raise InvalidInput(f"request body: expected a JSON object, got {_json_type(document)}")
    if "id" in document and not isinstance(document["id"], str):
        raise InvalidInput(f"id: expected a string, got {_json_type(document['id'])}")
    inputs = _typed(document.get("inputs"), list, "inputs", "a list of input tensors")
    outputs = _typed(document.get("outputs", []), list, "outputs", "a list of requested outputs")
    for index, output in enumerate(outputs):
        _typed(output, dict, f"outputs[{index}]", "an object")
        _typed(output.get("parameters", {}), dict, f"outputs[{index}].parameters", "an object")
    parameters = _typed(document.get("parameters", {}), dict, "parameters", "an object")
    return inputs, outputs, parameters


def _input_tensor(spec, inputs: list) -> tuple[kserve.InputTensor, object]:
    """The input's header, checked, and where its data is: binary_data_size (an int) or its JSON `data`."""
    for index, tensor in enumerate(inputs):
        _typed(tensor, dict, f"inputs[{index}]", "an object")
    first = inputs[0] if len(inputs) == 1 else {}
    shape = _typed(first.get("shape", []), list, "inputs[0].shape", "a list of integers")
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in shape):
        raise InvalidInput(f"inputs[0].shape: expected a list of integers, got {_describe(shape)}")
    datatype = first.get("datatype")
    tensor = kserve.check_input(spec, [_name(tensor, f"inputs[{index}]") for index, tensor in enumerate(inputs)],
                                first.get("name"), datatype if isinstance(datatype, str) else _describe(datatype), shape)
    parameters = _typed(first.get("parameters", {}), dict, "inputs[0].parameters", "an object")
    kserve.refuse_parameters(parameters, "inputs[0]", output=False,
                             data_where="inputs[0].data or after the JSON (binary_data_size)")
    if "binary_data_size" in parameters:
        size = parameters["binary_data_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"inputs[0].parameters.binary_data_size: expected a number of bytes, got {size!r}")
        if "data" in first:
            raise InvalidInput("inputs[0]: data given both in `data` and as binary (binary_data_size); "
                               "expected one of them")
        return tensor, size
    if "data" not in first:
        raise InvalidInput("inputs[0]: no data; expected `data` or binary data after the JSON (binary_data_size)")
    return tensor, first["data"]


def _binary_input(binary: bytes, size: int) -> bytes:
    if len(binary) != size:
        raise InvalidInput(f"inputs[0].parameters.binary_data_size: {size} bytes, but {len(binary)} bytes of binary data "
                           f"follow the JSON ({BINARY_HEADER})")
    return binary


def _json_values(data, tensor: kserve.InputTensor) -> np.ndarray:
    """The input's values from JSON `data`: flat, or nested as its shape."""
    field, count = "inputs[0].data", tensor.count
    try:
        values = np.array(data)
    except ValueError:  # ragged, or nested deeper than numpy's 64 dimensions
        raise InvalidInput(f"{field}: expected a flat list of {count} numbers, or lists nested as the shape "
                           f"{tensor.shape}; got lists of uneven lengths or nested too deep") from None
    kinds = "iu" if tensor.datatype == "UINT8" else "iuf"
    expected = "integers 0..255" if tensor.datatype == "UINT8" else "numbers"
    if values.dtype.kind not in kinds or values.ndim == 0:
        kind = {"U": "str", "S": "str", "O": "object"}.get(values.dtype.kind, values.dtype.name)  # not str672
        raise InvalidInput(f"{field}: expected a list of {expected} for datatype {tensor.datatype}, got "
                           f"{'a single value' if values.ndim == 0 else f'values of type {kind}'}")
    if _holds_booleans(data, values.ndim):  # numpy reads [true, 0.5] as [1.0, 0.5]
        raise InvalidInput(f"{field}: expected a list of {expected} for datatype {tensor.datatype}, got true or false "
                           "among them")
    if values.ndim > 1 and list(values.shape) != tensor.shape:
        raise InvalidInput(f"{field}: nested as {list(values.shape)}, expected a flat list or nesting as the shape "
                           f"{tensor.shape}")
    if values.size != count:
        raise InvalidInput(f"{field}: expected {count} values for shape {tensor.shape}, got {values.size}")
    values = values.ravel()
    if tensor.datatype == "UINT8":
        kserve.check_uint8_range(values, field)
    return values.astype(tensor.dtype)


def _holds_booleans(data: list, depth: int) -> bool:
    """Whether JSON `data`, lists nested `depth` deep (evenly: numpy read them as an array), holds true or false."""
    for _ in range(depth - 1):
        data = [item for inner in data for item in inner]
    return any(type(item) is bool for item in data)


def _binary_outputs(names: list[str], outputs: list, parameters: Mapping) -> set[str]:
    """The outputs answered as binary data: asked per output (binary_data), else for all (binary_data_output)."""
    default = _flag(parameters, "binary_data_output", "parameters")
    asked = {output["name"]: _flag(output.get("parameters", {}), "binary_data", f"outputs[{index}].parameters", default)
             for index, output in enumerate(outputs)}
    return {name for name in names if asked.get(name, default)}


def _response(answer: dict, arrays: dict[str, np.ndarray], binary: set[str]) -> web.Response:
    chunks = []
    answer["outputs"] = []
    for name, array in arrays.items():
        output = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
        if name in binary:
            chunks.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
            output["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            output["data"] = array.ravel().tolist()
        answer["outputs"].append(output)
    header = json.dumps(answer).encode()
    if not chunks:
        return web.Response(body=header, content_type="application/json")
    return web.Response(body=b"".join([header, *chunks]), content_type="application/octet-stream",
                        headers={BINARY_HEADER: str(len(header))})


def _name(tensor: dict, field: str) -> str:
    return _typed(tensor.get("name"), str, f"{field}.name", "a string")


def _flag(parameters: Mapping, key: str, field: str, default: bool = False) -> bool:
    return _typed(parameters.get(key, default), bool, f"{field}.{key}", "true or false")


def _typed(value, kind: type, field: str, expected: str):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidInput(f"{field}: expected {expected}, got {_json_type(value)}")
    return value


def _describe(value) -> str:
    """A JSON value for a message: as it is (cut) unless it nests lists or objects, which go by their type (their JSON
    could be deeper than the interpreter's recursion limit)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if any(isinstance(item, (list, dict)) for item in items):
        return f"{_json_type(value)} of nested values"
    return json.dumps(value)[:200]


def _json_type(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")
