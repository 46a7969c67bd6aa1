"""TensorRT engines from the exported ONNX graphs (needs a CUDA GPU and the tensorrt package).

TensorRT 11 builds strongly typed networks only and has no FP16/INT8 builder flags: the
precision comes from the graph itself, so fp16 engines are built from model.fp16.onnx and int8
engines from the Q/DQ nodes of model.int8.onnx. TensorRT 10 still has the weakly typed flags:
there fp16 is the fp32 graph with BuilderFlag.FP16, and int8 the Q/DQ graph with BuilderFlag.INT8.
Device buffers and the CUDA stream come from PyTorch, which the project depends on anyway.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig
from capsnet.export.onnx_export import INPUT_NAME

# Largest difference from ONNX Runtime running the same graph, and the least share of images
# with the same predicted class, per engine precision.
PARITY_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": 5e-2}
MIN_ARGMAX_AGREEMENT = {"fp32": 1.0, "fp16": 0.98, "int8": 0.98}


def tensorrt_unavailable() -> str | None:
    """Why no engine can be built on this machine, or None when it can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed (pip install 'capsnet-serve[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is available (torch.cuda.is_available() is False)"
    return None


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


def build_engine(onnx_path: Path, plan_path: Path, image_shape: tuple[int, int, int], config: EngineConfig) -> dict[str, Any]:
    """Build `plan_path` from `onnx_path`; returns the facts for model.plan.json."""
    import tensorrt as trt
    import torch

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

    major, minor = torch.cuda.get_device_capability()
    return {
        "tensorrt_version": trt.__version__,
        "gpu_name": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "precision": config.precision,
        "min_batch": config.min_batch,
        "opt_batch": config.opt_batch,
        "max_batch": config.max_batch,
    }


def engine_outputs(plan_path: Path, batches: list[np.ndarray], names: tuple[str, ...]) -> list[dict[str, np.ndarray]]:
    """Run the engine on each batch (float32, (N, C, H, W)); every graph keeps float32 I/O."""
    import tensorrt as trt
    import torch

    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise CapsNetError(f"TensorRT could not load the engine it just built ({plan_path.name})")
    for name in (INPUT_NAME, *names):
        if engine.get_tensor_dtype(name) != trt.float32:
            raise CapsNetError(f"the engine's {name!r} is {engine.get_tensor_dtype(name)}, expected float32")
    context = engine.create_execution_context()
    stream = torch.cuda.current_stream()  # the stream the input copies below are queued on
    results = []
    for batch in batches:
        images = torch.from_numpy(batch).cuda()  # (N, C, H, W)
        context.set_input_shape(INPUT_NAME, tuple(images.shape))
        context.set_tensor_address(INPUT_NAME, images.data_ptr())
        outputs = {}
        for name in names:
            outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=torch.float32, device="cuda")
            context.set_tensor_address(name, outputs[name].data_ptr())
        if not context.execute_async_v3(stream.cuda_stream):
            raise CapsNetError("TensorRT failed to run the engine")
        stream.synchronize()
        results.append({name: tensor.cpu().numpy() for name, tensor in outputs.items()})
    return results
