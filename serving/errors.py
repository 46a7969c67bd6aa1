"""Errors of one request, free of any transport (as KServe's InvalidInput, ModelNotFound, ServerNotReady).

The core (service, batcher, image decoding) and the protocol adapters raise them. Each kind carries what it is
answered with on either transport: `grpc_code` (a gRPC status code's name) and `http_status`. Both are class
attributes, so a new kind states its own or takes its parent's: a subclass of QueueFull is answered UNAVAILABLE/503
with no table to extend. The gRPC interceptor and the REST middleware read them, and count the request under its
`grpc_code` on either transport. The server carries on after each.
"""

from __future__ import annotations

# gRPC's status codes by name (grpc.StatusCode's members): what grpc_code may be, checked when a kind is defined, so
# that answering an error can never fail for an unknown code.
GRPC_CODES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
})


class ServingError(Exception):
    """A request answered with an error; `message` says what was wrong and what was expected. A kind without codes of
    its own is a server fault."""

    grpc_code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.grpc_code not in GRPC_CODES or cls.grpc_code == "OK":
            raise TypeError(f"{cls.__name__}.grpc_code must name a gRPC error status, got {cls.grpc_code!r}")
        if not (isinstance(cls.http_status, int) and 400 <= cls.http_status <= 599):
            raise TypeError(f"{cls.__name__}.http_status must be an HTTP error status, got {cls.http_status!r}")


class InvalidInput(ServingError):
    """The request is malformed or does not fit the model."""

    grpc_code, http_status = "INVALID_ARGUMENT", 400


class UnsupportedEncoding(InvalidInput):
    """An HTTP request body in a Content-Encoding the server does not inflate."""

    http_status = 415


class ModelNotFound(ServingError):
    """The request names a model or version this server does not serve."""

    grpc_code, http_status = "NOT_FOUND", 404


class NoSuchRoute(ServingError):
    """An HTTP path that names no endpoint (gRPC answers an unknown method UNIMPLEMENTED itself)."""

    grpc_code, http_status = "UNIMPLEMENTED", 404


class MethodNotAllowed(NoSuchRoute):
    """An HTTP method the path does not take."""

    http_status = 405


class ServerNotReady(ServingError):
    """Warming up or shutting down: retry, possibly on another replica."""

    grpc_code, http_status = "UNAVAILABLE", 503


class ModelNotReady(ServerNotReady):
    """The model is known but has no version ready for requests (unloaded, or never loaded): retry later, or
    elsewhere."""


class RegionNotFound(ServingError):
    """A tensor or a shared-memory call names a region that is not registered (or is of the other kind)."""

    grpc_code, http_status = "NOT_FOUND", 404


class RegionExists(ServingError):
    """A shared-memory region is registered under that name already: unregister it first."""

    grpc_code, http_status = "ALREADY_EXISTS", 409


class RegionUnopenable(ServingError):
    """The shared-memory object a register call names cannot be opened (no such object, no permission): Triton
    answers it INTERNAL, as the server's own failure to map it."""


class SharedMemoryDisabled(ServingError):
    """Client shared memory is switched off on this server (--no-allow-client-shm)."""

    grpc_code, http_status = "PERMISSION_DENIED", 403


class ModelLoadFailed(ServingError):
    """A load of the model repository refused a version (unreadable or altered files, a failed self-check): the
    versions already serving go on."""

    grpc_code, http_status = "FAILED_PRECONDITION", 400


class ControlDenied(ServingError):
    """Loading and unloading models is switched off on this server (--model-control), or left to its polling."""

    grpc_code, http_status = "PERMISSION_DENIED", 403


class Unauthenticated(ServingError):
    """Model control over mutual TLS without a verified client certificate."""

    grpc_code, http_status = "UNAUTHENTICATED", 401


class QueueFull(ServingError):
    """The batch queue (or the budget of request bodies being read) is full: retry later or on another replica."""

    grpc_code, http_status = "UNAVAILABLE", 503


class TooLarge(ServingError):
    """A request or its answer is over the server's message limit."""

    grpc_code, http_status = "RESOURCE_EXHAUSTED", 413


class RequestTimeout(ServingError):
    """An HTTP request's body did not arrive in time; counted as a call its client abandoned."""

    grpc_code, http_status = "CANCELLED", 408


class DeadlineExceeded(ServingError):
    """The caller's deadline passed before the model ran its request."""

    grpc_code, http_status = "DEADLINE_EXCEEDED", 504


class InferenceError(ServingError):
    """The backend failed on the request's batch (a server fault, logged)."""


class BackendUnusable(InferenceError):
    """The backend can run no more batches (a lost GPU, device memory it cannot get back): a backend raises it from
    run(); the batch's requests fail with it, and the server stops serving (health NOT_SERVING) until restarted."""


# A status message travels in a header, percent-encoded beyond printable ASCII (up to 3 bytes per UTF-8 byte), and
# gRPC refuses headers over 8-16 KiB: the client would get RESOURCE_EXHAUSTED instead of our status. Messages that
# quote a client's values (a name, a shape) are cut to this many UTF-8 bytes, on either transport.
MAX_DETAILS_BYTES = 1500


def bounded_message(message: str) -> str:
    """`message`, or its start and end around a note of what was cut, within MAX_DETAILS_BYTES."""
    data = message.encode()
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    keep = MAX_DETAILS_BYTES - 100  # room for the note
    head = data[:keep * 2 // 3].decode(errors="ignore")  # a character split at a cut is dropped
    tail = data[-(keep // 3):].decode(errors="ignore")
    return f"{head} [... {len(data) - len(head.encode()) - len(tail.encode())} bytes cut ...] {tail}"


# A client's deadline passes before the server's copy of it (which starts when the request arrives, its transit
# later), so the cancellation its client sends at the deadline reaches the server early, by as much as the request
# took to arrive (docs/experiments: what the server's settings rest on). A caller that gives up this close to
# its deadline gave up because of it.
DEADLINE_SLACK_S = 0.1


def past_deadline(remaining: float | None) -> bool:
    """Whether a caller with `remaining` seconds left (None: no deadline) that gives up did so for its deadline."""
    return remaining is not None and remaining <= DEADLINE_SLACK_S
