"""TensorRT engines from the exported ONNX graphs (needs a CUDA GPU and the tensorrt package).

TensorRT 11 builds strongly typed networks only and has no FP16/INT8 builder flags: the
precision comes from the graph itself, so fp16 engines are built from model.fp16.onnx and int8
engines from the Q/DQ nodes of model.int8.onnx. TensorRT 10 still has the weakly typed flags:
there fp16 is the fp32 graph with BuilderFlag.FP16, and int8 the Q/DQ graph with BuilderFlag.INT8.
The engine is built on the configured GPU (--gpu) and checked with capsnet.runtime.tensorrt_runner, the
runner the server's tensorrt backend serves with. NOT RUN: TensorRT cannot be installed where this
project is developed and tested.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig
from capsnet.export.onnx_export import INPUT_NAME
from capsnet.runtime.tensorrt_runner import EngineRunner, gpu_facts

# Largest difference from ONNX Runtime running the same graph, and the least share of images
# with the same predicted class, per engine precision.
PARITY_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": 5e-2}
MIN_ARGMAX_AGREEMENT = {"fp32": 1.0, "fp16": 0.98, "int8": 0.98}


def tensorrt_major_version() -> int:
    import tensorrt as trt

    return int(trt.__version__.split(".")[0])


def source_variant(precision: str, major_version: int) -> str:
    """Which ONNX variant ("fp32", "fp16" or "int8") an engine of `precision` is built from."""
    if precision == "fp16" and major_version < 11:
        return "fp32"  # TensorRT 10 lowers the fp32 graph itself under BuilderFlag.FP16
    return precision


def _load_timing_cache(path: Path) -> bytes:
    try:
        return path.read_bytes() if path.is_file() else b""
    except OSError as err:
        raise CapsNetError(f"cannot read the TensorRT timing cache {path}: {err.strerror or err}") from None


def _save_timing_cache(path: Path, data: bytes) -> None:
    """Atomically, so concurrent builds never read a torn cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        raise CapsNetError(f"cannot write the TensorRT timing cache {path}: {err.strerror or err}") from None


def build_engine(onnx_path: Path, plan_path: Path, image_shape: tuple[int, int, int],
                 config: EngineConfig) -> dict[str, Any]:
    """Build `plan_path` from `onnx_path`; returns the facts for model.plan.json."""
    import tensorrt as trt

    gpu_name, capability = gpu_facts(config.gpu)  # also makes it the current device, which the builder uses
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise CapsNetError(f"TensorRT could not parse {onnx_path.name}: {errors}")

    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_mib << 20)
    if config.precision == "fp32":
        builder_config.clear_flag(trt.BuilderFlag.TF32)  # TF32 rounds fp32 inputs to 10-bit mantissas
    elif tensorrt_major_version() < 11:
        builder_config.set_flag(trt.BuilderFlag.FP16 if config.precision == "fp16" else trt.BuilderFlag.INT8)

    profile = builder.create_optimization_profile()
    profile.set_shape(
        INPUT_NAME,
        (config.min_batch, *image_shape),  # (min, C, H, W)
        (config.opt_batch, *image_shape),  # (opt, C, H, W)
        (config.max_batch, *image_shape),  # (max, C, H, W)
    )
    builder_config.add_optimization_profile(profile)

    cache_path = config.timing_cache_path
    timing_cache = builder_config.create_timing_cache(_load_timing_cache(cache_path))
    builder_config.set_timing_cache(timing_cache, ignore_mismatch=False)

    serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise CapsNetError(f"TensorRT could not build an engine from {onnx_path.name} (its log above says why)")
    plan_path.write_bytes(bytes(serialized))
    _save_timing_cache(cache_path, bytes(builder_config.get_timing_cache().serialize()))

    return {
        "tensorrt_version": trt.__version__,
        "gpu_name": gpu_name,
        "compute_capability": capability,
        "precision": config.precision,
        "min_batch": config.min_batch,
        "opt_batch": config.opt_batch,
        "max_batch": config.max_batch,
    }


def engine_outputs(plan_path: Path, batches: list[np.ndarray], names: tuple[str, ...], config: EngineConfig
                   ) -> list[dict[str, np.ndarray]]:
    """Run the engine on each batch (float32, (N, C, H, W)) as the server would; every graph keeps float32 I/O."""
    import tensorrt as trt

    with EngineRunner(plan_path.read_bytes(), INPUT_NAME, names, config.max_batch, config.gpu) as runner:
        for name in (INPUT_NAME, *names):
            if runner.engine.get_tensor_dtype(name) != trt.float32:
                raise CapsNetError(f"the engine's {name!r} is {runner.engine.get_tensor_dtype(name)}, expected float32")
        return [runner.run(batch) for batch in batches]
