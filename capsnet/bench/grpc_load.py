"""End-to-end gRPC: `capsnet serve` in a child process under closed-loop load, through both APIs.

For dynamic batching on and off, one server is started; for each API (our Classify, KServe
ModelInfer) and each concurrency, a closed-loop load generator (capsnet/bench/loadgen.py) keeps that many
one-image requests in flight for the timed seconds, after a few warm-up requests. Every row is compared with the
in-process engine at batch size = concurrency (what perfect batching with no RPC cost would give), timed in a
worker process for half the row's seconds just before the row and half just after, so both meet the same load on a
shared machine.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from capsnet.bench.engines import split
from capsnet.bench.inprocess import SETTLE_SECONDS, EngineWorker, tile
from capsnet.bench.machine import cores
from capsnet.bench.server_process import ServerProcess
from capsnet.errors import CapsNetError

log = logging.getLogger(__name__)

SERVER_ENGINE = "onnxruntime:fp32"  # what `capsnet serve` runs here
APIS = ("capsnet", "kserve")
WARMUP_REQUESTS = 20  # sent one at a time before each row's timed run
MAX_REQUESTS = 1_000_000  # per row: the run is bounded by the seconds first


def server_flags(dynamic_batching: bool, max_concurrency: int) -> list[str]:
    """Off: every request is its own backend run. On: up to max_concurrency images per run, the
    server's default queue delay."""
    if dynamic_batching:
        return ["--max-batch-size", str(max_concurrency)]
    return ["--max-batch-size", "1", "--max-queue-delay-us", "0"]


def run_grpc_load(model_dir: str, images: np.ndarray, concurrency: tuple[int, ...], threads: int,
                  seconds: float) -> dict:
    from capsnet.serving.engine.artifacts import load_artifacts

    artifacts = load_artifacts(model_dir)
    reference = EngineWorker(SERVER_ENGINE, model_dir, threads, max(concurrency))
    try:
        rows, servers = _run_servers(artifacts, model_dir, images, concurrency, threads, seconds, reference)
    finally:
        reference.kill()
    return {
        "server": {"engine": SERVER_ENGINE, "threads": threads, "configs": servers},
        "cores": cores(),
        "images_per_request": 1,
        "seconds": seconds,
        "results": rows,
        "server_memory": {"idle_rss_mib": servers["on"]["idle_rss_mib"],
                          "peak_rss_mib": max(config["peak_rss_mib"] for config in servers.values())},
    }


def _run_servers(artifacts, model_dir: str, images: np.ndarray, concurrency: tuple[int, ...], threads: int,
                 seconds: float, reference: EngineWorker) -> tuple[list[dict], dict]:
    from capsnet.bench.loadgen import run_load

    rows, servers = [], {}
    for batching in (True, False):
        kind, precision = split(SERVER_ENGINE)
        batching_flags = server_flags(batching, max(concurrency))
        flags = ["--model", model_dir, "--backend", kind, "--precision", precision,
                 "--threads", str(threads), *batching_flags]
        with ServerProcess(flags) as server:
            idle = server.memory()["rss_mib"]
            for api in APIS:
                for clients in concurrency:
                    log.info("gRPC %s, dynamic batching %s, concurrency %d", api, "on" if batching else "off", clients)
                    batch = tile(images, clients)
                    durations = _time_inprocess(reference, batch, seconds / 2)
                    before, cpu, wall = server.scrape(), time.process_time(), time.perf_counter()
                    result = asyncio.run(run_load(
                        server.target, images, concurrency=clients, max_requests=MAX_REQUESTS, max_seconds=seconds,
                        warmup_requests=WARMUP_REQUESTS, api=api, model_name=artifacts.name,
                        input_name=artifacts.input_name))
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    server.check_alive()  # a server that died mid-row: its exit, not the failed requests
                    if not result.latencies_s:
                        raise CapsNetError(f"gRPC {api} at concurrency {clients}: every request failed "
                                           f"({result.errors})")
                    row = {**_row(result), **_server_view(before, server.scrape(), cpu, wall)}
                    in_process = _inprocess_view(durations + _time_inprocess(reference, batch, seconds / 2), clients)
                    rows.append({
                        "api": api, "dynamic_batching": batching, "concurrency": clients, **row,
                        "inprocess": in_process,
                        "ratio_to_inprocess": row["images_per_s"] / in_process["images_per_s"],
                    })
            servers["on" if batching else "off"] = {"batching_flags": batching_flags, "idle_rss_mib": idle,
                                                    "peak_rss_mib": server.memory()["peak_rss_mib"]}
    return rows, servers


def _time_inprocess(worker: EngineWorker, batch: np.ndarray, seconds: float) -> list[float]:
    time.sleep(SETTLE_SECONDS)
    return worker.call("time", batch, seconds)


def _inprocess_view(durations: list[float], batch_size: int) -> dict:
    """The in-process reference beside a gRPC row: throughput over the whole timed span, as the row's own
    (not from the median call), and the p50 call latency."""
    return {"batch_size": batch_size, "calls": len(durations),
            "images_per_s": batch_size * len(durations) / sum(durations), "p50_ms": float(np.median(durations)) * 1e3}


def _server_view(before: dict, after: dict, client_cpu_s: float, wall_s: float) -> dict:
    """Where one row's time went, from the server's metrics and both processes' CPU time over the
    row's wall time (its warm-up requests included): mean request time inside the server, mean batch,
    share of the wall time the backend was computing, and CPU seconds per second of the server and of
    this load generator."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = delta("capsnet_batch_size_count")
    return {
        "server_mean_ms":
            delta("capsnet_request_duration_seconds_sum") / delta("capsnet_request_duration_seconds_count") * 1e3,
        "server_mean_batch": delta("capsnet_batch_size_sum") / batches,
        "server_mean_queue_wait_ms":
            delta("capsnet_queue_wait_seconds_sum") / delta("capsnet_queue_wait_seconds_count") * 1e3,
        "server_compute_busy": delta("capsnet_compute_seconds_sum") / wall_s,
        "server_cpu_per_s": delta("process_cpu_seconds_total") / wall_s,
        "client_cpu_per_s": client_cpu_s / wall_s,
    }


def _row(result) -> dict:
    """A loadgen LoadResult as a table row: throughput over the run's whole elapsed time."""
    summary = result.summary()
    return {"requests": summary["requests"], "elapsed_s": result.elapsed_s, "images_per_s": summary["images_per_s"],
            "p50_ms": result.percentile_ms(50), "p90_ms": result.percentile_ms(90), "p99_ms": result.percentile_ms(99),
            "errors": sum(summary["errors"].values()), "error_codes": summary["errors"]}

