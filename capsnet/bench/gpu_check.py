"""The GPU check's steps (scripts/gpu_check.sh runs each once, under its own time limit).

    python -m capsnet.bench.gpu_check STEP --work DIR [--cpu-dry-run] [options]

facts      the GPU, driver, torch and CUDA versions, the CPU and its load
peak       the same-run matmul peaks (bf16, fp16, fp32 without TF32) and pinned copy bandwidth
flops      FLOPs per image from the ONNX graph and the bytes one image moves each way
engines    capsnet/bench/harness.py: the public formulation, the model eager and under torch.compile, and the
           backend registry's engines ("<kind>:<precision>", capsnet/bench/engines.py) as served, device-resident and
           numpy in and out, with a profiler table of each
serve      `capsnet serve --backend auto` on the GPU, driven over gRPC and REST (KServe v2, raw FP32) by the project's
           load generator: 1 and 32 images per request, concurrency 1/16/64, in several client processes

Each step writes DIR/parts/<step>[-<label>].json; scripts/gpu_check_report.py merges them into the report. With
--cpu-dry-run every step runs on the CPU at small sizes, so the whole script is walked on a machine without a GPU;
its figures are the CPU's and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GPU_BATCHES = (1, 32, 256, 1024)
DRY_BATCHES = (1, 32)
SERVED_BATCHES = (1, 32)  # images per request
SERVED_CONCURRENCY = (1, 16, 64)
CLIENTS_PER_CELL = 4  # load-generator processes for concurrency >= 16: one asyncio client process tops out first
SERVE_MAX_BATCH = 256
REPO = Path(__file__).resolve().parents[2]  # the checkout (the GPU check imports it through a tree of links)


def device_of(dry_run: bool):
    import torch

    return torch.device("cpu") if dry_run else torch.device("cuda", 0)


def write_part(work: Path, name: str, values: dict) -> None:
    parts = work / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (parts / f"{name}.json").write_text(json.dumps(values, indent=1, default=str) + "\n")


# --- facts and peaks ------------------------------------------------------------------------------------------------


def facts(args) -> dict:
    import torch

    from capsnet.bench.machine import load_average
    from capsnet.runtime.cpu import CpuKind

    values = {"dry_run": args.cpu_dry_run, "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
              "python": platform.python_version(), "cpu": CpuKind.this_host().describe(),
              "cores": len(os.sched_getaffinity(0)), "load_average": load_average(), "versions": _versions()}
    if not args.cpu_dry_run:
        props = torch.cuda.get_device_properties(0)
        values.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                      gpu_memory_gib=round(props.total_memory / 2**30, 1), driver=_nvidia_smi("driver_version"))
    return values


def _versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for name in ("numpy", "onnx", "onnxruntime", "grpcio", "grpcio-health-checking", "protobuf", "aiohttp", "triton"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _nvidia_smi(field: str) -> str | None:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def peak(args) -> dict:
    from capsnet.bench.harness import device_peaks

    return device_peaks(device_of(args.cpu_dry_run))


# --- served ---------------------------------------------------------------------------------------------------------


def serve(args) -> dict:
    from capsnet.bench.results import portable
    from capsnet.bench.server_process import ServerProcess
    from capsnet.client.api import CapsNetClient

    flags = ["--model", args.model, "--backend", args.backend, "--max-batch-size", str(SERVE_MAX_BATCH),
             "--threads", str(args.threads)]
    if not args.cpu_dry_run:
        flags += ["--gpu", "0"]
    started = time.monotonic()
    cells: list[dict] = []
    result: dict[str, object] = {"flags": [portable(flag, REPO) for flag in flags]}
    with ServerProcess(flags) as server:
        result["startup_s"] = time.monotonic() - started
        with CapsNetClient(server.target) as client:
            info = client.model_info()
        result["served"] = {"backend": info.backend, "precision": info.precision, "choice": info.choice,
                            "self_check": info.self_check.passed}
        write_part(Path(args.work), "serve", {**result, "cells": cells})
        for api in ("kserve", "kserve-http"):
            target = server.target if api == "kserve" else server.rest_target
            assert target is not None  # the server was started with REST (--http-port 0)
            for batch in SERVED_BATCHES:
                for concurrency in args.concurrency:
                    before = server.scrape()
                    cell = _load_cell(target, api, batch, concurrency, args, info.name, info.input_name)
                    after = server.scrape()
                    runs = after.get("capsnet_batch_size_count", 0) - before.get("capsnet_batch_size_count", 0)
                    images = after.get("capsnet_batch_size_sum", 0) - before.get("capsnet_batch_size_sum", 0)
                    cell["mean_batch"] = images / runs if runs else None
                    cells.append(cell)
                    write_part(Path(args.work), "serve", {**result, "cells": cells})  # partial results survive a kill
        result["server_memory_mib"] = server.memory()
    return {**result, "cells": cells}


def _load_cell(target: str, api: str, batch: int, concurrency: int, args, model: str, input_name: str) -> dict:
    """One closed-loop run of `concurrency` clients for `args.window` seconds, spread over up to CLIENTS_PER_CELL
    processes, each sending images of the size the model in `args.model` takes."""
    seconds = args.window
    processes = 1 if concurrency < 16 else CLIENTS_PER_CELL
    shares = [concurrency // processes + (index < concurrency % processes) for index in range(processes)]
    clients = [subprocess.Popen([sys.executable, "-m", "capsnet.bench.gpu_check", "load", "--target", target,
                                 "--api", api, "--batch", str(batch), "--concurrency", str(share),
                                 "--window", str(seconds), "--model", args.model, "--model-name", model,
                                 "--input-name", input_name],
                                stdout=subprocess.PIPE, text=True) for share in shares]
    outputs = [json.loads(client.communicate(timeout=seconds + 60)[0]) for client in clients]
    latencies = np.concatenate([np.asarray(out["latencies_s"]) for out in outputs]) if outputs else np.array([])
    elapsed = max(out["elapsed_s"] for out in outputs)
    errors: dict[str, int] = {}
    for out in outputs:
        for code, count in out["errors"].items():
            errors[code] = errors.get(code, 0) + count
    return {"api": "grpc" if api == "kserve" else "rest", "images_per_request": batch, "concurrency": concurrency,
            "client_processes": processes, "requests": int(latencies.size), "errors": errors,
            "images_per_s": latencies.size * batch / elapsed,
            "p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies.size else None,
            "p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies.size else None}


def load(args) -> None:
    """One load-generator process: prints its latencies as JSON."""
    from capsnet.bench.harness import input_shape
    from capsnet.bench.loadgen import random_images, run_load

    images = random_images(256, input_shape(Path(args.model)), seed=2)
    result = asyncio.run(run_load(args.target, images, concurrency=args.concurrency[0], batch_size=args.batch,
                                  max_requests=10**9, max_seconds=args.window, warmup_requests=10, api=args.api,
                                  model_name=args.model_name, input_name=args.input_name))
    print(json.dumps({"latencies_s": result.latencies_s, "elapsed_s": result.elapsed_s, "errors": result.errors}))


def flops(args) -> dict:
    """FLOPs per image from the ONNX graph, and the bytes one image moves each way."""
    from capsnet.bench.analysis.flops import count_flops
    from capsnet.model_description.schema import ModelDescription

    description = ModelDescription.read(args.model)
    rows = 4 * sum(int(np.prod(shape)) for shape in description.output_shapes.values())
    return {"flops_per_image": count_flops(Path(args.model) / "model.onnx").total,
            "bytes_in_per_image": 4 * int(np.prod(description.input_shape)), "bytes_out_per_image": rows}


def engines(args) -> dict:
    from capsnet.bench.harness import engines as run_engines

    return run_engines(args, device_of(args.cpu_dry_run), functools.partial(write_part, Path(args.work), "engines"))


STEPS = {"facts": facts, "peak": peak, "engines": engines, "serve": serve, "flops": flops}


def main(argv: list[str] | None = None) -> int:
    from capsnet.bench.engines import engine_names, precisions, split
    from capsnet.bench.results import REFERENCES

    kinds = list(dict.fromkeys(split(name)[0] for name in engine_names()))
    parser = argparse.ArgumentParser(prog="python -m capsnet.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "load"))
    parser.add_argument("--work", help="the check's working folder (parts/ and steps.jsonl)")
    parser.add_argument("--label", default="", help="a name for this run of the step (e.g. engines-aoti)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run on the CPU at small sizes")
    parser.add_argument("--model", help="export directory")
    parser.add_argument("--references", nargs="*", choices=REFERENCES, default=list(REFERENCES),
                        help="engines: the references timed beside the served engines")
    parser.add_argument("--kinds", nargs="*", choices=kinds, default=kinds,
                        help=f"engines: the backend registry's rows to time (default all: {' '.join(kinds)})")
    parser.add_argument("--precisions", nargs="*", choices=precisions(), default=list(precisions()),
                        help="engines: the precisions to time each row at, where it serves them (default all)")
    parser.add_argument("--batches", nargs="+", type=int, help="engines: batch sizes")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="engines: no profiler tables")
    parser.add_argument("--threads", type=int, default=4, help="CPU threads for torch and the server's backend")
    parser.add_argument("--backend", default="auto", help="serve: --backend")
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(SERVED_CONCURRENCY))
    parser.add_argument("--window", type=float, default=2.5, help="serve/load: seconds per cell")
    parser.add_argument("--target", help="load: HOST:PORT")
    parser.add_argument("--api", help="load: kserve or kserve-http")
    parser.add_argument("--batch", type=int, help="load: images per request")
    parser.add_argument("--model-name", help="load: KServe model name")
    parser.add_argument("--input-name", help="load: KServe input name")
    args = parser.parse_args(argv)
    if args.step == "load":
        load(args)
        return 0
    if args.batches is None:
        args.batches = list(DRY_BATCHES if args.cpu_dry_run else GPU_BATCHES)
    values = STEPS[args.step](args)
    write_part(Path(args.work), f"{args.step}{'-' + args.label if args.label else ''}", values)
    print(json.dumps(values, default=str)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
