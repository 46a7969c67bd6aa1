"""The GPU time of a runner's model work, measured on the device: a pair of CUDA events recorded on the runner's
stream before and after the work of a batch, read once the stream has synchronised. The runner's copy of the outputs
back to the host waits for the stream anyway, so timing adds no synchronisation: two event records per batch, and
reading two completed events afterwards. The events are recorded on the stream named, not on the current one: looking
the current stream up costs more host time than the two records together.
"""

from __future__ import annotations

import contextlib

import torch


class GpuTimer:
    """Times the work a with-block `around()` enqueues on `stream` (one block at a time: a runner runs one batch at a
    time)."""

    def __init__(self, stream: torch.cuda.Stream):
        self._stream = stream
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._timed = False  # both events recorded around a block that completed

    @contextlib.contextmanager
    def around(self):
        self._timed = False
        self._start.record(self._stream)
        yield
        self._end.record(self._stream)
        self._timed = True

    def seconds(self) -> float:
        """GPU seconds of the last block's work. Only once its stream has synchronised: the events are complete then,
        and reading them waits for nothing."""
        if not self._timed:
            raise RuntimeError("no GPU work has been timed yet")
        return self._start.elapsed_time(self._end) / 1e3


def timed(timer: GpuTimer | None):
    """`timer.around()`, or nothing to time (a runner on the CPU)."""
    return contextlib.nullcontext() if timer is None else timer.around()
