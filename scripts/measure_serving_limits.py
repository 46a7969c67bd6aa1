"""Measure `capsnet serve` under hostile load, for docs/serving.md "Limits and failure behaviour".

    python scripts/measure_serving_limits.py --model DIR [--seconds 30] [--drain-runs 3]

Each part starts its own `capsnet serve --model DIR` on free loopback ports:
- memory: 4 clients send KServe requests refused for their batch size (12 MiB: over the message limit,
  refused by gRPC; 1 MiB: under it, refused by the handler) in two rounds of --seconds on one server; RSS
  before, peak, and 10 s after each round;
- drain: 16 clients in a closed loop, SIGTERM after 1.5 s; every call's status and the exit code;
- burst: 3000 concurrent 1-image calls, then 2000 concurrent 32-image calls; their statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import platform
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc
from capsnet.serving import loadgen
from capsnet.serving.client import image_message
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

READY = re.compile(r"grpcs?://[^:]+:(\d+) ")


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "capsnet", "serve", "--model", model, "--grpc-port", "0",
                                "--http-port", "0", "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if match := READY.search(line):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, f"127.0.0.1:{match[1]}"
    raise SystemExit(f"capsnet serve did not start (exit {process.wait()})")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def refused_request(mebibytes: int) -> kserve_pb.ModelInferRequest:
    count = mebibytes * 2 ** 20 // (28 * 28 * 4)  # images of a 1x28x28 model, far past any batch limit
    request = kserve_pb.ModelInferRequest(model_name="capsnet")
    request.inputs.add(name="images", datatype="FP32", shape=[count, 1, 28, 28])
    request.raw_input_contents.append(bytes(count * 28 * 28 * 4))
    return request


def memory(model: str, mebibytes: int, seconds: float, rounds: int = 2) -> str:
    """`rounds` rounds of refused load on one server, each followed by 10 s idle: memory that a round leaves
    behind and the next one reuses shows as no growth after round 1."""
    process, target = start_server(model)
    request, codes = refused_request(mebibytes), collections.Counter()

    def client(stop: float) -> None:
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < stop:
                try:
                    stub.ModelInfer(request, timeout=30)
                except grpc.RpcError as err:
                    codes[err.code().name] += 1

    before = peak = rss_mib(process.pid)
    idle = []
    for _ in range(rounds):
        stop = time.monotonic() + seconds
        clients = [threading.Thread(target=client, args=(stop,)) for _ in range(4)]
        for thread in clients:
            thread.start()
        while any(thread.is_alive() for thread in clients):
            time.sleep(0.5)
            peak = max(peak, rss_mib(process.pid))
        time.sleep(10)
        idle.append(rss_mib(process.pid))
    process.kill()
    return (f"| {mebibytes} MiB requests, 4 clients, {rounds} × {seconds:g} s | {dict(codes)} | {before:.0f} | "
            f"{peak:.0f} | {' / '.join(f'{value:.0f}' for value in idle)} |")


async def drain_run(model: str) -> str:
    process, target = start_server(model)
    request = pb.ClassifyRequest(images=[image_message(np.random.default_rng(0).random((1, 28, 28), dtype=np.float32))])
    codes = collections.Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)

        async def client() -> None:
            while True:
                try:
                    await stub.Classify(request, timeout=30)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    codes[err.code().name] += 1
                    return  # refused: a real client goes to another replica

        clients = asyncio.gather(*(client() for _ in range(16)))
        await asyncio.sleep(1.5)
        process.send_signal(signal.SIGTERM)
        await clients
    return f"| 16 clients, SIGTERM after 1.5 s | {dict(codes)} | exit {process.wait(60)} |"


async def burst(model: str, calls: int, images: int) -> str:
    process, target = start_server(model)
    image = image_message(np.random.default_rng(0).random((1, 28, 28), dtype=np.float32))
    request = pb.ClassifyRequest(images=[image] * images)
    started = time.monotonic()
    codes, details = await loadgen.burst(target, request, calls, timeout_s=120)
    process.kill()
    return f"| {calls} x {images}-image calls | {dict(codes)} | {dict(details)} | {time.monotonic() - started:.1f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="export directory of a 1x28x28 model")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each memory run (default 30)")
    parser.add_argument("--drain-runs", type=int, default=3)
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; Python {platform.python_version()}, grpcio {grpc.__version__}\n")
    print("| refused load | statuses | RSS MiB before | peak | 10 s after each round |\n|---|---|---:|---:|---:|")
    for mebibytes in (12, 1):
        print(memory(args.model, mebibytes, args.seconds), flush=True)
    print("\n| drain run | statuses | process |\n|---|---|---|")
    for _ in range(args.drain_runs):
        print(asyncio.run(drain_run(args.model)), flush=True)
    print("\n| burst | statuses | refusals | wall |\n|---|---|---|---:|")
    for calls, images in ((3000, 1), (2000, 32)):
        print(asyncio.run(burst(args.model, calls, images)), flush=True)


if __name__ == "__main__":
    main()
