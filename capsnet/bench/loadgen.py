"""Closed-loop load on a running server, and the same images through the backend in-process.

Each of `concurrency` clients sends a Classify (or, with --api kserve, a KServe ModelInfer; with --api tritonclient,
the same through tritonclient's asyncio gRPC client; with --api kserve-http, the same over HTTP/REST with binary data,
to the server's REST port) request, waits for the answer, sends the next; a run stops after `max_requests` requests
or `max_seconds`, whichever comes first. The in-process baseline calls the backend the server would use, at a given
batch size, with no gRPC, queue or batcher: what the network and the server add is the difference.

The project's one closed-loop load generator: `capsnet bench`, the GPU check, deploy/loadtest.py (a deployment's load
test), scripts/serving_ab.py and scripts/measure_serving_limits.py (refused and drained load) all drive run_load.

    capsnet serve --model DIR --grpc-port 8001 &
    python -m capsnet.bench.loadgen --server 127.0.0.1:8001 --model DIR --concurrency 1 16
    python -m capsnet.bench.loadgen --server 127.0.0.1:8001 --api kserve-http --rest 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np

from capsnet.client.api import DEFAULT_MAX_MESSAGE_BYTES, image_message
from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_pb_grpc
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc


@dataclass
class LoadResult:
    name: str
    concurrency: int
    batch_size: int  # images per request (or per backend run in-process)
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)  # successful requests only
    errors: dict[str, int] = field(default_factory=dict)  # gRPC status name (REST: HTTP status) -> count

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3 if self.latencies_s else float("nan")

    def summary(self) -> dict:
        done = len(self.latencies_s)
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "batch_size": self.batch_size,
            "requests": done,
            "errors": self.errors,
            "requests_per_s": done / self.elapsed_s,
            "images_per_s": done * self.batch_size / self.elapsed_s,
            "p50_ms": self.percentile_ms(50),
            "p99_ms": self.percentile_ms(99),
        }


def random_images(count: int, shape: tuple[int, int, int], seed: int = 0) -> np.ndarray:
    """uint8-like pixels as float32 in [0, 1]: CapsNet's cost does not depend on the content."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (count, *shape)) / 255).astype(np.float32)  # (count, C, H, W)


class _Failed(Exception):
    """A request answered with an error: its gRPC status name, or its HTTP status."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


@contextlib.asynccontextmanager
async def _grpc_channel(target: str, credentials: grpc.ChannelCredentials | None):
    options = [("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES)]
    channel = (grpc.aio.secure_channel(target, credentials, options) if credentials
               else grpc.aio.insecure_channel(target, options))
    async with channel:
        yield channel


def _grpc_send(rpc):
    async def send(request) -> None:
        try:
            await rpc(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            raise _Failed(err.code().name) from None
    return send


@contextlib.asynccontextmanager
async def _classify(target: str, credentials, batches: list[np.ndarray], model_name: str, input_name: str,
                    exclude_poses: bool = False):
    """Our API: a ClassifyRequest per batch (uint8 images as uint8 tensors, float ones as FP32), and how to send one
    with the Classify RPC."""
    async with _grpc_channel(target, credentials) as channel:
        yield ([pb.ClassifyRequest(images=[image_message(image) for image in batch], exclude_poses=exclude_poses)
                for batch in batches], _grpc_send(pb_grpc.CapsNetServiceStub(channel).Classify))


def _check_kserve_names(model_name: str, input_name: str) -> None:
    if not model_name or not input_name:
        raise ValueError("KServe load needs the model's name and input name")


@contextlib.asynccontextmanager
async def _model_infer(target: str, credentials, batches: list[np.ndarray], model_name: str, input_name: str):
    """KServe v2 over gRPC: a ModelInferRequest per batch (raw little-endian FP32), and the ModelInfer RPC."""
    _check_kserve_names(model_name, input_name)
    requests = [kserve_pb.ModelInferRequest(
        model_name=model_name,
        inputs=[kserve_pb.ModelInferRequest.InferInputTensor(name=input_name, datatype="FP32", shape=batch.shape)],
        raw_input_contents=[np.ascontiguousarray(batch, dtype="<f4").tobytes()],
    ) for batch in batches]
    async with _grpc_channel(target, credentials) as channel:
        yield requests, _grpc_send(kserve_pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer)


@contextlib.asynccontextmanager
async def _tritonclient_infer(target: str, credentials, batches: list[np.ndarray], model_name: str, input_name: str):
    """KServe v2 over gRPC as Triton's own tools send it: tritonclient's asyncio client, raw FP32 inputs, every output.
    tritonclient is a dev extra, imported only here."""
    import tritonclient.grpc.aio as triton
    from tritonclient.utils import InferenceServerException

    _check_kserve_names(model_name, input_name)
    if credentials is not None:
        raise ValueError("tritonclient load is plain gRPC")
    requests = []
    for batch in batches:
        tensor = triton.InferInput(input_name, list(batch.shape), "FP32")
        tensor.set_data_from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        requests.append([tensor])
    client = triton.InferenceServerClient(target)
    try:
        async def send(inputs) -> None:
            try:
                await client.infer(model_name, inputs, client_timeout=30)
            except InferenceServerException as err:
                raise _Failed(str(err.status())) from None

        yield requests, send
    finally:
        await client.close()


def rest_infer_request(batch: np.ndarray, input_name: str) -> tuple[bytes, dict[str, str]]:
    """A KServe REST infer body and its headers, as tritonclient.http sends them: the JSON, then the batch's raw FP32
    bytes (Triton's binary data extension), every output asked back in binary."""
    data = np.ascontiguousarray(batch, dtype="<f4").tobytes()
    header = json.dumps({"inputs": [{"name": input_name, "datatype": "FP32", "shape": list(batch.shape),
                                     "parameters": {"binary_data_size": len(data)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    return header + data, {"Inference-Header-Content-Length": str(len(header)),
                           "Content-Type": "application/octet-stream"}


@contextlib.asynccontextmanager
async def _http_model_infer(target: str, credentials, batches: list[np.ndarray], model_name: str, input_name: str):
    """KServe v2 over HTTP/REST, as tritonclient.http sends it: JSON then the raw FP32 bytes (Triton's binary data
    extension), every output asked back in binary. `target` is the REST port's HOST:PORT; plain HTTP only."""
    _check_kserve_names(model_name, input_name)
    if credentials is not None:
        raise ValueError("REST load is plain HTTP")
    requests = [rest_infer_request(batch, input_name) for batch in batches]
    url = f"http://{target}/v2/models/{model_name}/infer"
    # Pooled, kept-alive connections: as many as clients wait at once.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def send(request) -> None:
            body, headers = request
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
            # the server closed the connection (mid-upload of a body over its limit, or stopping) or did not answer
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                raise _Failed(type(err).__name__) from None
            if response.status != 200:
                raise _Failed(str(response.status))

        yield requests, send


# api -> (LoadResult name, its requests and how to send one, over a connection to the target)
APIS = {"capsnet": ("grpc", _classify), "kserve": ("grpc-kserve", _model_infer),
        "tritonclient": ("grpc-kserve-tritonclient", _tritonclient_infer),
        "kserve-http": ("http-kserve", _http_model_infer)}


async def run_load(target: str, images: np.ndarray, *, concurrency: int, batch_size: int = 1,
                   max_requests: int = 1000, max_seconds: float = 30.0, warmup_requests: int = 20,
                   warmup_seconds: float = 0.0, stop_on_error: bool = False, api: str = "capsnet",
                   model_name: str = "", input_name: str = "", exclude_poses: bool = False,
                   credentials: grpc.ChannelCredentials | None = None) -> LoadResult:
    """Closed-loop load from `concurrency` clients sharing one channel (REST: one session), through `api` (a key of
    APIS); the KServe ones address the model by `model_name` and `input_name`, Classify leaves the poses out of its
    answers with `exclude_poses`.

    First `warmup_requests` one at a time, then the clients for `warmup_seconds` (not counted) and `max_seconds`
    (counted, up to `max_requests` requests). With `stop_on_error` a client stops at its first failed request, as a
    client of a server that drains goes to another replica."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    if exclude_poses and api != "capsnet":
        raise ValueError("exclude_poses is Classify's (api capsnet)")
    name, transport = APIS[api]
    batches = [images[start:start + batch_size] for start in range(0, len(images) - batch_size + 1, batch_size)]
    options = {"exclude_poses": exclude_poses} if exclude_poses else {}
    async with transport(target, credentials, batches, model_name, input_name, **options) as (requests, send):
        for index in range(warmup_requests):
            await send(requests[index % len(requests)])
        latencies: list[float] = []
        errors: collections.Counter = collections.Counter()
        issued = counted = 0
        measure_from = time.perf_counter() + warmup_seconds
        stop_at = measure_from + max_seconds

        async def client() -> None:
            nonlocal issued, counted
            while counted < max_requests and (sent := time.perf_counter()) < stop_at:
                request = requests[issued % len(requests)]
                issued += 1
                measured = sent >= measure_from
                counted += measured
                try:
                    await send(request)
                except _Failed as err:
                    errors[err.code] += measured
                    if stop_on_error:
                        return
                else:
                    if measured:
                        latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - measure_from
    return LoadResult(name, concurrency, batch_size, elapsed, latencies, dict(+errors))


async def burst(target: str, request: pb.ClassifyRequest, calls: int,
                timeout_s: float) -> tuple[collections.Counter, collections.Counter]:
    """`calls` Classify calls of `request`, all in flight at once on one channel (open loop, unlike
    run_load): how many ended with each status code, and how many failed with each detail (up to its ':')."""
    codes: collections.Counter = collections.Counter()
    details: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.CapsNetServiceStub(channel)

        async def one() -> None:
            try:
                await stub.Classify(request, timeout=timeout_s)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] += 1
                details[(err.details() or "").split(":")[0]] += 1

        await asyncio.gather(*(one() for _ in range(calls)))
    return codes, details


def run_inprocess(backend, images: np.ndarray, *, batch_size: int, max_runs: int = 1000,
                  max_seconds: float = 30.0, warmup_runs: int = 5) -> LoadResult:
    """The backend called back to back on batches of `batch_size`, in this thread."""
    batches = [np.ascontiguousarray(images[start:start + batch_size])  # (batch_size, C, H, W)
               for start in range(0, len(images) - batch_size + 1, batch_size)]
    for index in range(warmup_runs):
        backend.run(batches[index % len(batches)].copy())
    latencies: list[float] = []
    started = time.perf_counter()
    while len(latencies) < max_runs and time.perf_counter() - started < max_seconds:
        batch = batches[len(latencies) % len(batches)].copy()
        sent = time.perf_counter()
        backend.run(batch)
        latencies.append(time.perf_counter() - sent)
    return LoadResult(f"in-process {backend.name}", 1, batch_size, time.perf_counter() - started, latencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="closed-loop gRPC or REST load vs the in-process backend")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's gRPC address")
    parser.add_argument("--rest", metavar="HOST:PORT", help="the server's REST address, for --api kserve-http")
    parser.add_argument("--model", metavar="DIR", help="export directory: also time its backend in-process")
    parser.add_argument("--backend", default="onnxruntime", help="in-process backend (default onnxruntime)")
    parser.add_argument("--threads", type=int, default=0, help="in-process backend threads (0: the server's default)")
    parser.add_argument("--api", choices=APIS, default="capsnet",
                        help="capsnet (Classify), kserve (ModelInfer), tritonclient (ModelInfer through tritonclient's "
                             "asyncio client) or kserve-http (ModelInfer over REST, at --rest)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--batch-size", type=int, default=1, help="images per request")
    parser.add_argument("--requests", type=int, default=2000, help="most requests per run")
    parser.add_argument("--seconds", type=float, default=20.0, help="longest run")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = parser.parse_args(argv)
    if (args.api == "kserve-http") != (args.rest is not None):
        parser.error("--rest HOST:PORT goes with --api kserve-http, and only with it")

    stub = pb_grpc.CapsNetServiceStub(grpc.insecure_channel(args.server))
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    images = random_images(256, tuple(info.input_shape))
    target = args.rest or args.server
    results = [asyncio.run(run_load(target, images, concurrency=c, batch_size=args.batch_size,
                                    max_requests=args.requests, max_seconds=args.seconds, api=args.api,
                                    model_name=info.name, input_name=info.input_name))
               for c in args.concurrency]
    if args.model:
        from capsnet.serving.config import ServerConfig
        from capsnet.serving.engine.artifacts import load_artifacts
        from capsnet.serving.engine.backends import load_backend

        config = ServerConfig(model_dir=Path(args.model), backend=args.backend, threads=args.threads)
        backend = load_backend(load_artifacts(args.model), config).backend  # self-checked, as the server's
        # The in-process batch sizes a server can reach: the request's, and what c clients can fill.
        for size in sorted({args.batch_size * c for c in args.concurrency}):
            results.append(run_inprocess(backend, images, batch_size=size, max_runs=args.requests,
                                         max_seconds=args.seconds))
    for result in results:
        row = result.summary()
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['name']:>24}  c={row['concurrency']:<3} batch={row['batch_size']:<3} "
                  f"{row['images_per_s']:9.1f} images/s  {row['requests_per_s']:9.1f} req/s  "
                  f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  errors {row['errors'] or 0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
