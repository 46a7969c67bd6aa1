"""Measure `capsnet serve` under hostile load, for docs/serving.md "Limits and failure behaviour".

    python scripts/measure_serving_limits.py --model DIR [--seconds 30] [--drain-runs 3]

Each part starts its own `capsnet serve --model DIR` on free loopback ports:
- memory: 4 clients send KServe requests refused for their batch size (12 MiB: over the message limit,
  refused by gRPC, or by aiohttp over REST; 1 MiB: under it, refused by the handler), over gRPC and then over
  REST (Triton's binary data), in two rounds of --seconds on one server each; RSS before, peak, and 10 s after
  each round;
- drain: 16 clients in a closed loop, SIGTERM after 1.5 s, over gRPC then over REST; every call's status and the
  exit code;
- burst: 3000 concurrent 1-image calls, then 2000 concurrent 32-image calls; their statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import platform
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import grpc
import numpy as np

from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc
from capsnet.serving import loadgen
from capsnet.serving.client import image_message
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

READY = re.compile(r"grpcs?://[^:]+:(\d+) .* rest https?://[^ ]+:(\d+)")


def start_server(model: str) -> tuple[subprocess.Popen, str, str]:
    """The server, its gRPC and its REST HOST:PORT."""
    process = subprocess.Popen([sys.executable, "-m", "capsnet", "serve", "--model", model, "--grpc-port", "0",
                                "--http-port", "0", "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if match := READY.search(line):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, f"127.0.0.1:{match[1]}", f"127.0.0.1:{match[2]}"
    raise SystemExit(f"capsnet serve did not start (exit {process.wait()})")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def refused_count(mebibytes: int) -> int:
    return mebibytes * 2 ** 20 // (28 * 28 * 4)  # images of a 1x28x28 model, far past any batch limit


def refused_request(mebibytes: int) -> kserve_pb.ModelInferRequest:
    count = refused_count(mebibytes)
    request = kserve_pb.ModelInferRequest(model_name="capsnet")
    request.inputs.add(name="images", datatype="FP32", shape=[count, 1, 28, 28])
    request.raw_input_contents.append(bytes(count * 28 * 28 * 4))
    return request


def rest_request(count: int) -> tuple[bytes, dict]:
    """A REST ModelInfer of `count` blank 1x28x28 images with Triton's binary data, as tritonclient.http sends it."""
    return loadgen.rest_infer_request(np.zeros((count, 1, 28, 28), np.float32), "images")


def grpc_client(target: str, mebibytes: int, codes: collections.Counter, stop: float) -> None:
    request = refused_request(mebibytes)
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < stop:
            try:
                stub.ModelInfer(request, timeout=30)
            except grpc.RpcError as err:
                codes[err.code().name] += 1


def rest_client(target: str, mebibytes: int, codes: collections.Counter, stop: float) -> None:
    body, headers = rest_request(refused_count(mebibytes))
    host, port = target.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    while time.monotonic() < stop:
        try:
            connection.request("POST", "/v2/models/capsnet/infer", body=body, headers=headers)
            with connection.getresponse() as response:
                response.read()
                codes[str(response.status)] += 1
        except (OSError, http.client.HTTPException) as err:  # the server closed the connection mid-upload
            codes[type(err).__name__] += 1
            connection.close()
    connection.close()


def memory(model: str, mebibytes: int, seconds: float, transport: str, rounds: int = 2) -> str:
    """`rounds` rounds of refused load on one server over `transport` (grpc, rest), each followed by 10 s idle:
    memory that a round leaves behind and the next one reuses shows as no growth after round 1."""
    process, grpc_target, rest_target = start_server(model)
    codes = collections.Counter()
    target, send = (grpc_target, grpc_client) if transport == "grpc" else (rest_target, rest_client)

    def client(stop: float) -> None:
        send(target, mebibytes, codes, stop)

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
    return (f"| {transport}: {mebibytes} MiB requests, 4 clients, {rounds} × {seconds:g} s | {dict(codes)} | {before:.0f} | "
            f"{peak:.0f} | {' / '.join(f'{value:.0f}' for value in idle)} |")


async def drain_run(model: str, transport: str) -> str:
    process, grpc_target, rest_target = start_server(model)
    image = np.random.default_rng(0).random((1, 28, 28), dtype=np.float32)
    codes = collections.Counter()
    async with grpc.aio.insecure_channel(grpc_target) as channel, aiohttp.ClientSession() as session:
        stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
        request = pb.ClassifyRequest(images=[image_message(image)])
        body, headers = rest_request(1)

        async def call() -> str:
            if transport == "grpc":
                try:
                    await stub.Classify(request, timeout=30)
                    return "OK"
                except grpc.aio.AioRpcError as err:
                    return err.code().name
            try:
                async with session.post(f"http://{rest_target}/v2/models/capsnet/infer", data=body, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as response:
                    await response.read()
                    return str(response.status)
            except aiohttp.ClientError as err:
                return type(err).__name__

        async def client() -> None:
            while True:
                codes[code := await call()] += 1
                if code not in ("OK", "200"):
                    return  # refused: a real client goes to another replica

        clients = asyncio.gather(*(client() for _ in range(16)))
        await asyncio.sleep(1.5)
        process.send_signal(signal.SIGTERM)
        await clients
    return f"| {transport}: 16 clients, SIGTERM after 1.5 s | {dict(codes)} | exit {process.wait(60)} |"


async def burst(model: str, calls: int, images: int) -> str:
    process, target, _ = start_server(model)
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
    parser.add_argument("--only", choices=("memory", "drain", "burst"), help="one part only")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; Python {platform.python_version()}, grpcio {grpc.__version__}\n")
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
