"""The benchmark harness: every way of running the model on one device, timed side by side in one process.

    references                  the public formulation (XifengGuo/CapsNet-Pytorch's forward pass), the model eager,
                                and the model under torch.compile(mode="reduce-overhead") with bf16 autocast
                                throughout: what a PyTorch user would deploy
    served engines              kind × precision: every row of the server's backend registry
                                (serving/backend_registry.py) asked for, at each precision it serves, made as
                                `capsnet serve` makes it and self-checked first; a row that cannot serve on this
                                device says why in its own line

Each at every batch size (torch.compile at 1 and 256: each size is a compile of its own), two ways: device-resident
(images already on the device, outputs left there: the engine's own time, from CUDA events on a GPU) and numpy in
and out (the host copies included: what a server pays). The images take the model's input size from its model.json.
p50 of a fixed number of calls after warm-up calls. Then where each engine's time goes: a torch.profiler table of
its kernels at batches 1 and 256, and its device time split into the fused routing kernels', the convolutions', the
copies' and the rest. Every ratio comes from this one process on this one device; the GPU check
(capsnet/bench/gpu_check.py) runs it as its `engines` step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capsnet.bench.timing import summarize
from capsnet.errors import CapsNetError, first_line
from capsnet.serving.backend_registry import BACKEND_KINDS

PROFILED_BATCHES = (1, 256)
# torch.compile compiles each batch size anew (a minute or more on an H200 host's 16 cores for all four): it is
# timed at the sizes its target is stated for
COMPILED_BATCHES = (1, 256)
CALLS = {"small": 30, "large": 15, "dry": 3}  # timed calls per cell: batches up to 256, larger; the CPU dry run
WARMUP_CALLS = 3
REFERENCE_SPECS = ("public", "eager", "compile")


def served_specs(kinds: list[str] | tuple[str, ...], precisions: list[str] | tuple[str, ...]) -> list[str]:
    """"kind:precision" for each registry row of `kinds` at each of `precisions` it serves, in the registry's order."""
    return [f"{kind.name}:{precision}" for kind in BACKEND_KINDS.values() if kind.name in kinds
            for precision in kind.precisions if precision in precisions]


def input_shape(model_dir: Path) -> tuple[int, int, int]:
    """(C, H, W) of the images the exported model takes, from its model.json."""
    from capsnet.model_description.schema import ModelDescription

    return ModelDescription.read(model_dir).input_shape


@dataclass(frozen=True)
class TimedEngine:
    spec: str
    description: str
    on_device: Callable  # device tensor (N, C, H, W) -> outputs on the device
    with_numpy: Callable  # numpy (N, C, H, W) -> numpy outputs
    self_check: dict | None = None


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reference_engine(spec: str, model_dir: Path, device, batches: tuple[int, ...]) -> TimedEngine:
    """The public formulation, the model eager, or the model compiled, on `device` at torch's own defaults."""
    import torch

    from capsnet.bench.analysis.public_reference import DESCRIBED_IN, SOURCE, PublicCapsNet
    from capsnet.serving.artifacts import load_artifacts
    from capsnet.models.checkpoint import load_checkpoint

    model = load_checkpoint(load_artifacts(model_dir).checkpoint).build_model().to(device).eval()
    if spec == "public":
        public = PublicCapsNet(model).to(device).eval()

        def forward(images):
            probabilities, poses, reconstruction = public(images)
            return {"probabilities": probabilities, "poses": poses, "reconstruction": reconstruction}

        description = f"{SOURCE}'s formulation ({DESCRIBED_IN}), eager, torch's defaults"
    elif spec == "eager":
        def forward(images):
            output = model(images)
            return {"probabilities": output.probabilities, "poses": output.poses,
                    "reconstruction": output.reconstruction}

        description = "capsnet/models/capsnet.py's CapsNet, eager, torch's defaults"
    else:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(batches))
        autocast = device.type == "cuda"

        def forward(images):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                output = compiled(images)
            # reduce-overhead replays a CUDA graph whose outputs the next replay overwrites: cloned, as a caller
            # keeps them
            return {"probabilities": output.probabilities.clone(), "poses": output.poses.clone(),
                    "reconstruction": output.reconstruction.clone()}

        description = ("capsnet/models/capsnet.py's CapsNet under torch.compile(mode='reduce-overhead')"
                       + (", bf16 autocast throughout" if autocast else ""))

    def on_device(images):
        with torch.inference_mode():
            return forward(images)

    def with_numpy(images: np.ndarray) -> dict:
        with torch.inference_mode():
            outputs = forward(torch.from_numpy(images).to(device))
            return {name: value.float().cpu().numpy() for name, value in outputs.items()}

    return TimedEngine(spec, description, on_device, with_numpy)


def _served_engine(spec: str, model_dir: Path, dry_run: bool, max_batch: int, threads: int) -> TimedEngine:
    """A server backend ("torch:bf16", "fused:fp32", ...) as `capsnet serve` makes it, self-checked."""
    from capsnet.serving.artifacts import load_artifacts
    from capsnet.serving.backends import create_backend  # before self_check, which the backends package imports
    from capsnet.serving.config import ServerConfig
    from capsnet.serving.self_check import self_check

    name, precision = spec.split(":")
    artifacts = load_artifacts(model_dir)
    config = ServerConfig(model_dir=model_dir, backend=name, precision=precision, gpu=None if dry_run else 0,
                          threads=threads, max_batch_size=max_batch)
    backend = create_backend(name, precision, artifacts, config)
    runner = getattr(backend, "runner", None)  # the torch family's: eager, fused and package forwards
    if runner is None:
        backend.close()
        raise CapsNetError(f"the {name} backend takes numpy batches only: it has no device-resident run to time")
    check = self_check(backend, artifacts.reference, max_batch, artifacts)
    return TimedEngine(spec, backend.description, runner.run_on_device, backend.run,
                       {"passed": check.passed, "describe": check.describe()})


def _time_cells(engine: TimedEngine, images: np.ndarray, device, batches: tuple[int, ...], dry_run: bool) -> list[dict]:
    import torch

    rows = []
    resident = torch.from_numpy(images).to(device)
    for batch in batches:
        if engine.spec == "compile" and batch not in COMPILED_BATCHES and max(batches) >= max(COMPILED_BATCHES):
            continue
        calls = CALLS["dry" if dry_run else "small" if batch <= 256 else "large"]
        for _ in range(WARMUP_CALLS):
            engine.with_numpy(images[:batch])
            engine.on_device(resident[:batch])
        _synchronize(device)
        device_seconds = [seconds_on(device, functools.partial(engine.on_device, resident[:batch]))
                          for _ in range(calls)]
        numpy_seconds = []
        for _ in range(calls):
            began = time.perf_counter()
            engine.with_numpy(images[:batch])
            numpy_seconds.append(time.perf_counter() - began)
        rows.append({"engine": engine.spec, "batch_size": batch, "device_resident": summarize(device_seconds, batch),
                     "numpy": summarize(numpy_seconds, batch)})
    return rows


def seconds_on(device, fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes on `device`: between CUDA events on a GPU (the device's time, not the launch's),
    by the wall clock on the CPU."""
    import torch

    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


MATMUL_SIZE = {"cuda": 8192, "cpu": 512}
COPY_MIB = {"cuda": 256, "cpu": 64}


def device_peaks(device) -> dict[str, float]:
    """The same-run ceilings the engines are read against: matmul TFLOP/s per dtype and pinned copy GB/s."""
    import torch

    size = MATMUL_SIZE[device.type]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 peak is fp32's, as the fp32 backends run
    results: dict[str, float] = {"matmul_size": size}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        seconds = _median_seconds(device, functools.partial(torch.mm, a, b), repeats=20 if name != "fp32" else 5)
        results[f"matmul_{name}_tflops"] = 2 * size**3 / seconds / 1e12
    nbytes = COPY_MIB[device.type] * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results["copy_mib"] = COPY_MIB[device.type]
    results["h2d_gb_s"] = nbytes / _median_seconds(device, lambda: target.copy_(host, non_blocking=True), 10) / 1e9
    results["d2h_gb_s"] = nbytes / _median_seconds(device, lambda: host.copy_(target, non_blocking=True), 10) / 1e9
    return results


def _median_seconds(device, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` on `device`, after two warm-up calls."""
    for _ in range(2):
        fn()
    return float(np.median([seconds_on(device, fn) for _ in range(repeats)]))


def _start_the_profiler(device) -> None:
    """One empty profile before any engine captures its CUDA graphs: the CUDA graphs captured before CUPTI first
    started, replayed after a profile, hit an illegal memory access on an H200 (torch 2.11, CUDA 13.0)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):
        torch.ones(1, device=device).add_(1)
        _synchronize(device)


PROFILED_CALLS = 5
# cuDNN's and CUTLASS's convolution kernels by their names, with the layout changes cuDNN makes around them
CONVOLUTION_NAMES = ("conv", "cudnn", "fprop", "implicit_gemm", "xmma", "cutlass", "nhwc", "nchw")


def _profile(engine: TimedEngine, images: np.ndarray, device, batch: int) -> tuple[str, dict[str, float]]:
    """torch.profiler's kernel table for PROFILED_CALLS device-resident calls at `batch`, by each kernel's own
    device time, and that time split by what the kernels do (device_time_split)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    resident = torch.from_numpy(images[:batch]).to(device)
    engine.on_device(resident)
    _synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_CALLS):
            engine.on_device(resident)
        _synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    kernels = [(event.key, getattr(event, "self_device_time_total", 0.0)) for event in averages
               if event.device_type == torch.autograd.DeviceType.CUDA]
    table = averages.table(sort_by=sort_by, row_limit=12, max_name_column_width=60)
    return table, device_time_split(kernels, _fused_kernel_names(), PROFILED_CALLS)


def _fused_kernel_names() -> tuple[str, ...]:
    try:
        from capsnet.runtime.fused_routing import KERNEL_WORK
    except ImportError:  # no triton: no fused kernels to find
        return ()
    return tuple(KERNEL_WORK)


def device_time_split(kernels: list[tuple[str, float]], fused: tuple[str, ...], calls: int) -> dict[str, float]:
    """Milliseconds a call on the device, from (kernel name, µs over all calls): the fused routing kernels' own time
    apart from the convolutions', the copies and fills, and the rest."""
    split = dict.fromkeys(("fused_routing_ms", "convolutions_ms", "copies_ms", "other_ms"), 0.0)
    for name, microseconds in kernels:
        lowered = name.lower()
        if fused and name.startswith(fused):
            kind = "fused_routing_ms"
        elif lowered.startswith(("memcpy", "memset")):
            kind = "copies_ms"
        elif any(word in lowered for word in CONVOLUTION_NAMES):
            kind = "convolutions_ms"
        else:
            kind = "other_ms"
        split[kind] += microseconds / 1e3 / calls
    return split


def engines(args, device, save: Callable[[dict], None]) -> dict:
    """The step on `device`; `save(part)` keeps the timings before anything is profiled."""
    import torch

    from capsnet.serving.loadgen import random_images

    torch.set_num_threads(args.threads)
    batches = tuple(args.batches)
    images = random_images(max(batches), input_shape(Path(args.model)), seed=1)
    if args.profile and device.type == "cuda":
        _start_the_profiler(device)
    loaded, failed = [], {}
    for spec in (*args.references, *served_specs(args.kinds, args.precisions)):
        try:
            if spec in REFERENCE_SPECS:
                loaded.append(_reference_engine(spec, Path(args.model), device, batches))
            else:
                loaded.append(_served_engine(spec, Path(args.model), args.cpu_dry_run, max(batches), args.threads))
        except Exception as err:  # one engine that cannot load costs its own row only
            failed[spec] = f"{type(err).__name__}: {first_line(err)}"
    results: list[dict] = []
    profiles: dict[str, dict[str, str]] = {}
    splits: dict[str, dict[str, dict[str, float]]] = {}
    part = {"device": str(device), "threads": args.threads, "failed": failed,
            "engines": {engine.spec: {"description": engine.description, "self_check": engine.self_check}
                        for engine in loaded},
            "results": results, "profiles": profiles, "device_time_split": splits}
    for engine in loaded:
        try:
            results += _time_cells(engine, images, device, batches, args.cpu_dry_run)
        except Exception as err:
            failed[engine.spec] = f"{type(err).__name__}: {first_line(err)}"
    # the timings are kept before any profiling: CUPTI has taken a process down under graph replays
    save(part)
    for engine in loaded if args.profile else ():
        try:
            for batch in (b for b in PROFILED_BATCHES if b <= max(batches)):
                table, split = _profile(engine, images, device, batch)
                profiles.setdefault(engine.spec, {})[str(batch)] = table
                if any(split.values()):
                    splits.setdefault(engine.spec, {})[str(batch)] = split
        except Exception as err:
            failed[f"{engine.spec} profile"] = f"{type(err).__name__}: {first_line(err)}"
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return part


def ratios(part: dict) -> dict:
    """The targets' ratios from one engines part: the fastest served engine (numpy in and out) against the public
    formulation at batches 1 and 256, and against torch.compile at 256; and device-resident alike."""
    cells = {(row["engine"], row["batch_size"]): row for row in part.get("results", [])}
    served = {spec for spec, _ in cells if spec not in REFERENCE_SPECS}
    found = {}
    for way in ("numpy", "device_resident"):
        for batch in (1, 256):
            ours = [(cells[spec, batch][way]["p50_ms"], spec) for spec in served if (spec, batch) in cells]
            if not ours:
                continue
            best_ms, best = min(ours)
            entry = {"best": best, "best_p50_ms": best_ms, "images_per_s": batch / best_ms * 1e3}
            for reference in ("public", "compile"):
                if (reference, batch) in cells:
                    entry[f"vs_{reference}"] = cells[reference, batch][way]["p50_ms"] / best_ms
            found[f"{way}_batch_{batch}"] = entry
    return found
