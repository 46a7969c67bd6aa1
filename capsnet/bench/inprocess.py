"""In-process throughput and latency of every engine, interleaved in one run.

Each engine (capsnet.bench.engines) lives in its own child process (capsnet.bench.worker, so an ONNX Runtime worker
never imports torch), which makes its peak RSS its own. Only one worker computes at a time: the parent walks
rounds × batch sizes × engines and asks each worker for a short timed chunk in turn, so drift in
the machine's load (other users, thermal) lands on every engine alike. A worker warms up at a
batch size before its first timed chunk there. Workers never run Triton's interpreter (TRITON_INTERPRET, for tests
only): an engine that needs it on the CPU is skipped, not timed at a thousandth of its speed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from capsnet.bench.engines import EngineUnavailable
from capsnet.bench.results import measurement
from capsnet.bench.timing import summarize
from capsnet.errors import CapsNetError

# Idle time before each timed chunk, so the previous worker's spinning threads go to sleep first.
SETTLE_SECONDS = 0.05


@dataclass(frozen=True)
class Schedule:
    seconds: float  # timed seconds per (engine, batch size), split over the rounds
    rounds: int


@dataclass(frozen=True)
class EnginePlan:
    model_dir: str  # export directory it loads from
    batch_sizes: tuple[int, ...]


def run_inprocess(plans: dict[str, EnginePlan], threads: int, images: np.ndarray, labels: np.ndarray,
                  schedule: Schedule, accuracy_images: int, after_round: Callable[[], None] = lambda: None) -> dict:
    """Time each engine (name -> plan) on images (N, C, H, W) float32 at its batch sizes, and measure its
    accuracy on the first `accuracy_images`. `after_round` runs after each round, while the workers wait."""
    workers, skipped = {}, {}
    max_batch = max(batch for plan in plans.values() for batch in plan.batch_sizes)
    try:
        for name, plan in plans.items():
            try:
                workers[name] = EngineWorker(name, plan.model_dir, threads, max_batch)
            except EngineUnavailable as err:
                skipped[name] = str(err)
        cells = sorted({(batch, name) for name in workers for batch in plans[name].batch_sizes},
                       key=lambda cell: (cell[0], list(workers).index(cell[1])))
        chunk_seconds = schedule.seconds / schedule.rounds
        durations: dict[tuple[int, str], list[float]] = {cell: [] for cell in cells}
        for _ in range(schedule.rounds):
            for batch, name in cells:
                time.sleep(SETTLE_SECONDS)
                durations[batch, name] += workers[name].call("time", tile(images, batch), chunk_seconds)
            time.sleep(SETTLE_SECONDS)
            after_round()
        accuracy = {}
        eval_images, eval_labels = images[:accuracy_images], labels[:accuracy_images]
        for name, worker in workers.items():
            predicted = np.concatenate([
                worker.call("predict", eval_images[start:start + max_batch])
                for start in range(0, len(eval_images), max_batch)
            ])
            accuracy[name] = float((predicted == eval_labels).mean())
        memory = {name: worker.stop() for name, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.kill()
    return {
        "threads": threads,
        "schedule": {"seconds": schedule.seconds, "rounds": schedule.rounds},
        "accuracy_images": len(eval_labels),
        "skipped": skipped,
        "engines": {
            name: {"description": worker.description, "accuracy": accuracy[name], **memory[name]}
            for name, worker in workers.items()
        },
        "measurements": [measurement(name, batch, summarize(durations[batch, name], batch)) for batch, name in cells],
    }


def tile(images: np.ndarray, batch: int) -> np.ndarray:
    """The first `batch` images, repeating the set if it is smaller."""
    return images[np.arange(batch) % len(images)]  # (batch, C, H, W), a contiguous copy


class EngineWorker:
    """A child process (capsnet.bench.worker) holding one engine, answering commands over a socket pair."""

    def __init__(self, name: str, model_dir: str, threads: int, max_batch: int):
        self.name = name
        parent_sock, child_sock = socket.socketpair()
        self.conn = Connection(parent_sock.detach())
        with child_sock:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "capsnet.bench.worker", str(child_sock.fileno()), name, model_dir,
                 str(threads), str(max_batch)],
                pass_fds=[child_sock.fileno()],
                env={name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"},
                # Its own session: a Ctrl-C in the terminal reaches only the parent, which kills the workers; a
                # parent that dies closes the socket, and the worker exits (worker.py).
                start_new_session=True,
            )
        try:
            status, payload = self._receive()
        except BaseException:  # its own error, or Ctrl-C while it loads
            self.kill()
            raise
        if status == "unavailable":
            self.kill()
            raise EngineUnavailable(payload)
        self.description = payload["description"]
        self.loaded = payload  # memory at start (Python + numpy) and after importing and loading the engine

    def call(self, command: str, *args):
        self.conn.send((command, *args))
        return self._receive()[1]

    def stop(self) -> dict:
        final = self.call("stop")
        self.process.wait(timeout=30)
        return {"rss_start_mib": self.loaded["start"]["rss_mib"], "rss_loaded_mib": self.loaded["loaded"]["rss_mib"],
                "peak_rss_mib": final["peak_rss_mib"]}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def _receive(self):
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise CapsNetError(f"benchmark worker for {self.name} died (exit code {self.process.wait()})") from None
        if status == "error":
            raise CapsNetError(f"benchmark worker for {self.name} failed: {payload}")
        return status, payload
