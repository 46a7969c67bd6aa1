"""One-image KServe gRPC requests against five servers of one ONNX model, in one run: the bare `grpc.aio` floor with
and without the engine, `capsnet serve` with one process and with N front-end processes, and Triton through PyTriton.

- floor: a grpc.aio server (this file, `--floor`) that decodes each request's tensor and answers fixed outputs of the
  model's shapes, with no model: what Python gRPC itself costs a request;
- floor+engine: the same server, answering the outputs of capsnet's engine run on each request's images (`--floor
  --floor-engine`): the least a Python gRPC server that runs the model costs a request, with no checks, batching,
  statistics or metrics;
- capsnet-1 and capsnet-N: `capsnet serve --workers 1|N` on the ONNX Runtime backend (FP32), N front ends beside one
  engine process (serving/workers.py);
- pytriton: Triton's server through PyTriton, ONNX Runtime in its Python model with dynamic batching (this file,
  `--pytriton`, run by --pytriton-python, a Python that has nvidia-pytriton and onnxruntime); skipped without it.

perf_analyzer drives each at each concurrency (1-image requests, `--input-data zero`), read from its CSV: requests/s,
p50 and p99. perf_analyzer runs from tritonclient 2.41's wheel in a venv of its own (docs/benchmarks/README.md);
without --perf-analyzer, the project's load generator (serving/loadgen.py, tritonclient's asyncio client in this
process) applies the load instead. Around each cell the server's process tree's CPU time (user + system, every
process of it) and its request count (its ModelStatistics, which every server here answers) give the server CPU time
per request. The engine's in-process time is the backend's p50 at batch 1, called directly.

    python3 -m venv /opt/perf-analyzer && /opt/perf-analyzer/bin/pip install tritonclient==2.41.0 \\
        nvidia-cuda-runtime-cu12   # and apt-get install libb64-0d
    python3.10 -m venv /opt/pytriton && /opt/pytriton/bin/pip install nvidia-pytriton onnxruntime numpy
    .venv/bin/python scripts/bench_front_end.py --perf-analyzer /opt/perf-analyzer/bin/perf_analyzer \\
        --pytriton-python /opt/pytriton/bin/python --out docs/benchmarks/front-end-cpu

PyTriton 0.7's Python 3.11 backend stub fails against a Python 3.11.7 standard library (its multiprocessing calls
RLock._recursion_count, which the stub's interpreter lacks), so its venv here is a Python 3.10's.

writes OUT.json and OUT.md. On a GPU host (scripts/gpu_check.sh, its front-end step) add `--gpu 0`: capsnet serves with
the fused engine in fp16 on the device (--engine), and PyTriton is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # serving_ab: the same checkpoint, ready line and machine facts, imported
# where used, as the floor and PyTriton run in Pythons without the project's dependencies

MODEL = "capsnet"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BATCH_SIZES = (1, 4, 16, 64)  # the engine's CPU time per image is measured at these
CPU_PARTS = ("total", "main thread", "gRPC threads", "engine process")
ENGINE_ARGV = b"capsnet.serving.workers\0engine\0"  # in the command line of `--workers N`'s engine process


# -- the servers -------------------------------------------------------------------------------------------------

def _ticks(stat: Path) -> int:
    """utime + stime of a /proc stat file, in clock ticks."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Served:
    """A server process, ready once it prints `ready` (the floor, PyTriton) or capsnet's ready line."""

    def __init__(self, name: str, command: list[str], port: int | None = None):
        from serving_ab import wait_until_ready

        self.name, self.command = name, command
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        start_new_session=True)
        self.target, _ = wait_until_ready(self.process, name, port)

    def cpu_seconds(self) -> dict[str, float]:
        """User + system time of every process of the server's tree (its children: front ends, engine, Triton): in
        all, in the processes' main threads (a Python server's event loop), in gRPC's core threads, and in capsnet's
        engine process behind N front ends (the one process every request crosses)."""
        spent = dict.fromkeys(CPU_PARTS, 0.0)
        pids = [self.process.pid]
        while pids:
            pid = pids.pop()
            try:
                ticks = _ticks(Path(f"/proc/{pid}/stat")) / CLK_TCK  # its threads, ended ones too
                spent["total"] += ticks
                if ENGINE_ARGV in Path(f"/proc/{pid}/cmdline").read_bytes():
                    spent["engine process"] += ticks
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids.extend(int(child) for child in (task / "children").read_text().split())
                    if task.name == str(pid):
                        spent["main thread"] += _ticks(task / "stat") / CLK_TCK
                    elif (task / "comm").read_text().startswith(("event_engine", "grpc")):
                        spent["gRPC threads"] += _ticks(task / "stat") / CLK_TCK
            except (FileNotFoundError, ProcessLookupError):
                continue
        return spent

    def counts(self) -> tuple[int, int, int]:
        """Requests answered, images inferred, backend runs (its ModelStatistics, through the project's own KServe
        stubs: a GPU host may have no tritonclient)."""
        import grpc

        from capsnet.kserve import grpc_service_pb2 as pb
        from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.target) as channel:
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name=MODEL), timeout=30).model_stats
        return (sum(model.inference_stats.success.count for model in stats),
                sum(model.inference_count for model in stats), sum(model.execution_count for model in stats))

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_io(model_dir: Path) -> tuple[list[int], dict[str, list[int]]]:
    description = json.loads((model_dir / "model.json").read_text())
    outputs = {output["name"]: list(output["shape"]) for output in description["outputs"]}
    return list(description["input"]["shape"]), outputs


# -- the floor: grpc.aio, the tensor decoded, fixed outputs --------------------------------------------------------

def floor(model_dir: Path, port: int, engine: str | None, gpu: int | None) -> None:
    """`engine` (BACKEND:PRECISION): each request's outputs are the engine's on its images, else fixed zeros."""
    import grpc
    from google.protobuf import json_format

    from capsnet.kserve import grpc_service_pb2 as pb
    from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
    from capsnet.kserve import model_config_pb2 as config_pb

    image, outputs = model_io(model_dir)
    answers = {name: np.zeros(shape, np.float32).tobytes() for name, shape in outputs.items()}
    backend = None if engine is None else create_engine(model_dir, engine, gpu)
    if backend is not None:  # compiled and warm before the first request, as capsnet serve's engine is
        backend.run(np.zeros((1, *image), np.float32))
    count = images_run = 0  # requests answered; images the engine ran, each request its own run

    class Floor(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="floor", version="1")

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=True)

        async def ModelMetadata(self, request, context):
            return json_format.ParseDict({
                "name": MODEL, "versions": ["1"], "platform": "onnxruntime_onnx",
                "inputs": [{"name": "images", "datatype": "FP32", "shape": [-1, *image]}],
                "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, *shape]}
                            for name, shape in outputs.items()]}, pb.ModelMetadataResponse())

        async def ModelConfig(self, request, context):
            config = json_format.ParseDict({
                "name": MODEL, "platform": "onnxruntime_onnx", "max_batch_size": 64,
                "input": [{"name": "images", "data_type": "TYPE_FP32", "dims": image}],
                "output": [{"name": name, "data_type": "TYPE_FP32", "dims": shape} for name, shape in outputs.items()],
                "dynamic_batching": {}}, config_pb.ModelConfig())
            return pb.ModelConfigResponse(config=config)

        async def ModelStatistics(self, request, context):
            stats = {"name": MODEL, "version": "1", "inference_count": images_run,
                     "execution_count": 0 if backend is None else count,
                     "inference_stats": {"success": {"count": count}}}
            return json_format.ParseDict({"model_stats": [stats]}, pb.ModelStatisticsResponse())

        async def ModelInfer(self, request, context):
            nonlocal count, images_run
            tensor = request.inputs[0]
            images = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tensor.shape)  # (N, C, H, W)
            response = pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
            computed = None
            if backend is not None:
                computed = backend.run(images)
                images_run += len(images)
            for name, shape in outputs.items():
                response.outputs.add(name=name, datatype="FP32", shape=[len(images), *shape])
                response.raw_output_contents.append(answers[name] * len(images) if computed is None
                                                    else np.ascontiguousarray(computed[name], "<f4").tobytes())
            count += 1
            return response

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


# -- PyTriton: Triton's server, ONNX Runtime in its Python model ---------------------------------------------------

def pytriton(model_dir: Path, port: int, max_batch_size: int) -> None:
    import onnxruntime
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    # Triton's Python backend stub loads this interpreter's libpython: where a build keeps it outside the linker's
    # paths (pyenv), tell the server's processes
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))
    image, outputs = model_io(model_dir)
    session = onnxruntime.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs() if output.name in outputs]

    @batch
    def infer(images):
        return dict(zip(names, session.run(names, {"images": images})))

    config = TritonConfig(grpc_port=port, http_port=free_port(), metrics_port=free_port())
    # every endpoint open, as capsnet serve's are: perf_analyzer reads the statistics, which PyTriton guards by default
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        triton.bind(model_name=MODEL, infer_func=infer,
                    inputs=[Tensor(name="images", dtype=np.float32, shape=tuple(image))],
                    outputs=[Tensor(name=name, dtype=np.float32, shape=tuple(outputs[name])) for name in names],
                    config=ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher()))
        print("ready", flush=True)
        triton.serve()


# -- the load ------------------------------------------------------------------------------------------------------

def perf_analyzer(binary: Path, target: str, concurrency: int, seconds: float, scratch: Path) -> dict:
    """One cell: perf_analyzer's CSV (requests/s, p50, p99) over three windows of `seconds`, taken whatever their
    spread (on a shared machine its stability check would reject most cells)."""
    out = scratch / f"pa-{time.monotonic_ns()}.csv"
    command = [str(binary), "-m", MODEL, "-u", target, "-i", "grpc", "-b", "1", "--concurrency-range",
               str(concurrency), "--input-data", "zero", "--measurement-interval", str(int(seconds * 1000)),
               "--max-trials", "3", "--stability-percentage", "1000", "-f", str(out)]
    site = next(binary.resolve().parent.parent.glob("lib/python3*/site-packages"), None)
    env = dict(os.environ)
    if site is not None and (runtime := site / "nvidia/cuda_runtime/lib").is_dir():  # linked, not used, on a CPU
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(runtime), env.get("LD_LIBRARY_PATH")]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120 + 20 * seconds)
    if result.returncode != 0 or not out.exists():
        return {"error": (result.stdout + result.stderr)[-600:]}
    row = next(csv.DictReader(out.read_text().splitlines()))
    return {"requests_per_s": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3}


def loadgen(target: str, concurrency: int, seconds: float, image: list[int]) -> dict:
    from capsnet.serving.loadgen import random_images, run_load

    result = asyncio.run(run_load(target, random_images(64, tuple(image)), concurrency=concurrency,
                                  max_requests=10 ** 7, max_seconds=seconds, warmup_seconds=1.0, api="kserve",
                                  model_name=MODEL, input_name="images")).summary()
    return {key: result[key] for key in ("requests_per_s", "p50_ms", "p99_ms", "errors")}


def create_engine(model_dir: Path, engine: str, gpu: int | None):
    """capsnet's backend `engine` (BACKEND:PRECISION) on the export, as `capsnet serve` creates it."""
    from capsnet.serving.artifacts import load_artifacts
    from capsnet.serving.backends import create_backend
    from capsnet.serving.config import ServerConfig

    name, precision = engine.split(":")
    config = ServerConfig(model_dir=model_dir, backend=name, precision=precision, gpu=gpu)
    return create_backend(name, precision, load_artifacts(model_dir), config)


def engine_in_process(model_dir: Path, seconds: float, engine: str, gpu: int | None) -> dict:
    """The backend called directly (numpy in, numpy out): its p50 ms at batch 1, and the CPU time it takes per image
    (this process's, its threads') at the batch sizes a server forms."""
    backend = create_engine(model_dir, engine, gpu)
    image, _ = model_io(model_dir)
    report: dict = {"cpu_ms_per_image": {}}
    for size in BATCH_SIZES:
        images = np.zeros((size, *image), np.float32)
        backend.run(images)
        times: list[float] = []
        cpu = time.process_time()
        end = time.monotonic() + seconds
        while time.monotonic() < end or len(times) < 20:
            started = time.perf_counter()
            backend.run(images)
            times.append(time.perf_counter() - started)
        report["cpu_ms_per_image"][size] = (time.process_time() - cpu) * 1e3 / (size * len(times))
        if size == 1:
            report["p50_ms"] = statistics.median(times) * 1e3
    return report


def backend_cpu_ms(engine: dict, mean_batch: float) -> float:
    """The backend's CPU time per image at the measured batch size nearest `mean_batch`."""
    nearest = min(engine["cpu_ms_per_image"], key=lambda size: abs(int(size) - mean_batch))
    return engine["cpu_ms_per_image"][nearest]


# -- the run -------------------------------------------------------------------------------------------------------

def servers(args, model_dir: Path, workers: int) -> list[tuple[str, list[str], int | None]]:
    here = str(Path(__file__).resolve())
    port = free_port()
    name, precision = args.engine.split(":")
    device = [] if args.gpu is None else ["--gpu", str(args.gpu)]
    capsnet = [sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), "--backend", name, "--precision",
               precision, *device,
               "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", "--no-allow-client-shm",
               "--max-batch-size", str(args.max_batch_size)]
    engine_port = free_port()
    chosen = [("floor", [sys.executable, here, "--floor", str(port), "--model-dir", str(model_dir)], port),
              ("floor+engine", [sys.executable, here, "--floor", str(engine_port), "--model-dir", str(model_dir),
                                "--floor-engine", args.engine, *device], engine_port),
              ("capsnet-1", [*capsnet, "--workers", "1"], None),
              (f"capsnet-{workers}", [*capsnet, "--workers", str(workers)], None)]
    if args.pytriton_python and args.gpu is None:
        triton_port = free_port()
        chosen.append(("pytriton", [args.pytriton_python, here, "--pytriton", str(triton_port), "--model-dir",
                                    str(model_dir), "--max-batch-size", str(args.max_batch_size)], triton_port))
    return [server for server in chosen if not args.servers or server[0] in args.servers]


def measure(args, model_dir: Path, scratch: Path) -> dict:
    workers = args.workers or max(2, len(os.sched_getaffinity(0)) // 2)
    image, _ = model_io(model_dir)
    engine = engine_in_process(model_dir, args.seconds, args.engine, args.gpu)
    report: dict = {"engine_p50_ms": engine["p50_ms"], "engine": engine, "servers": {}}
    for name, command, port in servers(args, model_dir, workers):
        try:
            served = Served(name, command, port)
        except SystemExit as err:
            report["servers"][name] = {"error": str(err)}
            continue
        cells = {}
        try:
            for concurrency in args.concurrency:
                cpu, before = served.cpu_seconds(), served.counts()
                if args.perf_analyzer:
                    cell = perf_analyzer(args.perf_analyzer, served.target, concurrency, args.seconds, scratch)
                else:
                    cell = loadgen(served.target, concurrency, args.seconds, image)
                spent = {part: value - cpu[part] for part, value in served.cpu_seconds().items()}
                done, images, runs = (after - first for after, first in zip(served.counts(), before))
                cell["server_cpu_ms_per_request"] = spent["total"] * 1e3 / done if done else None
                if done:
                    cell["cpu_ms_per_request_by_thread"] = {part: value * 1e3 / done for part, value in spent.items()}
                if runs and done and name != "floor":  # the rest, once the backend's own CPU time is taken away
                    cell["mean_batch"] = images / runs
                    cell["request_path_cpu_ms"] = spent["total"] * 1e3 / done - backend_cpu_ms(engine, images / runs)
                cells[concurrency] = cell
                print(name, concurrency, cell, flush=True)
        finally:
            served.stop()
        report["servers"][name] = {"command": shlex.join(command), "cells": cells}
    return report


def markdown(report: dict) -> list[str]:
    engine = report["engine"]
    lines = ["# One-image KServe gRPC requests: the floor, capsnet serve, Triton", "",
             f"`{report['command']}`", "",
             f"Measured {report['when']} on {report['cpu']} ({report['cores']} cores; load average before "
             f"{', '.join(f'{x:.2f}' for x in report['load_before'])}, after "
             f"{', '.join(f'{x:.2f}' for x in report['load_after'])}). The machine was shared with other work while "
             "it ran, and the load generator shares its cores with the servers: compare figures within this run "
             "only.", "",
             f"Load: {report['load_by']}, 1-image requests; model: the `{report['preset']}` preset; capsnet's engine: "
             f"{report['engine_spec']}{report['device']}. The engine in process (called directly): p50 "
             f"**{engine['p50_ms']:.3f} ms** at batch 1; CPU "
             "time per image " + ", ".join(f"{value:.3f} ms at batch {size}"
                                           for size, value in engine["cpu_ms_per_image"].items()) + ".", "",
             "Server CPU: user + system time of the server's whole process tree over the cell, over the requests its "
             "statistics counted; of it, the processes' main threads (a Python server's event loop: its request "
             "path, and capsnet's batches that run on the loop) and gRPC's core threads (the rest: backend threads, "
             "Triton's own); and, behind N front ends, capsnet's engine process, which every request crosses: its "
             "CPU time a request bounds the requests/s that more front ends can reach. Less the backend's: minus "
             "the engine's in-process CPU time per image at the batch size nearest the server's mean batch (the cost "
             "of the request path itself).", "",
             "| server | concurrency | requests/s | p50 ms | p99 ms | server CPU ms/request | of it: main threads / "
             "gRPC's threads / engine process | mean batch | less the backend's CPU ms/request |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, server in report["servers"].items():
        if "error" in server:
            lines.append(f"| {name} | not run: {server['error']} | | | | | | | |")
            continue
        for level, cell in server["cells"].items():
            if "error" in cell:
                error = cell["error"][-120:].replace("|", "/").replace("\n", " ")
                lines.append(f"| {name} | {level} | perf_analyzer failed: {error} | | | | | | |")
                continue
            cpu, path = cell.get("server_cpu_ms_per_request"), cell.get("request_path_cpu_ms")
            row = [name, str(level), f"{cell['requests_per_s']:,.0f}", f"{cell['p50_ms']:.3f}", f"{cell['p99_ms']:.3f}",
                   "" if cpu is None else f"{cpu:.3f}", _by_thread(cell.get("cpu_ms_per_request_by_thread")),
                   f"{cell['mean_batch']:.1f}" if "mean_batch" in cell else "",
                   "" if path is None else f"{path:.3f}"]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", *ratios(report), "", *targets(report)]
    return lines


def ratios(report: dict) -> list[str]:
    """Each server's CPU per request as a multiple of the floor's and of floor+engine's, level by level: the floor
    is what gRPC costs, floor+engine what gRPC and the model cost together, the least a Python server pays."""
    servers = report["servers"]
    bases = [servers.get(name, {}).get("cells", {}) for name in ("floor", "floor+engine")]
    levels = list(report["concurrency"])
    lines = ["Server CPU per request as a multiple of the floor's / of floor+engine's:", "",
             "| server | " + " | ".join(f"c{level}" for level in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, server in servers.items():
        if name == "floor" or "cells" not in server:
            continue
        row = [name]
        for level in levels:
            mine = server["cells"].get(str(level), server["cells"].get(level, {})).get("server_cpu_ms_per_request")
            parts = []
            for base in bases:
                theirs = base.get(str(level), base.get(level, {})).get("server_cpu_ms_per_request")
                parts.append(f"{mine / theirs:.2f}×" if mine and theirs else "–")
            row.append(" / ".join(parts))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _by_thread(parts: dict | None) -> str:
    if parts is None:
        return ""
    engine = parts.get("engine process")
    return (f"{parts['main thread']:.3f} / {parts['gRPC threads']:.3f} / "
            + (f"{engine:.3f}" if engine else "–"))


def targets(report: dict) -> list[str]:
    """The CPU targets: capsnet's server CPU per request against the floor's (≤ 1.5×; with and without the backend's
    own CPU time), c1 p50 against the engine's in-process time (≤ + 0.3 ms)."""
    servers = report["servers"]
    floor_cells = servers.get("floor", {}).get("cells", {})
    lines = ["| target | server | measured | met |", "|---|---|---|---|"]
    for name, server in servers.items():
        if not name.startswith("capsnet") or "cells" not in server:
            continue
        for level, cell in server["cells"].items():
            base = floor_cells.get(level, {}).get("server_cpu_ms_per_request")
            for what, mine in (("server CPU", cell.get("server_cpu_ms_per_request")),
                               ("server CPU less the backend's", cell.get("request_path_cpu_ms"))):
                if base and mine:
                    lines.append(f"| {what} per request ≤ 1.5× the floor's, c{level} | {name} | {mine:.3f} against "
                                 f"{base:.3f} ms ({mine / base:.2f}×) | {'yes' if mine <= 1.5 * base else '**no**'} |")
        c1 = server["cells"].get("1", server["cells"].get(1, {}))
        if "p50_ms" in c1:
            bound = report["engine_p50_ms"] + 0.3
            lines.append(f"| c1 p50 ≤ engine in process + 0.3 ms | {name} | {c1['p50_ms']:.3f} against "
                         f"{bound:.3f} ms | {'yes' if c1['p50_ms'] <= bound else '**no**'} |")
        if report["device"]:  # on a GPU host (a 16-core one in the targets): the fused engine's request rates
            c64 = server["cells"].get("64", server["cells"].get(64, {}))
            if "requests_per_s" in c64:
                rate = c64["requests_per_s"]
                lines.append(f"| ≥ 20,000 requests/s at c64 ({report['cores']} cores) | {name} | {rate:,.0f} | "
                             f"{'yes' if rate >= 20000 else '**no**'} |")
            if "p50_ms" in c1:
                lines.append(f"| c1 p50 ≤ 0.8 ms | {name} | {c1['p50_ms']:.3f} ms | "
                             f"{'yes' if c1['p50_ms'] <= 0.8 else '**no**'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement window")
    parser.add_argument("--workers", type=int, help="front ends of capsnet-N (default: one per 2 cores, at least 2)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--gpu", type=int, help="serve capsnet on this CUDA device")
    parser.add_argument("--engine", metavar="BACKEND:PRECISION",
                        help="capsnet's backend (default onnxruntime:fp32; with --gpu fused:fp16)")
    parser.add_argument("--perf-analyzer", type=Path, metavar="PATH", help="perf_analyzer's binary")
    parser.add_argument("--pytriton-python", metavar="PATH", help="a Python with nvidia-pytriton and onnxruntime")
    parser.add_argument("--model-dir", type=Path, help="an export folder (default: the preset, exported now)")
    parser.add_argument("--servers", nargs="+", metavar="NAME", help="only these servers (default: every one)")
    parser.add_argument("--floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--floor-engine", metavar="BACKEND:PRECISION", help=argparse.SUPPRESS)
    parser.add_argument("--pytriton", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.floor is not None:
        floor(args.model_dir, args.floor, args.floor_engine, args.gpu)
        return 0
    if args.pytriton is not None:
        pytriton(args.model_dir, args.pytriton, args.max_batch_size)
        return 0
    if not args.out:
        parser.error("--out is required")
    args.engine = args.engine or ("onnxruntime:fp32" if args.gpu is None else "fused:fp16")
    from measure_shared_memory import export  # the preset's seeded checkpoint, exported
    from serving_ab import cpu_kind

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or export(args.preset, Path(scratch))
        report = measure(args, model_dir, Path(scratch))
    report.update({
        "command": shlex.join(["python", "scripts/bench_front_end.py", *(argv or sys.argv[1:])]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_kind(),
        "cores": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg(),
        "preset": args.preset, "concurrency": args.concurrency, "engine_spec": args.engine,
        "device": "" if args.gpu is None else f" on CUDA device {args.gpu}",
        "load_by": "perf_analyzer (tritonclient 2.41.0's build)" if args.perf_analyzer
        else "serving/loadgen.py (tritonclient's asyncio client, in the benchmark's process)"})
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(markdown(report)) + "\n")
    print("\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
