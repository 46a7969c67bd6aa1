"""A bounded closed-loop load test of a capsnet gRPC endpoint (one server, or a load balancer in front of many).

    python deploy/loadtest.py --server 127.0.0.1:8001 --concurrency 16 --duration 20

`--concurrency` clients each send Classify requests (`--batch` images of the model's input shape, uint8 pixels)
back to back over one shared HTTP/2 channel for `--duration` seconds after `--warmup` seconds that are not
counted. Prints one JSON object: requests, errors by gRPC code, requests and images per second, latency
percentiles in milliseconds. Every call has a deadline, so the run ends within duration + warmup + 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter

import grpc
import numpy as np

from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc

CALL_TIMEOUT_S = 30.0


async def run(server: str, concurrency: int, duration: float, warmup: float, batch: int) -> dict:
    async with grpc.aio.insecure_channel(server) as channel:
        stub = pb_grpc.CapsNetServiceStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
        shape = list(info.input_shape)  # [C, H, W]
        rng = np.random.default_rng(0)
        request = pb.ClassifyRequest(exclude_poses=True, images=[
            pb.Image(tensor=pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=shape,
                                      data=rng.integers(0, 256, size=shape, dtype=np.uint8).tobytes()))
            for _ in range(batch)])

        start = time.monotonic()
        measure_from, stop_at = start + warmup, start + warmup + duration
        latencies: list[float] = []
        codes: Counter[str] = Counter()

        async def client() -> None:
            while (sent := time.monotonic()) < stop_at:
                try:
                    await stub.Classify(request, timeout=CALL_TIMEOUT_S)
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                if sent >= measure_from:
                    codes[code] += 1
                    if code == "OK":
                        latencies.append(time.monotonic() - sent)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - measure_from

    ok = codes.pop("OK", 0)
    ms = np.array(latencies) * 1000
    return {
        "server": server, "model": f"{info.name}:{info.version}", "backend": info.backend,
        "concurrency": concurrency, "batch": batch, "seconds": round(elapsed, 2),
        "requests": ok, "errors": dict(codes),
        "requests_per_s": round(ok / elapsed, 1), "images_per_s": round(ok * batch / elapsed, 1),
        "latency_ms": {p: round(float(np.percentile(ms, int(p[1:]))), 2) if ok else None
                       for p in ("p50", "p90", "p99")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:8001", help="host:port (default 127.0.0.1:8001)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (default 2)")
    parser.add_argument("--batch", type=int, default=1, help="images per request (default 1)")
    args = parser.parse_args(argv)
    # NaN passed `x <= 0` and sent nothing; infinity ran for ever
    if (args.concurrency < 1 or args.batch < 1 or not (0 < args.duration < math.inf)
            or not (0 <= args.warmup < math.inf)):
        parser.error("--concurrency and --batch must be >= 1, --duration a finite number > 0, --warmup finite and >= 0")
    try:
        result = asyncio.run(run(args.server, args.concurrency, args.duration, args.warmup, args.batch))
    except grpc.RpcError as err:  # the first call (GetModelInfo) failed: nothing to measure
        print(f"loadtest: {args.server}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result["requests"] and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
