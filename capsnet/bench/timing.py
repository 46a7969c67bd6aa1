"""Timing loops and latency summaries shared by every benchmark. The loop that times engines taking turns is the
server's auto race's own, capsnet.serving.engine.self_check.times_in_turns: serving may not import the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def time_calls(fn: Callable[[], object], *, min_calls: int, min_seconds: float) -> list[float]:
    """Seconds per call of `fn`, called until both `min_calls` calls and `min_seconds` have passed."""
    durations: list[float] = []
    start = time.perf_counter()
    while len(durations) < min_calls or time.perf_counter() - start < min_seconds:
        before = time.perf_counter()
        fn()
        durations.append(time.perf_counter() - before)
    return durations


def summarize(durations: list[float], images_per_call: int) -> dict:
    """Latency percentiles in ms, and throughput from the median call (robust to a noisy shared machine)."""
    seconds = np.asarray(durations)
    p50, p90, p99 = (float(p) for p in np.percentile(seconds, [50, 90, 99]))
    return {
        "calls": len(durations),
        "p50_ms": p50 * 1e3,
        "p90_ms": p90 * 1e3,
        "p99_ms": p99 * 1e3,
        "mean_ms": float(seconds.mean()) * 1e3,
        "images_per_s": images_per_call / p50,
    }
