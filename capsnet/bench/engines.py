"""The engines every benchmark times in process, built one way and named by the backend registry's own names.

An engine is a row of the server's backend registry at one precision it serves, "<kind>:<precision>"
("onnxruntime:int8", "torch:bf16"), made as `capsnet serve` makes it; or a reference timed beside them
(capsnet.bench.results.REFERENCES): the public formulation (capsnet/bench/analysis/public_reference.py), and the model
eager or under torch.compile at torch's own defaults. `capsnet bench` builds each in a worker process of its own
(capsnet.bench.worker), the GPU check all of them in one (capsnet.bench.harness), and the front-end benchmark times one
with engine_figures and serves one behind its bare gRPC floor (scripts/front_end_servers.py).

The registry is read through engine_names and served_here only, so a row added to it is benchmarked without an edit
here. Heavy imports stay inside the builders: an ONNX Runtime engine never imports torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from capsnet.bench.results import COMPILE, EAGER, PUBLIC, REFERENCES, measurement
from capsnet.bench.timing import summarize, time_calls
from capsnet.errors import CapsNetError, first_line


def _kinds():
    from capsnet.serving.engine.backend_registry import BACKEND_KINDS

    return BACKEND_KINDS.values()


def engine_names() -> tuple[str, ...]:
    """Every served engine: each registry row at each precision it serves, in the registry's order."""
    return tuple(f"{kind.name}:{precision}" for kind in _kinds() for precision in kind.precisions)


def served_here(gpu: bool) -> tuple[str, ...]:
    """The served engines a benchmark runs by default: each row at the precisions it serves on the CPU, and on a host
    with a GPU also the rows that serve on a GPU only (the CPU rows' GPU precisions are the GPU check's)."""
    return tuple(f"{kind.name}:{precision}" for kind in _kinds()
                 for precision in (kind.cpu_precisions or (kind.precisions if gpu else ())))


def split(name: str) -> tuple[str, str]:
    """("onnxruntime", "int8") of "onnxruntime:int8"."""
    kind, _, precision = name.partition(":")
    return kind, precision


def order(name: str) -> int:
    """Where `name` goes in tables: the references first, then the registry's order."""
    names = (*REFERENCES, *engine_names())
    return names.index(name) if name in names else len(names)


def ordered(names: Iterable[str]) -> list[str]:
    return sorted(names, key=order)


def precisions() -> tuple[str, ...]:
    """Every precision some engine serves, in the registry's order."""
    return tuple(dict.fromkeys(split(name)[1] for name in engine_names()))


def fastest(figures: dict[tuple[str, int], dict], precision: str, batch: int) -> str | None:
    """The served engine at `precision` with the most images/s at `batch`, of (engine, batch) -> figures
    (capsnet.bench.results.cells); None where none was measured."""
    timed = [(cell["images_per_s"], name) for (name, size), cell in figures.items()
             if size == batch and ":" in name and split(name)[1] == precision]
    return max(timed)[1] if timed else None


class EngineUnavailable(Exception):
    """The engine cannot run here (no artifact for it, no GPU, a model it does not compute): skipped with this
    reason."""


@dataclass(frozen=True)
class Engine:
    name: str
    description: str  # what runs
    run: Callable[[np.ndarray], dict]  # numpy (N, C, H, W) float32 -> outputs by name, numpy
    # device tensor (N, C, H, W) -> outputs left on the device; None where the engine takes numpy only
    on_device: Callable | None = None
    self_check: dict | None = None  # {"passed", "describe"} where asked for
    threads: int | None = None  # the compute threads a served engine was made with (None: a reference's, torch's own)


def build_engine(name: str, model_dir: Path, *, threads: int, max_batch: int, gpu: int | None = None,
                 check: bool = False) -> Engine:
    """Engine `name` on the export in `model_dir`, on CUDA device `gpu` or the CPU, with `threads` compute threads (0:
    the server's default; torch's for a reference); self-checked first where `check`. EngineUnavailable with the
    reason where it cannot run here."""
    try:
        if name in REFERENCES:
            return _reference(name, Path(model_dir), threads, gpu)
        if name not in engine_names():
            raise EngineUnavailable(f"no engine {name}: choose from {', '.join((*REFERENCES, *engine_names()))}")
        return _served(name, Path(model_dir), threads, max_batch, gpu, check)
    except CapsNetError as err:  # the row's own refusal here: a GPU-only precision, a package not exported
        raise EngineUnavailable(first_line(err)) from None


def _served(name: str, model_dir: Path, threads: int, max_batch: int, gpu: int | None, check: bool) -> Engine:
    from capsnet.serving.config import ServerConfig
    from capsnet.serving.engine.artifacts import load_artifacts
    from capsnet.serving.engine.backends import create_backend, every_core  # before self_check, imported by them

    kind, precision = split(name)
    artifacts = load_artifacts(model_dir)
    config = ServerConfig(model_dir=model_dir, backend=kind, precision=precision, gpu=gpu, threads=threads,
                          max_batch_size=max_batch)
    backend = create_backend(kind, precision, artifacts, config)
    if (widened := every_core(backend, artifacts, config)) is not None:  # as the server serves it
        backend.close()
        config = replace(config, threads=widened[0])
        backend = create_backend(kind, precision, artifacts, config)
    result = None
    if check:
        from capsnet.serving.engine.self_check import self_check

        passed = self_check(backend, artifacts.reference, max_batch, artifacts)
        result = {"passed": passed.passed, "describe": passed.describe()}
    runner = getattr(backend, "runner", None)  # the torch family's: eager, fused and package forwards
    return Engine(name, backend.description, backend.run, runner.run_on_device if runner else None, result,
                  config.intra_op_threads)


def _reference(name: str, model_dir: Path, threads: int, gpu: int | None) -> Engine:
    """The public formulation, the model eager, or the model compiled, at torch's own defaults."""
    import torch

    from capsnet.bench.analysis.public_reference import DESCRIBED_IN, SOURCE, PublicCapsNet
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.serving.engine.artifacts import load_artifacts

    device = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    model = load_checkpoint(load_artifacts(model_dir).checkpoint).build_model().to(device).eval()
    where = f"on {device}" + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else "")
    if name == PUBLIC:
        public = PublicCapsNet(model).to(device).eval()  # CapsNetError for a routing the public code lacks

        def forward(images):
            probabilities, poses, reconstruction = public(images)
            return {"probabilities": probabilities, "poses": poses, "reconstruction": reconstruction}

        description = f"{SOURCE}'s formulation ({DESCRIBED_IN}), eager, torch's defaults, {where}"
    elif name == EAGER:
        def forward(images):
            output = model(images)
            return {"probabilities": output.probabilities, "poses": output.poses,
                    "reconstruction": output.reconstruction}

        description = f"capsnet/models/capsnet.py's CapsNet, eager, torch's defaults, {where}"
    else:
        assert name == COMPILE
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        # each batch size is a compile of its own
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        autocast = device.type == "cuda"

        def forward(images):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                output = compiled(images)
            # reduce-overhead replays a CUDA graph whose outputs the next replay overwrites: cloned, as a caller
            # keeps them
            return {"probabilities": output.probabilities.clone(), "poses": output.poses.clone(),
                    "reconstruction": output.reconstruction.clone()}

        description = ("capsnet/models/capsnet.py's CapsNet under torch.compile(mode='reduce-overhead')"
                       + (", bf16 autocast throughout" if autocast else "") + f", {where}")

    def on_device(images):
        with torch.inference_mode():
            return forward(images)

    def with_numpy(images: np.ndarray) -> dict:
        with torch.inference_mode():
            outputs = forward(torch.from_numpy(images).to(device))
            return {output: value.float().cpu().numpy() for output, value in outputs.items()}

    return Engine(name, description, with_numpy, on_device)


WARMUP_CALLS = 3
MIN_CALLS = 20


def engine_figures(model_dir: Path, name: str, batches: Iterable[int], seconds: float, *, threads: int = 0,
                   gpu: int | None = None) -> list[dict]:
    """Engine `name` timed in this process, numpy in and out, at each of `batches` for `seconds` (at least MIN_CALLS
    calls) after WARMUP_CALLS: one measurement each (capsnet.bench.results), its figures the latency summary, the
    CPU time this process spent per image (the engine's threads included) and the engine's compute threads. `threads`
    0: the server's default (every_core's choice included)."""
    batches = tuple(batches)
    engine = build_engine(name, model_dir, threads=threads, max_batch=max(batches), gpu=gpu)
    from capsnet.model_description.schema import ModelDescription

    shape = ModelDescription.read(model_dir).input_shape
    rows = []
    for batch in batches:
        images = np.zeros((batch, *shape), np.float32)  # (N, C, H, W)
        for _ in range(WARMUP_CALLS):
            engine.run(images)
        cpu = time.process_time()
        durations = time_calls(functools.partial(engine.run, images), min_calls=MIN_CALLS, min_seconds=seconds)
        cpu_ms = (time.process_time() - cpu) * 1e3 / (batch * len(durations))
        rows.append(measurement(name, batch, {**summarize(durations, batch), "cpu_ms_per_image": cpu_ms,
                                              "threads": engine.threads}))
    return rows
