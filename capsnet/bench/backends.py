"""The backends `capsnet bench` times in-process: the server's own, plus the public PyTorch CapsNet baseline (the
analysis', capsnet/bench/analysis/public_reference.py).

Each loads from an export directory (docs/artifacts.md) through the server's backend factory and
becomes a function images (N, C, H, W) float32 -> probabilities (N, J). Heavy imports stay inside
the loaders, so a benchmark worker imports only what its backend needs (an ONNX Runtime worker
never imports torch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from capsnet.errors import CapsNetError

if TYPE_CHECKING:
    import numpy as np

# bench name -> (server backend, precision); pytorch-public is ours alone.
SERVER_BACKENDS = {
    "pytorch": ("torch", "fp32"),  # our model, eager, as the server's torch backend runs it
    "pytorch-bf16": ("torch", "bf16"),  # the same with its convolutions in bf16, where the CPU has native bf16
    "onnxruntime-fp32": ("onnxruntime", "fp32"),
    "onnxruntime-int8": ("onnxruntime", "int8"),
    "tensorrt-fp32": ("tensorrt", "fp32"),
    "tensorrt-fp16": ("tensorrt", "fp16"),
    "tensorrt-int8": ("tensorrt", "int8"),
}
PUBLIC_REFERENCE = "pytorch-public"  # analysis/public_reference.py: the most-used public PyTorch CapsNet's formulation
BACKEND_NAMES = ("pytorch", "pytorch-bf16", PUBLIC_REFERENCE, "onnxruntime-fp32", "onnxruntime-int8",
                 "tensorrt-fp32", "tensorrt-fp16", "tensorrt-int8")  # the order of tables and plots


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
    server_backend, precision = SERVER_BACKENDS[name]
    if server_backend == "onnxruntime" and precision not in artifacts.onnx:
        raise BackendUnavailable(f"{model_dir} has no {precision} ONNX model (export with --{precision})")
    if precision == "bf16":
        from capsnet.serving.backends.torch_backend import bf16_unavailable_reason

        if reason := bf16_unavailable_reason():
            raise BackendUnavailable(reason)
    if server_backend == "tensorrt":
        from capsnet.runtime.tensorrt_runner import unavailable_reason

        reason = unavailable_reason() or (None if artifacts.tensorrt_plan else f"{model_dir} has no TensorRT plan")
        if reason:
            raise BackendUnavailable(reason)
    from capsnet.serving.backends import create_backend
    from capsnet.serving.config import ServerConfig

    config = ServerConfig(model_dir=Path(model_dir), backend=server_backend, precision=precision, threads=threads,
                          max_batch_size=max_batch_size)
    backend = create_backend(server_backend, precision, artifacts, config)
    return (lambda images: backend.run(images)["probabilities"]), backend.description
