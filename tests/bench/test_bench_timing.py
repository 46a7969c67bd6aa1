"""Latency summaries, timing loops and /proc memory readings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from capsnet.bench.memory import memory_mib
from capsnet.bench.timing import summarize, time_calls
from capsnet.errors import CapsNetError


def test_bench_summarize_percentiles_and_throughput_from_the_median():
    durations = [0.001 * n for n in range(1, 102)]  # 1 ms ... 101 ms
    summary = summarize(durations, images_per_call=8)
    assert summary["calls"] == 101
    assert summary["p50_ms"] == pytest.approx(51.0)
    assert summary["p99_ms"] == pytest.approx(100.0)
    assert summary["images_per_s"] == pytest.approx(8 / 0.051)
    assert all(isinstance(value, (int, float)) and not hasattr(value, "dtype") for value in summary.values())


def test_bench_time_calls_honours_the_minimum_count():
    calls = []
    durations = time_calls(lambda: calls.append(1), min_calls=7, min_seconds=0.0)
    assert len(durations) == len(calls) == 7


def test_bench_memory_peak_follows_an_allocation():
    # in a process of its own: in the test worker, other tests' threads may free as much meanwhile
    code = ("from capsnet.bench.memory import memory_mib\n"
            "before = memory_mib()\n"
            "block = b'\\x01' * (64 * 2**20)  # 64 MiB, written, so its pages are resident\n"
            "after = memory_mib()\n"
            "print(before['rss_mib'], after['rss_mib'], after['peak_rss_mib'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, peak = map(float, done.stdout.split())
    assert peak >= after >= before + 60


def test_bench_memory_of_a_missing_process_is_an_error():
    with pytest.raises(CapsNetError, match="cannot read the memory of process"):
        memory_mib(2**22 + 1)
