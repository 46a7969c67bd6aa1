"""Measure `capsnet serve` under hostile load, for docs/serving.md "Limits and failure behaviour".

    python scripts/measure_serving_limits.py --model DIR [--seconds 30] [--drain-runs 3]

Each part starts its own `capsnet serve --model DIR` on free loopback ports (capsnet.bench.server_process) and loads
it with the project's closed-loop load generator (capsnet.bench.loadgen):
- memory: 4 clients send KServe requests refused for their batch size (12 MiB: over the message limit,
  refused by gRPC, or by aiohttp over REST; 1 MiB: under it, refused by the handler), over gRPC and then over
  REST (Triton's binary data), in two rounds of --seconds on one server each; RSS before, peak, and 10 s after
  each round;
- drain: 16 clients in a closed loop, each until its first refusal, SIGTERM after 1.5 s, over gRPC then over REST;
  every call's status and the exit code;
- burst: 3000 concurrent 1-image calls, then 2000 concurrent 32-image calls; their statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time

import grpc
import numpy as np

from capsnet.bench.server_process import ServerProcess
from capsnet.client import loadgen
from capsnet.client.api import image_message
from capsnet.runtime.cpu import CpuKind
from capsnet.v1 import capsnet_pb2 as pb

# the model's KServe names and input shape (a 1x28x28 export)
MODEL, INPUT, SHAPE = "capsnet", "images", (1, 28, 28)
API = {"grpc": "kserve", "rest": "kserve-http"}  # loadgen's API for ModelInfer over each transport
OK = {"grpc": "OK", "rest": "200"}


def target(server: ServerProcess, transport: str) -> str:
    return server.target if transport == "grpc" else server.rest_target


def refused_count(mebibytes: int) -> int:
    return mebibytes * 2 ** 20 // (4 * int(np.prod(SHAPE)))  # images far past any batch limit


async def memory_round(server: ServerProcess, transport: str, mebibytes: int, seconds: float) -> tuple[dict, float]:
    """One round of refused load from 4 clients: their statuses and the server's peak RSS, sampled every 0.5 s."""
    count = refused_count(mebibytes)
    load = asyncio.create_task(loadgen.run_load(
        target(server, transport), np.zeros((count, *SHAPE), np.float32), concurrency=4, batch_size=count,
        max_requests=sys.maxsize, max_seconds=seconds, warmup_requests=0, api=API[transport], model_name=MODEL,
        input_name=INPUT))
    peak = server.memory()["rss_mib"]
    while not load.done():
        await asyncio.sleep(0.5)
        peak = max(peak, server.memory()["rss_mib"])
    return (await load).errors, peak


def memory(model: str, mebibytes: int, seconds: float, transport: str, rounds: int = 2) -> str:
    """`rounds` rounds of refused load on one server over `transport` (grpc, rest), each followed by 10 s idle:
    memory that a round leaves behind and the next one reuses shows as no growth after round 1."""
    codes: dict[str, int] = {}
    idle = []
    with ServerProcess(["--model", model]) as server:
        before = peak = server.memory()["rss_mib"]
        for _ in range(rounds):
            errors, round_peak = asyncio.run(memory_round(server, transport, mebibytes, seconds))
            for code, count in errors.items():
                codes[code] = codes.get(code, 0) + count
            peak = max(peak, round_peak)
            time.sleep(10)
            idle.append(server.memory()["rss_mib"])
    return (f"| {transport}: {mebibytes} MiB requests, 4 clients, {rounds} × {seconds:g} s | {codes} | {before:.0f} | "
            f"{peak:.0f} | {' / '.join(f'{value:.0f}' for value in idle)} |")


async def drain_run(model: str, transport: str) -> str:
    """16 clients, each until its first refusal (a real client goes to another replica), and SIGTERM after 1.5 s."""
    with ServerProcess(["--model", model]) as server:
        image = np.random.default_rng(0).random((1, *SHAPE), dtype=np.float32)
        api = {"grpc": "capsnet", "rest": "kserve-http"}[transport]  # Classify over gRPC
        load = asyncio.create_task(loadgen.run_load(
            target(server, transport), image, concurrency=16, max_requests=sys.maxsize, max_seconds=600,
            warmup_requests=0, stop_on_error=True, api=api, model_name=MODEL, input_name=INPUT))
        await asyncio.sleep(1.5)
        exit_code = await asyncio.to_thread(server.stop)
        result = await load
    codes = {OK[transport]: len(result.latencies_s), **result.errors}
    return f"| {transport}: 16 clients, SIGTERM after 1.5 s | {codes} | exit {exit_code} |"


async def burst(model: str, calls: int, images: int) -> str:
    with ServerProcess(["--model", model]) as server:
        image = image_message(np.random.default_rng(0).random(SHAPE, dtype=np.float32))
        request = pb.ClassifyRequest(images=[image] * images)
        started = time.monotonic()
        codes, details = await loadgen.burst(server.target, request, calls, timeout_s=120)
    return f"| {calls} x {images}-image calls | {dict(codes)} | {dict(details)} | {time.monotonic() - started:.1f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="export directory of a 1x28x28 model")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each memory run (default 30)")
    parser.add_argument("--drain-runs", type=int, default=3)
    parser.add_argument("--only", choices=("memory", "drain", "burst"), help="one part only")
    args = parser.parse_args()
    print(f"CPU: {CpuKind.this_host().describe()}; Python {platform.python_version()}, grpcio {grpc.__version__}\n")
    if args.only in (None, "memory"):
        print("| refused load | statuses | RSS MiB before | peak | 10 s after each round |\n|---|---|---:|---:|---:|")
        for transport in ("grpc", "rest"):
            for mebibytes in (12, 1):
                print(memory(args.model, mebibytes, args.seconds, transport), flush=True)
    if args.only in (None, "drain"):
        print("\n| drain run | statuses | process |\n|---|---|---|")
        for transport in ("grpc", "rest"):
            for _ in range(args.drain_runs):
                print(asyncio.run(drain_run(args.model, transport)), flush=True)
    if args.only in (None, "burst"):
        print("\n| burst | statuses | refusals | wall |\n|---|---|---|---:|")
        for calls, images in ((3000, 1), (2000, 32)):
            print(asyncio.run(burst(args.model, calls, images)), flush=True)


if __name__ == "__main__":
    main()
