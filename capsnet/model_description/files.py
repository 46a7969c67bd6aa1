"""The files an export writes into a model directory, by name, and how they are read: SHA-256 digests (model.json
lists one for every file) and model.plan.json, what a TensorRT engine was built for."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from capsnet.errors import CapsNetError

SIDECAR_NAME = "model.json"
CHECKPOINT_NAME = "model.ckpt"
ONNX_NAME = "model.onnx"
ONNX_INT8_NAME = "model.int8.onnx"
ONNX_FP16_NAME = "model.fp16.onnx"
PLAN_NAME = "model.plan"
PLAN_INFO_NAME = "model.plan.json"
REFERENCE_NAME = "reference.npz"  # self-check images and their FP32 outputs
# model.plan.json: what the engine was built for (TensorRT rejects a plan from another GPU or version)
PLAN_INFO_KEYS = ("tensorrt_version", "gpu_name", "compute_capability", "precision", "min_batch", "opt_batch",
                  "max_batch")
# AOTInductor packages: one per device kind and precision; CPU ones are fp32, CUDA ones fp32, fp16 or bf16
AOTI_DEVICES = ("cpu", "cuda")
AOTI_PRECISIONS = {"cpu": ("fp32",), "cuda": ("fp32", "fp16", "bf16")}


def aoti_name(device: str, precision: str) -> str:
    return f"model.{device}.{precision}.pt2"


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:  # unreadable (permissions), a directory, an I/O error
        raise CapsNetError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:
        # ValueError: bad UTF-8, bad JSON, an integer of over 4,300 digits; RecursionError: nesting too deep
        raise CapsNetError(f"{path} is damaged: not valid JSON ({str(err)[:200]})") from None


def read_plan_info(path: Path) -> dict:
    """model.plan.json (a resolved path): the GPU and TensorRT version the engine was built for."""
    info = read_json(path)
    missing = [key for key in PLAN_INFO_KEYS if not isinstance(info, dict) or key not in info]
    if missing:
        raise CapsNetError(f"{path} is damaged: missing {', '.join(missing)}")
    # the server compares and counts with these before TensorRT sees the plan
    batches = [info[key] for key in ("min_batch", "opt_batch", "max_batch")]
    if (not all(isinstance(info[key], str) for key in ("tensorrt_version", "gpu_name"))
            or not isinstance(info["compute_capability"], (str, int, float))
            or info["precision"] not in ("fp32", "fp16", "int8")
            or not all(type(batch) is int for batch in batches) or not 1 <= batches[0] <= batches[1] <= batches[2]):
        raise CapsNetError(f"{path} is damaged: expected tensorrt_version and gpu_name strings, compute_capability "
                           "like \"9.0\", precision fp32|fp16|int8 and integers 1 <= min_batch <= opt_batch "
                           "<= max_batch")
    return info

