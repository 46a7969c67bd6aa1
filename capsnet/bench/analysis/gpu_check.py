"""The GPU check's steps (scripts/gpu_check.sh runs each once, under its own time limit).

    python -m capsnet.bench.analysis.gpu_check STEP --work DIR [--cpu-dry-run] [options]

facts      the GPU, driver, torch and CUDA versions, the CPU and its load
peak       the same-run matmul peaks (bf16, fp16, fp32 without TF32) and pinned copy bandwidth
inprocess  every GPU backend and precision at batch 1/32/256/1024 in this process, interleaved in rounds, beside the
           XifengGuo/CapsNet-Pytorch forward pass (capsnet/bench/analysis/public_reference.py) on the same GPU
engines    the public formulation, the model eager and under torch.compile, and every served engine, device-resident
           and numpy in and out, with a profiler table of each (gpu_engines.py)
serve      `capsnet serve --backend auto` on the GPU, driven over gRPC and REST (KServe v2, raw FP32) by the project's
           load generator: 1 and 32 images per request, concurrency 1/16/64, in several client processes
report     every part so far merged into OUT/gpu_check.json and OUT/gpu_check.md, with what did not run and why

Each step writes DIR/parts/<step>[-<label>].json. With --cpu-dry-run every step runs on the CPU at small sizes, so
the whole script is walked on a machine without a GPU; its figures are the CPU's and say so.
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

from capsnet.bench.timing import summarize

GPU_BATCHES = (1, 32, 256, 1024)
DRY_BATCHES = (1, 32)
SERVED_BATCHES = (1, 32)  # images per request
SERVED_CONCURRENCY = (1, 16, 64)
CLIENTS_PER_CELL = 4  # load-generator processes for concurrency >= 16: one asyncio client process tops out first
SERVE_MAX_BATCH = 256
MATMUL = {"gpu": 8192, "cpu": 512}
COPY_MIB = {"gpu": 256, "cpu": 64}


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
    """Matmul TFLOP/s per dtype and pinned copy GB/s, on the device of this run."""
    import torch

    device = device_of(args.cpu_dry_run)
    kind = device.type.replace("cuda", "gpu")
    size = MATMUL[kind]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 peak is fp32's, as the fp32 backends run
    results: dict[str, float] = {"matmul_size": size}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        seconds = _device_seconds(functools.partial(torch.mm, a, b), device, repeats=20 if name != "fp32" else 5)
        results[f"matmul_{name}_tflops"] = 2 * size**3 / seconds / 1e12
    nbytes = COPY_MIB[kind] * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results["copy_mib"] = COPY_MIB[kind]
    results["h2d_gb_s"] = nbytes / _device_seconds(lambda: target.copy_(host, non_blocking=True), device, 10) / 1e9
    results["d2h_gb_s"] = nbytes / _device_seconds(lambda: host.copy_(target, non_blocking=True), device, 10) / 1e9
    return results


def _device_seconds(fn, device, repeats: int) -> float:
    """Median seconds of `fn` on `device` (CUDA events on a GPU), after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return float(np.median(times))


# --- in-process -----------------------------------------------------------------------------------------------------


def load_spec(spec: str, model_dir: Path, dry_run: bool, max_batch: int, threads: int):
    """A backend of `spec` ("torch:fp32", "torch:fp32:eager", "aoti:bf16", "onnxruntime:fp32", "public:fp32"): a
    callable images -> outputs, its description, and its self-check (None for the public reference)."""
    from capsnet.serving.artifacts import load_artifacts
    from capsnet.serving.backends import create_backend  # before self_check, which the backends package imports
    from capsnet.serving.backends.base import Backend
    from capsnet.serving.self_check import self_check

    name, precision, *mode = spec.split(":")
    artifacts = load_artifacts(model_dir)
    gpu = None if dry_run else 0
    if name == "public":
        return (*_public_reference(artifacts, dry_run), None)
    if name == "torch":
        from capsnet.serving.backends.torch_backend import TorchBackend

        # on the CPU the buckets are walked too (the GPU's path, with eager runs in place of the graphs)
        backend: Backend = TorchBackend(artifacts, precision, threads, gpu, max_batch, buckets=mode != ["plain"],
                               graphs=mode != ["eager"])
    else:
        from capsnet.serving.config import ServerConfig

        config = ServerConfig(model_dir=model_dir, backend=name, precision=precision, gpu=gpu, threads=threads,
                              max_batch_size=max_batch)
        backend = create_backend(name, precision, artifacts, config)
    check = self_check(backend, artifacts.reference, max_batch, artifacts)
    return backend.run, backend.description, check


def _public_reference(artifacts, dry_run: bool):
    """XifengGuo/CapsNet-Pytorch's forward pass with our weights, numpy in and out like a backend (the copies to
    and from the device included)."""
    import torch

    from capsnet.bench.analysis.public_reference import DESCRIBED_IN, SOURCE, PublicCapsNet
    from capsnet.models.checkpoint import load_checkpoint

    device = device_of(dry_run)
    model = PublicCapsNet(load_checkpoint(artifacts.checkpoint).build_model()).to(device)

    def run(images: np.ndarray) -> dict:
        with torch.inference_mode():
            probabilities, poses, reconstruction = model(torch.from_numpy(images).to(device))
            return {"probabilities": probabilities.cpu().numpy(), "poses": poses.cpu().numpy(),
                    "reconstruction": reconstruction.cpu().numpy()}

    return run, f"{SOURCE}'s formulation, eager PyTorch ({DESCRIBED_IN}) on {device}"


def inprocess(args) -> dict:
    import torch

    from capsnet.errors import CapsNetError, first_line
    from capsnet.serving.loadgen import random_images

    torch.set_num_threads(args.threads)
    batches = tuple(args.batches)
    images = random_images(max(batches), (1, 28, 28), seed=1)
    backends, failed = {}, {}
    for spec in args.specs:
        try:
            run, description, check = load_spec(spec, Path(args.model), args.cpu_dry_run, max(batches), args.threads)
        except (CapsNetError, RuntimeError, ValueError) as err:
            failed[spec] = f"{type(err).__name__}: {first_line(err)}"
            continue
        backends[spec] = (run, description, check)
        for batch in batches:  # first runs allocate and pick kernels
            run(images[:batch])
    durations: dict[tuple[str, int], list[float]] = {(spec, batch): [] for spec in backends for batch in batches}
    chunk = args.seconds / args.rounds
    for _ in range(args.rounds):  # interleaved: drift in the machine's load lands on every backend alike
        for batch in batches:
            for spec, (run, _, _) in backends.items():
                began = time.perf_counter()
                while True:
                    started = time.perf_counter()
                    run(images[:batch])
                    durations[spec, batch].append(time.perf_counter() - started)
                    if time.perf_counter() - began >= chunk and len(durations[spec, batch]) >= 3:
                        break
    return {
        "device": str(device_of(args.cpu_dry_run)), "threads": args.threads, "seconds_per_cell": args.seconds,
        "rounds": args.rounds, "failed": failed,
        "backends": {spec: {"description": description,
                            "self_check": None if check is None else {"passed": check.passed,
                                                                      "describe": check.describe()}}
                     for spec, (_, description, check) in backends.items()},
        "results": [{"backend": spec, "batch_size": batch, **summarize(durations[spec, batch], batch)}
                    for spec in backends for batch in batches],
    }


# --- served ---------------------------------------------------------------------------------------------------------


def serve(args) -> dict:
    from capsnet.bench.server_process import ServerProcess
    from capsnet.serving.client import CapsNetClient

    flags = ["--model", args.model, "--backend", args.backend, "--max-batch-size", str(SERVE_MAX_BATCH),
             "--threads", str(args.threads)]
    if not args.cpu_dry_run:
        flags += ["--gpu", "0"]
    started = time.monotonic()
    cells: list[dict] = []
    result: dict[str, object] = {"flags": flags}
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
                    cell = _load_cell(target, api, batch, concurrency, args.window, info.name, info.input_name)
                    after = server.scrape()
                    runs = after.get("capsnet_batch_size_count", 0) - before.get("capsnet_batch_size_count", 0)
                    images = after.get("capsnet_batch_size_sum", 0) - before.get("capsnet_batch_size_sum", 0)
                    cell["mean_batch"] = images / runs if runs else None
                    cells.append(cell)
                    write_part(Path(args.work), "serve", {**result, "cells": cells})  # partial results survive a kill
        result["server_memory_mib"] = server.memory()
    return {**result, "cells": cells}


def _load_cell(target: str, api: str, batch: int, concurrency: int, seconds: float, model: str,
               input_name: str) -> dict:
    """One closed-loop run of `concurrency` clients, spread over up to CLIENTS_PER_CELL processes."""
    processes = 1 if concurrency < 16 else CLIENTS_PER_CELL
    shares = [concurrency // processes + (index < concurrency % processes) for index in range(processes)]
    clients = [subprocess.Popen([sys.executable, "-m", "capsnet.bench.analysis.gpu_check", "load", "--target", target,
                                 "--api", api, "--batch", str(batch), "--concurrency", str(share),
                                 "--window", str(seconds), "--model-name", model, "--input-name", input_name],
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
    from capsnet.serving.loadgen import random_images, run_load

    images = random_images(256, (1, 28, 28), seed=2)
    result = asyncio.run(run_load(args.target, images, concurrency=args.concurrency[0], batch_size=args.batch,
                                  max_requests=10**9, max_seconds=args.window, warmup_requests=10, api=args.api,
                                  model_name=args.model_name, input_name=args.input_name))
    print(json.dumps({"latencies_s": result.latencies_s, "elapsed_s": result.elapsed_s, "errors": result.errors}))


# --- report ---------------------------------------------------------------------------------------------------------

TARGETS = {"batch1_vs_public": 10.0, "batch256_vs_public": 10.0, "served_share": 0.5, "served_p50_ms": 2.0}


def report(args) -> None:
    work, out = Path(args.work), Path(args.out)
    parts = {path.stem: json.loads(path.read_text()) for path in sorted((work / "parts").glob("*.json"))}
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()] if (
        work / "steps.jsonl").is_file() else []
    summary = {"steps": steps, **parts}
    flops = parts.get("flops", {}).get("flops_per_image")
    summary["analysis"] = _analysis(parts, flops)
    if "engines" in parts:
        from capsnet.bench.analysis.gpu_engines import ratios

        summary["engine_ratios"] = ratios(parts["engines"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    try:
        markdown = _markdown(summary, parts)
        if "engines" in parts:
            from capsnet.bench.analysis.gpu_engines import markdown as engines_markdown

            markdown += engines_markdown(parts["engines"])
    except Exception as err:  # a part missing a field must not cost the report: the JSON has everything
        markdown = f"# GPU check\n\nthe table could not be written ({type(err).__name__}: {err}); see gpu_check.json\n"
    (out / "gpu_check.md").write_text(markdown)


def _cells(parts: dict) -> dict[tuple[str, int], dict]:
    """(backend spec, batch) -> result (numpy in and out), the later in-process step overriding the earlier for the
    same cell; the engines step's references (the public formulation, the model eager or compiled) are left out."""
    from capsnet.bench.analysis.gpu_engines import REFERENCE_SPECS

    cells = {}
    for name in sorted(parts):
        if name.startswith("inprocess"):
            for row in parts[name]["results"]:
                cells[row["backend"], row["batch_size"]] = {**row, "step": name}
        if name == "engines":
            for row in parts[name]["results"]:
                spec = "public:fp32" if row["engine"] == "public" else row["engine"]
                if spec not in REFERENCE_SPECS:
                    cells[spec, row["batch_size"]] = {"backend": spec, "batch_size": row["batch_size"],
                                                      **row["numpy"], "step": name}
    return cells


def _f(value, spec: str) -> str:
    """`value` formatted, or a dash for a figure that was not measured."""
    return "—" if value is None else format(value, spec)


def _analysis(parts: dict, flops: float | None) -> dict:
    cells = _cells(parts)
    peak, analysis = parts.get("peak", {}), {}
    ours = {key: row for key, row in cells.items() if not key[0].startswith("public")}
    for batch in sorted({batch for _, batch in cells}):
        public = cells.get(("public:fp32", batch))
        candidates = [row for (spec, b), row in ours.items() if b == batch]
        if not candidates:
            continue
        best = max(candidates, key=lambda row: row["images_per_s"])
        entry = {"best": best["backend"], "best_images_per_s": best["images_per_s"], "best_p50_ms": best["p50_ms"]}
        if public:
            entry["public_images_per_s"] = public["images_per_s"]
            entry["speedup_vs_public"] = best["images_per_s"] / public["images_per_s"]
        if flops and peak:
            precision = best["backend"].split(":")[1]
            tflops = peak.get(f"matmul_{precision}_tflops") or peak.get("matmul_fp32_tflops")
            entry["achieved_tflops"] = flops * best["images_per_s"] / 1e12
            entry["share_of_matmul_peak"] = entry["achieved_tflops"] / tflops if tflops else None
            moved = parts["flops"]["bytes_in_per_image"] / (peak["h2d_gb_s"] * 1e9) + \
                parts["flops"]["bytes_out_per_image"] / (peak["d2h_gb_s"] * 1e9)
            entry["share_of_copy_bound"] = moved * best["images_per_s"]
        analysis[f"batch_{batch}"] = entry
    served = parts.get("serve", {})
    if served.get("cells"):
        reference = cells.get((f"{served['served']['backend']}:{served['served']['precision']}", 32))
        for cell in served["cells"]:
            most = max(c["concurrency"] for c in served["cells"])
            if cell["images_per_request"] == 32 and cell["concurrency"] == most:
                if reference:
                    analysis[f"served_{cell['api']}_share_of_inprocess_batch32"] = \
                        cell["images_per_s"] / reference["images_per_s"]
            if cell["images_per_request"] == 1 and cell["concurrency"] == 1:
                analysis[f"served_{cell['api']}_one_image_p50_ms"] = cell["p50_ms"]
    return analysis


def _markdown(summary: dict, parts: dict) -> str:
    facts_ = parts.get("facts", {})
    dry = facts_.get("dry_run")
    lines = ["# GPU check" + (" — CPU DRY RUN (no GPU: every figure below is the CPU's)" if dry else ""), ""]
    if facts_:
        lines += [f"- device: {facts_.get('gpu', 'CPU only')} (compute capability {facts_.get('compute_capability')}, "
                  f"{facts_.get('gpu_memory_gib')} GiB), driver {facts_.get('driver')}" if not dry else
                  "- device: the CPU (dry run)",
                  f"- torch {facts_.get('torch')}, CUDA {facts_.get('cuda')}, cuDNN {facts_.get('cudnn')}, Python "
                  f"{facts_.get('python')}",
                  f"- CPU: {facts_.get('cpu')}, {facts_.get('cores')} cores, load average {facts_.get('load_average')}"]
    peak_ = parts.get("peak")
    if peak_:
        lines.append(f"- same-run peaks: matmul {peak_['matmul_size']}³ bf16 {peak_['matmul_bf16_tflops']:.1f}, fp16 "
                     f"{peak_['matmul_fp16_tflops']:.1f}, fp32 (no TF32) {peak_['matmul_fp32_tflops']:.1f} TFLOP/s; "
                     f"pinned copies H2D {peak_['h2d_gb_s']:.1f}, D2H {peak_['d2h_gb_s']:.1f} GB/s")
    lines += ["", "## Steps", "", "| step | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['limit']} |" for s in summary["steps"]]
    cells = _cells(parts)
    if cells:
        specs = list(dict.fromkeys(spec for spec, _ in cells))
        batches = sorted({batch for _, batch in cells})
        lines += ["", "## In process (numpy in, numpy out: copies to and from the device included)", "",
                  "p50 ms per batch / images per second", "",
                  "| backend | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for spec in specs:
            row = [f"{cells[spec, b]['p50_ms']:.3f} / {cells[spec, b]['images_per_s']:,.0f}" if (spec, b) in cells
                   else "—" for b in batches]
            lines.append(f"| {spec} | " + " | ".join(row) + " |")
        for name in sorted(p for p in parts if p.startswith("inprocess")):
            for spec, info in parts[name]["backends"].items():
                check = info["self_check"]
                verdict = "" if check is None else f" — self-check {'passed' if check['passed'] else 'FAILED'}: " \
                                                    f"{check['describe']}"
                lines.append(f"- {spec}: {info['description']}{verdict}")
            for spec, why in parts[name]["failed"].items():
                lines.append(f"- {spec}: did not load: {why}")
    served = parts.get("serve")
    if served:
        lines += ["", f"## Served ({served.get('served', {}).get('backend')} "
                      f"{served.get('served', {}).get('precision')}, --max-batch-size {SERVE_MAX_BATCH}; started in "
                      f"{served.get('startup_s', 0):.1f} s)", "",
                  f"auto's choice: {served.get('served', {}).get('choice')}", "",
                  "| API | images/request | concurrency | client processes | images/s | p50 ms | p99 ms | mean batch | "
                  "errors |", "|---|---|---|---|---|---|---|---|---|"]
        for c in served.get("cells", []):
            lines.append(f"| {c['api']} | {c['images_per_request']} | {c['concurrency']} | {c['client_processes']} | "
                         f"{_f(c['images_per_s'], ',.0f')} | {_f(c['p50_ms'], '.2f')} | {_f(c['p99_ms'], '.2f')} | "
                         f"{_f(c.get('mean_batch'), '.1f')} | {c['errors'] or ''} |")
    for name in ("aoti_export", "tests"):
        if name in parts:
            lines += ["", f"## {name}", "", "```", parts[name].get("tail", ""), "```"]
    analysis = summary["analysis"]
    if analysis:
        lines += ["", "## Targets", ""]
        for key, entry in analysis.items():
            if isinstance(entry, dict):
                text = (f"- {key}: best {entry['best']} {entry['best_images_per_s']:,.0f} images/s "
                        f"(p50 {entry['best_p50_ms']:.3f} ms)")
                if "speedup_vs_public" in entry:
                    target = {"batch_1": TARGETS["batch1_vs_public"],
                              "batch_256": TARGETS["batch256_vs_public"]}.get(key)
                    text += f", {entry['speedup_vs_public']:.1f}x the public forward pass"
                    if target:
                        text += f" (target {target:g}x: {'met' if entry['speedup_vs_public'] >= target else 'MISSED'})"
                if entry.get("share_of_matmul_peak") is not None:
                    text += (f"; {entry['achieved_tflops']:.2f} TFLOP/s = {entry['share_of_matmul_peak']:.1%} of the "
                             f"same-run matmul peak; copies {entry['share_of_copy_bound']:.1%} of the copy bound")
                lines.append(text)
            elif key.endswith("share_of_inprocess_batch32"):
                lines.append(f"- {key}: {entry:.0%} (target {TARGETS['served_share']:.0%}: "
                             f"{'met' if entry >= TARGETS['served_share'] else 'MISSED'})")
            elif key.endswith("p50_ms") and entry is not None and not isinstance(entry, dict):
                lines.append(f"- {key}: {entry:.2f} ms (target {TARGETS['served_p50_ms']:g} ms: "
                             f"{'met' if entry <= TARGETS['served_p50_ms'] else 'MISSED'})")
    return "\n".join(lines) + "\n"


def flops(args) -> dict:
    """FLOPs per image from the ONNX graph, and the bytes one image moves each way."""
    from capsnet.bench.analysis.flops import count_flops
    from capsnet.model_description.schema import ModelDescription

    description = ModelDescription.read(args.model)
    rows = 4 * sum(int(np.prod(shape)) for shape in description.output_shapes.values())
    return {"flops_per_image": count_flops(Path(args.model) / "model.onnx").total,
            "bytes_in_per_image": 4 * int(np.prod(description.input_shape)), "bytes_out_per_image": rows}


def engines(args) -> dict:
    from capsnet.bench.analysis.gpu_engines import engines as run_engines

    return run_engines(args, device_of(args.cpu_dry_run), functools.partial(write_part, Path(args.work), "engines"))


STEPS = {"facts": facts, "peak": peak, "inprocess": inprocess, "engines": engines, "serve": serve, "flops": flops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capsnet.bench.analysis.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "report", "load"))
    parser.add_argument("--work", help="the check's working folder (parts/ and steps.jsonl)")
    parser.add_argument("--out", help="report: the folder the JSON and markdown go to")
    parser.add_argument("--label", default="", help="a name for this run of the step (e.g. inprocess-aoti)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run on the CPU at small sizes")
    parser.add_argument("--model", help="export directory")
    parser.add_argument("--specs", nargs="+", default=[], help="inprocess: backend:precision[:eager|plain] specs")
    parser.add_argument("--batches", nargs="+", type=int, help="inprocess: batch sizes")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="engines: no profiler tables")
    parser.add_argument("--seconds", type=float, default=0.6, help="inprocess: timed seconds per cell")
    parser.add_argument("--rounds", type=int, default=3, help="inprocess: interleaved rounds")
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
    if args.step == "report":
        report(args)
        return 0
    if args.batches is None:
        args.batches = list(DRY_BATCHES if args.cpu_dry_run else GPU_BATCHES)
    values = STEPS[args.step](args)
    write_part(Path(args.work), f"{args.step}{'-' + args.label if args.label else ''}", values)
    print(json.dumps(values, default=str)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
