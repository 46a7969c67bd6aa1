"""The GPU check's engines step: every way of running the model on one device, timed side by side in one process.

    references                  the public formulation (XifengGuo/CapsNet-Pytorch's forward pass), the model eager,
                                and the model under torch.compile(mode="reduce-overhead") with bf16 autocast
                                throughout: what a PyTorch user would deploy
    served engines              "<kind>:<precision>": every row of the server's backend registry asked for, at each
                                precision it serves, built as every benchmark builds it (capsnet.bench.engines) and
                                self-checked first; a row that cannot serve on this device says why in its own line

Each at every batch size (torch.compile at 1 and 256: each size is a compile of its own), two ways: device-resident
(images already on the device, outputs left there: the engine's own time, from CUDA events on a GPU) and numpy in
and out (the host copies included: what a server pays). The images take the model's input size from its model.json.
p50 of a fixed number of calls after warm-up calls, one measurement each (capsnet.bench.results). Then where each
engine's time goes: a torch.profiler table of
its kernels at batches 1 and 256, and its device time split into the fused routing kernels', the convolutions', the
copies' and the rest. Every ratio comes from this one process on this one device; the GPU check
(capsnet/bench/gpu_check.py) runs it as its `engines` step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from capsnet.bench.engines import Engine, EngineUnavailable, build_engine, engine_names, split
from capsnet.bench.results import COMPILE, NUMPY, ON_DEVICE, PUBLIC, REFERENCES, cells, measurement
from capsnet.bench.timing import summarize
from capsnet.errors import first_line

PROFILED_BATCHES = (1, 256)
# torch.compile compiles each batch size anew (a minute or more on an H200 host's 16 cores for all four): it is
# timed at the sizes its target is stated for
COMPILED_BATCHES = (1, 256)
CALLS = {"small": 30, "large": 15, "dry": 3}  # timed calls per cell: batches up to 256, larger; the CPU dry run
WARMUP_CALLS = 3


def served_engines(kinds: list[str] | tuple[str, ...], precisions: list[str] | tuple[str, ...]) -> list[str]:
    """The registry's engines of `kinds` at each of `precisions` they serve, in the registry's order."""
    return [name for name in engine_names() if split(name)[0] in kinds and split(name)[1] in precisions]


def input_shape(model_dir: Path) -> tuple[int, int, int]:
    """(C, H, W) of the images the exported model takes, from its model.json."""
    from capsnet.model_description.schema import ModelDescription

    return ModelDescription.read(model_dir).input_shape


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_cells(engine: Engine, images: np.ndarray, device, batches: tuple[int, ...], dry_run: bool) -> list[dict]:
    """Numpy in and out at each batch, and device-resident where the engine takes device tensors."""
    import torch

    rows = []
    resident = torch.from_numpy(images).to(device)
    for batch in batches:
        if engine.name == COMPILE and batch not in COMPILED_BATCHES and max(batches) >= max(COMPILED_BATCHES):
            continue
        calls = CALLS["dry" if dry_run else "small" if batch <= 256 else "large"]
        for _ in range(WARMUP_CALLS):
            engine.run(images[:batch])
            if engine.on_device is not None:
                engine.on_device(resident[:batch])
        _synchronize(device)
        if engine.on_device is not None:
            device_seconds = [seconds_on(device, functools.partial(engine.on_device, resident[:batch]))
                              for _ in range(calls)]
            rows.append(measurement(engine.name, batch, summarize(device_seconds, batch), ON_DEVICE))
        numpy_seconds = []
        for _ in range(calls):
            began = time.perf_counter()
            engine.run(images[:batch])
            numpy_seconds.append(time.perf_counter() - began)
        rows.append(measurement(engine.name, batch, summarize(numpy_seconds, batch), NUMPY))
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


def _profile(engine: Engine, images: np.ndarray, device, batch: int) -> tuple[str, dict[str, float]]:
    """torch.profiler's kernel table for PROFILED_CALLS device-resident calls at `batch`, by each kernel's own
    device time, and that time split by what the kernels do (device_time_split)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    resident = torch.from_numpy(images[:batch]).to(device)
    assert engine.on_device is not None  # profiled only where it takes device tensors
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

    from capsnet.bench.loadgen import random_images

    torch.set_num_threads(args.threads)
    batches = tuple(args.batches)
    images = random_images(max(batches), input_shape(Path(args.model)), seed=1)
    if args.profile and device.type == "cuda":
        _start_the_profiler(device)
    loaded, failed = [], {}
    for name in (*args.references, *served_engines(args.kinds, args.precisions)):
        try:
            loaded.append(build_engine(name, Path(args.model), threads=args.threads, max_batch=max(batches),
                                       gpu=None if args.cpu_dry_run else device.index or 0, check=True))
        except EngineUnavailable as err:
            failed[name] = str(err)
        except Exception as err:  # one engine that cannot load costs its own row only
            failed[name] = f"{type(err).__name__}: {first_line(err)}"
    measurements: list[dict] = []
    profiles: dict[str, dict[str, str]] = {}
    splits: dict[str, dict[str, dict[str, float]]] = {}
    part = {"device": str(device), "threads": args.threads, "failed": failed,
            "engines": {engine.name: {"description": engine.description, "self_check": engine.self_check}
                        for engine in loaded},
            "measurements": measurements, "profiles": profiles, "device_time_split": splits}
    for engine in loaded:
        try:
            measurements += _time_cells(engine, images, device, batches, args.cpu_dry_run)
        except Exception as err:
            failed[engine.name] = f"{type(err).__name__}: {first_line(err)}"
    # the timings are kept before any profiling: CUPTI has taken a process down under graph replays
    save(part)
    for engine in loaded if args.profile else ():
        if engine.on_device is None:
            continue
        try:
            for batch in (b for b in PROFILED_BATCHES if b <= max(batches)):
                table, by_kind = _profile(engine, images, device, batch)
                profiles.setdefault(engine.name, {})[str(batch)] = table
                if any(by_kind.values()):
                    splits.setdefault(engine.name, {})[str(batch)] = by_kind
        except Exception as err:
            failed[f"{engine.name} profile"] = f"{type(err).__name__}: {first_line(err)}"
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return part


def ratios(part: dict) -> dict:
    """The targets' ratios from one engines part: the fastest served engine (numpy in and out) against the public
    formulation at batches 1 and 256, and against torch.compile at 256; and device-resident alike."""
    found = {}
    for way in (NUMPY, ON_DEVICE):
        figures = cells(part.get("measurements", []), way)
        for batch in (1, 256):
            ours = [(cell["p50_ms"], name) for (name, size), cell in figures.items()
                    if size == batch and name not in REFERENCES]
            if not ours:
                continue
            best_ms, best = min(ours)
            entry = {"best": best, "best_p50_ms": best_ms, "images_per_s": batch / best_ms * 1e3}
            for reference in (PUBLIC, COMPILE):
                if (reference, batch) in figures:
                    entry[f"vs_{reference}"] = figures[reference, batch]["p50_ms"] / best_ms
            found[f"{way}_batch_{batch}"] = entry
    return found
