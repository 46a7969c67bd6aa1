"""The engines `capsnet bench` and the GPU check time: every row of the server's backend registry
(serving/backend_registry.py) at each precision it serves, plus the public PyTorch CapsNet baseline (the analysis',
capsnet/bench/analysis/public_reference.py).

Each loads from an export directory (docs/artifacts.md) through the server's backend factory and
becomes a function images (N, C, H, W) float32 -> probabilities (N, J). Heavy imports stay inside
the loaders, so a benchmark worker imports only what its backend needs (an ONNX Runtime worker
never imports torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from capsnet.errors import CapsNetError, first_line
from capsnet.serving.backend_registry import BACKEND_KINDS

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Engine:
    """A registry row at one of its precisions, by the name the bench's tables and `--backends` give it."""

    name: str
    kind: str  # a name of BACKEND_KINDS
    precision: str


def bench_name(kind: str, precision: str) -> str:
    """<kind>-<precision>; the torch rows keep the names results have carried since the start ("pytorch" for fp32)."""
    if kind == "torch":
        return "pytorch" if precision == "fp32" else f"pytorch-{precision}"
    return f"{kind}-{precision}"


ENGINES: dict[str, Engine] = {
    engine.name: engine for engine in (Engine(bench_name(kind.name, precision), kind.name, precision)
                                       for kind in BACKEND_KINDS.values() for precision in kind.precisions)}
PUBLIC_REFERENCE = "pytorch-public"  # analysis/public_reference.py: the most-used public PyTorch CapsNet's formulation
# A run without --backends: the CPU's engines, the public baseline and TensorRT where a GPU allows; the registry's
# GPU engines (fused, aoti, the torch backend's fp16) on request
DEFAULT_BACKENDS = ("pytorch", "pytorch-bf16", PUBLIC_REFERENCE, "onnxruntime-fp32", "onnxruntime-int8",
                    "tensorrt-fp32", "tensorrt-fp16", "tensorrt-int8")
# every name --backends takes, in the order of tables and plots
BACKEND_NAMES = (*DEFAULT_BACKENDS, *(name for name in ENGINES if name not in DEFAULT_BACKENDS))


class BackendUnavailable(Exception):
    """The backend cannot run here (no artifact for it, no GPU): it is skipped with this reason."""


def load_backend(name: str, model_dir: str, threads: int,
                 max_batch_size: int) -> tuple[Callable[[np.ndarray], np.ndarray], str]:
    """(images -> probabilities, description of what runs) for backend `name` on the model in `model_dir`."""
    from capsnet.serving.artifacts import load_artifacts

    artifacts = load_artifacts(model_dir)
    if name == PUBLIC_REFERENCE:  # the analysis' (the bench extra); a run without it never asks for it
        from capsnet.bench.analysis.public_reference import load_reference_backend

        try:
            return load_reference_backend(artifacts.checkpoint, threads)
        except CapsNetError as err:  # a routing variant the public code does not have
            raise BackendUnavailable(str(err)) from None
    engine = ENGINES[name]
    if engine.kind == "onnxruntime" and engine.precision not in artifacts.onnx:
        raise BackendUnavailable(f"{model_dir} has no {engine.precision} ONNX model (export with --{engine.precision})")
    if engine.precision == "bf16":
        from capsnet.serving.backends.torch_backend import bf16_unavailable_reason

        if reason := bf16_unavailable_reason():
            raise BackendUnavailable(reason)
    if engine.kind == "tensorrt":
        from capsnet.runtime.tensorrt_runner import unavailable_reason

        reason = unavailable_reason() or (None if artifacts.tensorrt_plan else f"{model_dir} has no TensorRT plan")
        if reason:
            raise BackendUnavailable(reason)
    from capsnet.serving.backends import create_backend
    from capsnet.serving.config import ServerConfig

    try:
        config = ServerConfig(model_dir=Path(model_dir), backend=engine.kind, precision=engine.precision,
                              threads=threads, max_batch_size=max_batch_size)
        backend = create_backend(engine.kind, engine.precision, artifacts, config)
    except CapsNetError as err:  # the row's own refusal here: a GPU-only kind or precision, a package not exported
        raise BackendUnavailable(first_line(err)) from None
    return (lambda images: backend.run(images)["probabilities"]), backend.description
