"""Where gRPC meets the core: every RPC passes this interceptor, and only here are errors gRPC-shaped.

- The transport-neutral errors of `serving/errors.py` become gRPC statuses, the code each kind carries.
  The status is set on the context and the handler returns; no abort exception is kept, so a refused
  request (and its message) is freed at once instead of living in an exception -> traceback -> frame cycle.
- A request message that does not parse gets INVALID_ARGUMENT, logged at WARNING without a traceback
  (gRPC itself would answer UNKNOWN with interpreter text and log an ERROR traceback).
- A response over the message limit gets RESOURCE_EXHAUSTED with a message saying so (gRPC would fail the
  send and the server would never know).
- Every RPC whose handler ran is recorded once by its real outcome (`serving/observability/observe.py`: metrics, and an
access
  line and a trace where asked): CANCELLED and DEADLINE_EXCEEDED when the client gave up, UNKNOWN (gRPC's answer)
  when the handler failed unexpectedly. Calls gRPC ended before the handler ran are not recorded: a request over the
  message limit, a client that cancelled and a deadline that passed while gRPC held the call all look the same from
  here.
- The RPCs in flight are counted in the lifecycle's InFlight, health checks and reflection aside, so a shutdown can
  wait for them and the in-flight gauge (which the Kubernetes HPA scales on) is load, not open health watches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from capsnet.serving.errors import (InvalidInput, ServerNotReady, ServingError, TooLarge, bounded_message,
                                    past_deadline)
from capsnet.serving.lifecycle import InFlight, Tracked
from capsnet.serving.observability.observe import CURRENT, TRACEPARENT, Observer, RequestRecord, grpc_peer

log = logging.getLogger(__name__)
# short `api` label values of the services the server hosts; anything else is counted as "unknown"
API_NAMES = {
    "capsnet.v1.CapsNetService": "capsnet",
    "inference.GRPCInferenceService": "kserve",
    "grpc.health.v1.Health": "health",
    "grpc.reflection.v1alpha.ServerReflection": "reflection",
}
# Health watches and reflection streams live as long as their client wants: a shutdown ends them instead of
# waiting for them, and the in-flight gauge does not count them (a load balancer holding one Watch per replica
# would read as constant load).
_NOT_IN_FLIGHT = {"health", "reflection"}


class _Unparseable:
    """What the guarded deserializer returns for bytes that are not the request message."""

    def __init__(self, size: int):
        self.size = size


class _Call(Tracked):
    """One RPC's bookkeeping, and the context manager its handler runs in: counted once when the handler ends, by how
    it ended (a ServingError answered as its status, a server fault as UNKNOWN, which gRPC answers and logs after we
    count it, a cancellation as the client's or the shutdown's)."""

    __slots__ = ("interceptor", "api", "method", "context", "task", "code", "streaming", "received", "answered",
                 "ended_by_server", "record")

    def __init__(self, interceptor: "RequestInterceptor", api: str, method: str, streaming: bool, context):
        super().__init__(0.0)
        self.interceptor, self.api, self.method, self.context = interceptor, api, method, context
        self.task: asyncio.Task | None = None  # the task running the handler, once it runs
        self.code: grpc.StatusCode | None = None  # set by our handling; None: read it from the context
        self.streaming = streaming  # requests arrive on a stream, each answered in turn (ClassifyStream)
        self.received = self.answered = 0  # a stream's requests so far, and its answers
        self.ended_by_server = False  # an open stream the shutdown ended
        self.record: RequestRecord | None = None

    def __enter__(self) -> "_Call":
        self.started = time.monotonic()
        self.task = asyncio.current_task()
        interceptor, context = self.interceptor, self.context
        if interceptor.observer.wants_details:
            traceparent = next((value for key, value in context.invocation_metadata() or () if key == TRACEPARENT),
                               None)
            self.record = RequestRecord(self.api, self.method, self.started, grpc_peer(context.peer()), traceparent)
        else:
            self.record = RequestRecord(self.api, self.method, self.started)
        CURRENT.set(self.record)  # in the call's own task: the handler's context
        if self.api in _NOT_IN_FLIGHT:
            interceptor.open_streams.add(self)
        else:
            interceptor.in_flight.add(self)
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        """True where the error is answered here (its status set) and goes no further."""
        handled = False
        if kind is None:
            pass
        elif issubclass(kind, ServingError):
            self.refuse(error)
            handled = True
        elif issubclass(kind, asyncio.CancelledError):
            handled = self._ended_by_shutdown()
            if not handled:
                self.gave_up()
        elif issubclass(kind, GeneratorExit):  # a stream cancelled while at `yield`
            self.gave_up()
        elif issubclass(kind, Exception):
            self.code = grpc.StatusCode.UNKNOWN
        self._end()
        return handled

    def _end(self) -> None:
        code = self.code or self.context.code() or grpc.StatusCode.OK
        if self.api in _NOT_IN_FLIGHT:
            self.interceptor.open_streams.discard(self)
        else:
            self.interceptor.in_flight.remove(self)
        assert self.record is not None  # __enter__ made it
        self.interceptor.observer.end(self.record, code.name)

    def refuse(self, err: ServingError) -> None:
        """Answer with the error's code and message (the handler returns right after)."""
        self.code = grpc.StatusCode[err.grpc_code]
        self.context.set_code(self.code)
        self.context.set_details(bounded_message(err.message))

    def requests_in_flight(self) -> int:
        """A unary call is one request; a stream counts its requests from arrival to answer, so that an idle stream
        is no load."""
        return max(0, self.received - self.answered) if self.streaming else 1

    def gave_up(self) -> None:
        """The client cancelled, or its deadline passed (gRPC cancels the handler either way; the client's own
        cancellation at its deadline can come a little before the server's, see DEADLINE_SLACK_S)."""
        past = past_deadline(self.context.time_remaining())
        self.code = grpc.StatusCode.DEADLINE_EXCEEDED if past else grpc.StatusCode.CANCELLED

    def _ended_by_shutdown(self) -> bool:
        """Whether end_open_streams() cancelled this call; if so the call ends UNAVAILABLE, and its task goes on."""
        if not self.ended_by_server:
            return False
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):  # Python 3.11+ counts cancellations; 3.10 needs nothing
            task.uncancel()
        self.refuse(ServerNotReady("the server is shutting down"))
        return True


class RequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, observer: Observer, max_message_bytes: int, in_flight: InFlight):
        self.observer = observer
        self.max_message_bytes = max_message_bytes
        self.in_flight = in_flight  # RPCs (but health checks and reflection) whose handler is running
        self.open_streams: set[_Call] = set()  # health checks and reflection streams whose handler is running
        # method path -> its handler, wrapped: built once per method the server has (a handler is the same object
        # for every call of its method), not once per call
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def end_open_streams(self, timeout: float) -> None:
        """Shutdown: end the health Watch and reflection streams (which last as long as their client wants) with
        UNAVAILABLE, so that gRPC's stop does not cancel them (it logs an ERROR traceback for each)."""
        tasks = {call.task for call in self.open_streams if call.task is not None}  # __enter__ set each one
        for call in self.open_streams:
            call.ended_by_server = True
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def intercept_service(self, continuation, handler_call_details):
        path = handler_call_details.method
        wrapped = self._wrapped.get(path)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED; any name, so no name in the labels
            self.observer.metrics.requests.labels("unknown", "unknown", grpc.StatusCode.UNIMPLEMENTED.name, "",
                                                  "").inc()
            return None
        service, _, method = path.lstrip("/").rpartition("/")
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        behavior = self._wrap(getattr(handler, kind), API_NAMES.get(service, "unknown"), method,
                              handler.request_streaming, handler.response_streaming)
        wrapped = self._wrapped[path] = handler._replace(request_deserializer=_guarded(handler.request_deserializer),
                                                         **{kind: behavior})
        return wrapped

    def _wrap(self, behavior, api: str, method: str, request_streaming: bool, response_streaming: bool):
        # gRPC tells handler kinds apart by their function type, so each wrapper keeps it.
        limit = self.max_message_bytes
        streaming = request_streaming and response_streaming

        def prepare(request, call: _Call):
            """The request as the handler takes it; None (and the status set) when it did not parse."""
            if request_streaming:
                return _parsed_stream(request, call)
            if isinstance(request, _Unparseable):
                log.warning("unparseable %s request (%d bytes) from %s: answered INVALID_ARGUMENT",
                            method, request.size, call.context.peer())
                call.refuse(InvalidInput(f"the request ({request.size} bytes) is not a valid {method} message"))
                return None
            return request

        def too_large(response, call: _Call) -> bool:
            size = response.ByteSize()
            if size <= limit:
                return False
            call.refuse(TooLarge(f"the response ({size} bytes) exceeds the server's limit of {limit} bytes "
                                 "(--max-message-bytes); ask for fewer images or outputs per request"))
            return True

        if inspect.isasyncgenfunction(behavior):
            async def wrapped(request, context):
                with _Call(self, api, method, streaming, context) as call:
                    if (request := prepare(request, call)) is not None:
                        async for response in behavior(request, context):
                            if too_large(response, call):
                                return
                            call.answered += 1
                            yield response
            return wrapped
        else:
            async def unary(request, context):
                with _Call(self, api, method, streaming, context) as call:
                    if (request := prepare(request, call)) is None:
                        return None
                    response = await behavior(request, context)
                    return None if response is not None and too_large(response, call) else response
                return None  # refused, or ended by the shutdown: the status is set
            return unary


def _guarded(deserializer):
    """The handler's deserializer, returning _Unparseable instead of raising on bad bytes."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError:
            return _Unparseable(len(data))

    return parse


async def _parsed_stream(requests, call: _Call):
    """A stream's requests, counted on `call`; an unparseable one ends the stream with INVALID_ARGUMENT."""
    async for request in requests:
        if isinstance(request, _Unparseable):
            log.warning("unparseable stream request #%d (%d bytes): answered INVALID_ARGUMENT", call.received,
                        request.size)
            raise InvalidInput(f"stream request #{call.received} ({request.size} bytes) is not a valid message")
        call.received += 1
        yield request
