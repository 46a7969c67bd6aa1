"""Dynamic batching: concurrent requests share backend runs, the way Triton's dynamic batcher does.

Requests wait in a bounded FIFO queue. A batch is cut when max_batch_size images are waiting or the oldest request has
waited max_queue_delay; it takes images from the head of the queue and may split a request across two batches, so
batches are full under load. One batch runs at a time: whatever queues while it runs forms the next batch. Its
rows are gathered, run and handed back by serving/engine/batch_rows.py.

Where a batch runs is decided as measured in docs/serving.md ("Batching"): a batch runs on the event loop when its runs
take under INLINE_RUN_S and the loop has nothing else ready to run meanwhile (a lone request: handing its run to the
batch thread and back would cost about as much CPU as the run, and nothing could overlap it); otherwise the batch
thread runs it, as a Triton model instance runs on its own thread, and the loop keeps handling the other calls
meanwhile, which queue and form the next batch. A lone request that finds nothing queued or running, with no queue
delay to wait, is run by its own caller at once, without entering the queue.

Every image is computed independently of its batch-mates (the model has no cross-sample state), so the split and the
grouping change nothing in the results. A model of any size gets requests of several image sizes; a batch holds one
size (the oldest waiting request's), as a batch is one tensor, and padding an image to another size changes what a
capsule model answers (blank positions vote under some presets).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Union

import numpy as np

from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.batch_rows import copy_rows, gather_and_run
from capsnet.serving.errors import (BackendUnusable, DeadlineExceeded, InferenceError, QueueFull, RequestTimeout,
                                    past_deadline)
from capsnet.serving.observability.metrics import VersionMetrics
from capsnet.serving.observability.statistics import ModelStatistics

log = logging.getLogger(__name__)

# A backend run this short is not worth the hand-off to the batch thread and back (two thread wake-ups and GIL
# hand-overs; measured in docs/serving.md, "Batching"): the event loop runs it. Long enough for a small model's batches
# of a few images on a CPU, short enough that the loop is never held long.
INLINE_RUN_S = 0.0005
# How much one slower run raises a batch size's run estimate: the estimate follows the fastest of about the last
# thousand runs, so a machine busy with other work (whose runs take 1.5-3x as long on a shared 2-core host) does
# not move a small model's runs to the thread, where each would cost the hand-off on top.
RUN_ESTIMATE_DRIFT = 1.001
# what a request past its deadline before its run hears, queued or run at once
WAITED_PAST_DEADLINE = "deadline exceeded while waiting for the model"


def _loop_busy() -> bool:
    """Whether the running event loop has other callbacks ready to run (other calls' steps). asyncio's own loops keep
    them in `_ready`, a deque every CPython release has had; a loop without it counts as busy, so that its batches
    take the batch thread, as Triton's model instances do."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    return ready is None or bool(ready)


class ImageSource(Protocol):
    """A request's images not yet in memory (in a client's shared-memory region): read by the batcher straight into
    the batch it runs, in its worker thread, so that they are copied once."""

    shape: tuple[int, ...]  # (N, C, H, W)

    def __len__(self) -> int:
        """N"""

    def read(self, out: np.ndarray, start: int, stop: int) -> None:
        """Images [start, stop) into `out`, float32 (stop - start, C, H, W); a ServingError fails their request."""

    @property
    def on_device(self) -> bool:
        """Whether they lie in device memory (a CUDA region), for read_device."""

    def read_device(self, out, start: int, stop: int) -> None:
        """As read(), into `out`, a float32 CUDA tensor: device to device where they lie on the device."""


Images = Union[np.ndarray, ImageSource]


class OutputSink(Protocol):
    """Where a request's output goes instead of its answer (a client's shared-memory region): written by the batcher,
    in its worker thread, straight from the batch's outputs, device to device where the backend answered on its
    device."""

    def write(self, rows, start: int) -> None:
        """The request's rows [start, start + len(rows)) of the output: numpy, or a CUDA tensor; a ServingError fails
        the request."""


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int
    max_queue_delay_s: float
    max_queue_size: int  # requests waiting (a request in the middle of a split counts until fully taken)


class BatchRun(NamedTuple):
    """One backend run, as time.monotonic() marks: cut from the queue, its input gathered (the backend starts), the
    backend done, every request's rows handed over."""
    size: int  # images in the batch
    cut: float
    run_start: float
    run_end: float
    delivered: float

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, named as the statistics name them."""
        return {"compute_input": self.run_start - self.cut, "compute_infer": self.run_end - self.run_start,
                "compute_output": self.delivered - self.run_end}


class Completion(Protocol):
    """How a request hears its end: an asyncio.Future for a caller awaiting it (submit()), or an engine process's
    answer to its front end (post())."""

    def done(self) -> bool:
        """Whether it has ended (answered, failed, or given up by its caller)."""

    def set_result(self, output: BatchOutput) -> None:
        """Answered: every output is in `output.outputs` or written into its sink."""

    def set_exception(self, err: BaseException) -> None:
        """Failed, or dropped (past its deadline, cancelled)."""


@dataclass(eq=False)
class QueuedRequest:
    images: Images  # (N, C, H, W) float32
    deadline: float | None  # time.monotonic()
    future: Completion
    arrival: float = field(default_factory=time.monotonic)
    taken: int = 0  # images handed to batches so far
    done: int = 0  # images computed so far
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (N, ...), filled batch by batch
    queue_wait: float | None = None
    runs: list[BatchRun] = field(default_factory=list)  # the batches it ran in
    sinks: dict[str, OutputSink] = field(default_factory=dict)  # outputs written there, not into `outputs`


@dataclass
class BatchOutput:
    outputs: dict[str, np.ndarray]  # name -> (N, ...)
    queue_wait: float  # seconds from arrival to the start of the first backend run that included it
    runs: list[BatchRun]  # the backend runs that included it (two when it was split)
    submitted: float  # time.monotonic() it entered the queue

    @property
    def compute(self) -> float:
        """Seconds of the backend runs that included it."""
        return sum(run.run_end - run.run_start for run in self.runs)


class Batcher:
    def __init__(self, backend: Backend, config: BatcherConfig, metrics: VersionMetrics, stats: ModelStatistics,
                 on_unusable: Callable[[str], Awaitable[None]] | None = None):
        """`metrics` and `stats`: the model version's. `on_unusable(reason)` is awaited when the backend raises
        BackendUnusable, after the batch's requests fail."""
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.stats = stats
        self._on_unusable = on_unusable
        # A short batch takes the thread when the loop has other work ready, so that the work overlaps the run (a
        # server's request path). An engine process sets it False: its loop only moves messages, and what its front
        # ends send during an inline run waits in the socket and forms the next batch, without the hand-off.
        self.overlap_loop_work = True
        self._queue: collections.deque[QueuedRequest] = collections.deque()
        self._queued_images = 0  # images of the queue not yet handed to a batch
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # set while no batch is queued or running
        self._idle.set()
        self._depth_due = False  # the queue-depth gauge is to be written this loop iteration
        # One thread: batches run one after another; the backend parallelises within a batch.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsnet-backend")
        # batch size -> its backend run's seconds as the fastest recent runs say: a run slowed by other work on the
        # machine raises it only by RUN_ESTIMATE_DRIFT, so the choice of inline runs does not flip with the load
        self._run_estimate_s: dict[int, float] = {}
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name="capsnet-batcher")

    async def submit(self, images: Images, deadline: float | None = None,
                     sinks: dict[str, OutputSink] | None = None) -> BatchOutput:
        """Queue validated images (N <= max_batch_size) and wait for their outputs (those of `sinks` written there)."""
        if len(self._queue) >= self.config.max_queue_size:
            raise QueueFull(f"queue full: {len(self._queue)} requests are waiting (--max-queue-size "
                            f"{self.config.max_queue_size}); retry later or on another replica")
        future: asyncio.Future[BatchOutput] = asyncio.get_running_loop().create_future()
        request = QueuedRequest(images, deadline, future, sinks=sinks or {})
        if self._runs_at_once(len(images)):
            return await self._run_at_once(request, future)
        self._queue.append(request)
        self._queued_images += len(images)
        self._changed()
        try:
            timeout = None if deadline is None else deadline - time.monotonic()
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:  # an alias of TimeoutError only from Python 3.11
            self._drop(request, "deadline")
            raise DeadlineExceeded(WAITED_PAST_DEADLINE) from None
        except asyncio.CancelledError:  # the client cancelled, or gRPC ended the call at its deadline
            past = past_deadline(None if deadline is None else deadline - time.monotonic())
            self._drop(request, "deadline" if past else "cancelled")
            raise

    def post(self, images: Images, deadline: float | None, sinks: dict[str, OutputSink],
             completion: Completion) -> object:
        """Queue validated images without waiting: `completion` hears their end; their handle, for withdraw(). An
        engine process posts the requests its front ends send, many in one wake-up, and the scheduler batches them."""
        if len(self._queue) >= self.config.max_queue_size:
            raise QueueFull(f"queue full: {len(self._queue)} requests are waiting (--max-queue-size "
                            f"{self.config.max_queue_size}); retry later or on another replica")
        request = QueuedRequest(images, deadline, completion, sinks=sinks)
        self._queue.append(request)
        self._queued_images += len(images)
        self._changed()
        return request

    def withdraw(self, handle: object, reason: str) -> None:
        """A posted request whose caller gave up (`reason`: "cancelled" or "deadline") leaves the queue if it is
        still there, failing with its reason; once in a batch it runs to its end."""
        assert isinstance(handle, QueuedRequest)
        self._drop(handle, reason)

    async def submit_sizes(self, groups: list[Images], deadline: float | None = None,
                           sinks: dict[str, OutputSink] | None = None) -> list[BatchOutput]:
        """One request's images of several sizes, each queued as submit() queues it, waited for side by side."""
        return list(await asyncio.gather(*(self.submit(images, deadline, sinks) for images in groups)))

    async def drain(self) -> None:
        """Wait until every queued request has been computed, then stop."""
        while self._queue or not self._idle.is_set():
            await self._idle.wait()
        self._task.cancel()
        self._executor.shutdown(wait=True)

    def _changed(self) -> None:
        self._depth_changed()
        if self._queue:
            self._idle.clear()
        self._wakeup.set()

    def _depth_changed(self) -> None:
        if not self._depth_due:  # the gauge is written once per loop iteration, not once per request of a burst
            self._depth_due = True
            asyncio.get_running_loop().call_soon(self._publish_depth)

    def _publish_depth(self) -> None:
        self._depth_due = False
        self.metrics.queue_depth.set(len(self._queue))

    def _remove(self, request: QueuedRequest) -> bool:
        """Take a request out of the queue (freeing its slot); False if it was not there."""
        if request not in self._queue:
            return False
        self._queue.remove(request)
        self._queued_images -= len(request.images) - request.taken
        self._changed()
        return True

    def _drop(self, request: QueuedRequest, reason: str) -> None:
        """A request that will not be answered (its caller gave up, or its deadline passed) leaves the queue
        uncomputed."""
        if self._remove(request):
            self.metrics.dropped[reason].inc()
            if not request.future.done():
                request.future.set_exception(DeadlineExceeded(WAITED_PAST_DEADLINE) if reason == "deadline"
                                             else RequestTimeout("cancelled by its caller"))

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._wait_for_batch()
            parts = self._take_batch()
            if parts:
                await self._run(loop, parts)

    async def _wait_for_batch(self) -> None:
        """Until max_batch_size images wait or the oldest request has waited max_queue_delay."""
        while self._queue and self._queued_images < self.config.max_batch_size:
            remaining = self._queue[0].arrival + self.config.max_queue_delay_s - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:  # an alias of TimeoutError only from Python 3.11
                return

    def _take_batch(self) -> list[tuple[QueuedRequest, int, int]]:
        """Up to max_batch_size images of the oldest request's size, from the head of the queue on: (request, start,
        stop) slices. A model of any size is run on one size per batch; requests of other sizes keep their place."""
        parts: list[tuple[QueuedRequest, int, int]] = []
        count, now, size = 0, time.monotonic(), None
        expired: list[QueuedRequest] = []  # these two leave the queue after the walk, which must not change it
        taken: list[QueuedRequest] = []
        for request in self._queue:
            if count >= self.config.max_batch_size:
                break
            if request.taken == 0 and request.deadline is not None and request.deadline <= now:
                expired.append(request)  # its caller is about to hear DEADLINE_EXCEEDED: no compute spent on it
                continue
            size = size or request.images.shape[1:]
            if request.images.shape[1:] != size:
                continue
            take = min(len(request.images) - request.taken, self.config.max_batch_size - count)
            parts.append((request, request.taken, request.taken + take))
            request.taken += take
            count += take
            self._queued_images -= take
            if request.taken == len(request.images):
                taken.append(request)
        for request in expired:
            self._drop(request, "deadline")
        for request in taken:  # from the head of the queue unless another size waits before it
            self._queue.remove(request)
        self._depth_changed()
        return parts

    def _runs_inline(self, size: int) -> bool:
        """Whether a batch of `size` images runs on the event loop: its runs are known to take under INLINE_RUN_S,
        and the loop has nothing else ready to run meanwhile. Otherwise the batch thread runs it, and the loop's other
        work (other calls being decoded, answers being encoded) overlaps the run: those calls queue, and form the next
        batch."""
        estimate = self._run_estimate_s.get(size)
        return (estimate is not None and estimate < INLINE_RUN_S
                and not (self.overlap_loop_work and _loop_busy()))

    def _runs_at_once(self, size: int) -> bool:
        """Whether a request of `size` images is its own batch, run now by its caller: nothing is queued or running,
        there is no delay to wait for others, and its run is one the loop takes inline. It skips the queue, the
        scheduler's wake-up and its own wake-up by the future: a lone small request's cost on the loop."""
        return (not self._queue and self._idle.is_set() and self.config.max_queue_delay_s <= 0
                and self._runs_inline(size))

    async def _run_at_once(self, request: QueuedRequest, future: asyncio.Future[BatchOutput]) -> BatchOutput:
        if request.deadline is not None and request.deadline <= time.monotonic():
            self.metrics.dropped["deadline"].inc()
            raise DeadlineExceeded(WAITED_PAST_DEADLINE)
        request.taken = len(request.images)
        await self._run(asyncio.get_running_loop(), [(request, 0, request.taken)])
        return future.result()  # its outputs, or why its batch failed

    async def _run(self, loop: asyncio.AbstractEventLoop, parts: list[tuple[QueuedRequest, int, int]]) -> None:
        cut = time.monotonic()
        for request, start, _ in parts:
            if start == 0:
                request.queue_wait = cut - request.arrival
        size = sum(stop - start for _, start, stop in parts)
        try:
            if self._runs_inline(size):
                outputs, failed, started, ended = gather_and_run(self.backend, parts)
            else:
                outputs, failed, started, ended = await loop.run_in_executor(self._executor, gather_and_run,
                                                                             self.backend, parts)
            ran, estimate = ended - started, self._run_estimate_s.get(size)
            self._run_estimate_s[size] = ran if estimate is None else min(ran, estimate * RUN_ESTIMATE_DRIFT)
            for request, err in failed:  # its images could not be read, or its outputs written: it alone fails
                self._remove(request)
                if not request.future.done():
                    request.future.set_exception(err)
            copied = copy_rows(parts, outputs)
        except Exception as err:  # the batch's requests fail; the scheduler, and the server, carry on
            log.exception("backend %s failed on a batch of %d", self.backend.name, size)
            message = f"the {self.backend.name} backend failed: {err}"
            kind = BackendUnusable if isinstance(err, BackendUnusable) else InferenceError
            for request, _, _ in parts:
                self._remove(request)  # the rest of a split request is not run either
                if not request.future.done():
                    request.future.set_exception(kind(message))
            if kind is BackendUnusable and self._on_unusable is not None:
                await self._on_unusable(message)
            return
        run = BatchRun(size, cut, started, ended, time.monotonic())
        for request in copied:
            request.runs.append(run)
            if request.done == len(request.images):
                assert request.queue_wait is not None  # set when its first run was cut
                request.future.set_result(BatchOutput(request.outputs, request.queue_wait, request.runs,
                                                      request.arrival))
        self.metrics.compute.observe(ended - started)
        timer, gpu_compute = self.backend.gpu_timer, self.metrics.gpu_compute
        if timer is not None and gpu_compute is not None:  # the run has synchronised: its events are complete
            gpu_compute.observe(timer.seconds())
        self.metrics.batch_size.observe(size)
        self.metrics.images.inc(size)
        self.stats.record_batch(size, run.phases())
