"""The server's one phase, which every part reads, and the requests in flight, which a drain waits for.

    STARTING ---> SERVING ---> DRAINING ---> STOPPED
       |             |            ^  ^
       |             +-> FAILED --+  |
       +-----------------------------+

- STARTING: loading and warming up; health NOT_SERVING, requests refused ("warming up").
- SERVING: ready; health SERVING.
- DRAINING: shutting down; health NOT_SERVING at once, yet requests that arrive before `refusing_from` (the end of
  the drain window, set by refuse_new()) are still served, so that load balancers stop sending first; later ones are
  refused, while those that arrived before are answered.
- FAILED: the backend can run no more batches (errors.BackendUnusable); health NOT_SERVING (readiness and the
  liveness probe both fail, so the orchestrator restarts the server), requests refused.
- STOPPED: listeners closed.

Transports count each request in `in_flight` from its arrival to its answer, whatever carries it; the in-flight
gauge reads it and a drain waits on it (an event, set when the last request of interest ends).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable

from capsnet.serving.errors import ServerNotReady

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down; retry on another replica"
WARMING_UP = "the model is not ready (warming up); retry shortly"


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


# phase -> the phases it may move to
MOVES = {
    Phase.STARTING: {Phase.SERVING, Phase.DRAINING},
    Phase.SERVING: {Phase.DRAINING, Phase.FAILED},
    Phase.FAILED: {Phase.DRAINING},
    Phase.DRAINING: {Phase.STOPPED},
    Phase.STOPPED: set(),
}


class Tracked:
    """One request being handled (or a stream of them), from `started` (time.monotonic())."""

    __slots__ = ("started",)

    def __init__(self, started: float):
        self.started = started

    def requests_in_flight(self) -> int:
        """What it adds to the in-flight gauge."""
        return 1


class InFlight:
    """The requests being handled, of every transport (health checks and reflection streams aside: no load)."""

    def __init__(self) -> None:
        self._items: set[Tracked] = set()
        self._began = asyncio.Event()  # a request began since quiet() last looked
        self._drain_before: float | None = None  # drained() is waiting for the requests that began before this
        self._drained = asyncio.Event()

    def add(self, item: Tracked) -> None:
        self._items.add(item)
        self._began.set()

    def remove(self, item: Tracked) -> None:
        self._items.discard(item)
        if self._drain_before is not None and not self._busy_before(self._drain_before):
            self._drained.set()

    def __len__(self) -> int:
        """Calls and streams being handled (on the event loop; a stream counts once)."""
        return len(self._items)

    def requests(self) -> int:
        """For the in-flight gauge, read at each scrape on another thread: so from a copy of the set."""
        return sum(item.requests_in_flight() for item in self._items.copy())

    def _busy_before(self, moment: float) -> bool:
        return any(item.started < moment for item in self._items)

    async def drained(self, before: float) -> None:
        """Until no request that began before `before` (time.monotonic()) is being handled."""
        self._drain_before = before
        self._drained.clear()
        try:
            if self._busy_before(before):
                await self._drained.wait()
        finally:
            self._drain_before = None

    async def quiet(self, period: float) -> None:
        """Until no request has begun for `period` seconds."""
        while True:
            self._began.clear()
            try:
                await asyncio.wait_for(self._began.wait(), period)
            except asyncio.TimeoutError:  # an alias of TimeoutError only from Python 3.11
                return


class Lifecycle:
    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.refusing_from = math.inf  # time.monotonic() from which arriving requests are refused
        self.refusing = asyncio.Event()  # set with refusing_from: open streams end once idle
        self.failure = ""  # why the server FAILED
        self.in_flight = InFlight()
        self._listeners: list[Callable[[Phase], Awaitable[None]]] = []

    @property
    def ready(self) -> bool:
        """What readiness checks report."""
        return self.phase is Phase.SERVING

    @property
    def live(self) -> bool:
        """What liveness checks report: false once a restart is the only way back to serving."""
        return self.phase is not Phase.FAILED

    def on_change(self, listener: Callable[[Phase], Awaitable[None]]) -> None:
        """Await `listener(phase)` on every move (the server sets gRPC health from it)."""
        self._listeners.append(listener)

    async def move(self, phase: Phase) -> None:
        if phase not in MOVES[self.phase]:
            raise RuntimeError(f"the server cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase
        if phase in (Phase.FAILED, Phase.STOPPED):  # DRAINING refuses once its window has passed (refuse_new())
            self.refuse_new()
        for listener in self._listeners:
            await listener(phase)

    async def fail(self, reason: str) -> None:
        """The backend can run no more batches: stop serving (once; a shutdown under way goes on as it is)."""
        if Phase.FAILED in MOVES[self.phase]:
            log.error("the server stops serving: %s", reason)
            self.failure = reason
            await self.move(Phase.FAILED)

    def refuse_new(self) -> float:
        """Requests that arrive from now on (the time.monotonic() returned) are refused."""
        if not self.refusing.is_set():
            self.refusing_from = time.monotonic()
            self.refusing.set()
        return self.refusing_from

    def check_arrival(self, arrival: float) -> None:
        """ServerNotReady for a request that arrived (time.monotonic()) when it cannot be served."""
        if self.phase is Phase.STARTING:
            raise ServerNotReady(WARMING_UP)
        if self.phase is Phase.FAILED:
            raise ServerNotReady(f"the server cannot serve: {self.failure}; retry on another replica")
        if arrival >= self.refusing_from:
            raise ServerNotReady(SHUTTING_DOWN)
