"""A bounded closed-loop load test of a capsnet gRPC endpoint (one server, or a load balancer in front of many).

    python deploy/loadtest.py --server 127.0.0.1:8001 --concurrency 16 --duration 20

`--concurrency` clients each send Classify requests (`--batch` images of the model's input shape, uint8 pixels,
poses left out of the answers) back to back over one shared HTTP/2 channel for `--duration` seconds after
`--warmup` seconds that are not counted, through the project's load generator (capsnet.bench.loadgen). Prints one
JSON object: requests, errors by gRPC code, requests and images per second, latency percentiles in milliseconds.
Every call has a deadline, so the run ends within duration + warmup + 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

import grpc
import numpy as np

from capsnet.bench.loadgen import run_load
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc

CALL_TIMEOUT_S = 30.0


def model_info(server: str) -> pb.ModelInfo:
    with grpc.insecure_channel(server) as channel:
        return pb_grpc.CapsNetServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)


def run(server: str, concurrency: int, duration: float, warmup: float, batch: int) -> dict:
    info = model_info(server)
    images = np.random.default_rng(0).integers(0, 256, size=(batch, *info.input_shape), dtype=np.uint8)
    result = asyncio.run(run_load(server, images, concurrency=concurrency, batch_size=batch, max_requests=sys.maxsize,
                                  max_seconds=duration, warmup_requests=0, warmup_seconds=warmup, exclude_poses=True))
    summary = result.summary()
    return {
        "server": server, "model": f"{info.name}:{info.version}", "backend": info.backend,
        "concurrency": concurrency, "batch": batch, "seconds": round(result.elapsed_s, 2),
        "requests": summary["requests"], "errors": summary["errors"],
        "requests_per_s": round(summary["requests_per_s"], 1), "images_per_s": round(summary["images_per_s"], 1),
        "latency_ms": {f"p{q}": round(result.percentile_ms(q), 2) if result.latencies_s else None for q in (50, 90, 99)},
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
        result = run(args.server, args.concurrency, args.duration, args.warmup, args.batch)
    except grpc.RpcError as err:  # the first call (GetModelInfo) failed: nothing to measure
        print(f"loadtest: {args.server}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result["requests"] and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
