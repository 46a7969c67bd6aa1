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


# A client's deadline passes before the server's copy of it (which starts when the request arrives, its transit
# later), so the cancellation its client sends at the deadline reaches the server early: up to 16 ms measured on
# loopback (AMD EPYC, AVX2 only, 2 busy cores; bursts of short-deadline calls). A caller that gives up this close to
# its deadline gave up because of it.
DEADLINE_SLACK_S = 0.1


def past_deadline(remaining: float | None) -> bool:
    """Whether a caller with `remaining` seconds left (None: no deadline) that gives up did so for its deadline."""
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class InferenceError(ServingError):
    """The backend failed on the request's batch (a server fault, logged)."""
