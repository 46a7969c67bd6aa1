"""Errors of one request, free of any transport (as KServe's InvalidInput, ModelNotFound, ServerNotReady).

The core (service, batcher, image decoding) and the protocol adapters raise them; the gRPC layer maps
each kind to its status code in one place (`serving/interceptor.py`). The server carries on after each.
"""

from __future__ import annotations


class ServingError(Exception):
    """A request answered with an error; `message` says what was wrong and what was expected."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(ServingError):
    """The request is malformed or does not fit the model."""


class ModelNotFound(ServingError):
    """The request names a model or version this server does not serve."""


class ServerNotReady(ServingError):
    """Warming up or shutting down: retry, possibly on another replica."""


class QueueFull(ServingError):
    """The batch queue is full: retry later or on another replica."""


class DeadlineExceeded(ServingError):
    """The caller's deadline passed before the model ran its request."""


class InferenceError(ServingError):
    """The backend failed on the request's batch (a server fault, logged)."""
