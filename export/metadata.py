"""What the server needs to know about an exported model: the `model.json` sidecar and the same
facts inside every ONNX file's metadata_props (docs/artifacts.md is the contract).

In metadata_props each top-level sidecar key is one entry whose value is that key's JSON text,
so `json.loads` gives back exactly what the sidecar holds.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import onnx

from capsnet import __version__
from capsnet.export.onnx_export import INPUT_NAME, output_names
from capsnet.training.checkpoint import Checkpoint

SIDECAR_NAME = "model.json"
FORMAT_NAME = "capsnet-model"
FORMAT_VERSION = 1
MODEL_NAME = "capsnet"
MODEL_VERSION = "1"
CHECKPOINT_NAME = "model.ckpt"
ONNX_NAME = "model.onnx"
ONNX_INT8_NAME = "model.int8.onnx"
ONNX_FP16_NAME = "model.fp16.onnx"
PLAN_NAME = "model.plan"
PLAN_INFO_NAME = "model.plan.json"


def output_shapes(config, reconstruction: bool) -> dict[str, list[int]]:
    """Each output's shape without the batch axis."""
    shapes = {
        "probabilities": [config.num_classes],
        "poses": [config.num_classes, config.digit_caps_dim],
        "reconstruction": [config.input_size],
    }
    return {name: shapes[name] for name in output_names(reconstruction)}


def routing_description(config) -> dict[str, Any]:
    """The sidecar's `routing`: dynamic routing's variant and squash constant, or EM routing's λ."""
    if config.arch == "em":
        return {"variant": "em", "iterations": config.routing_iterations,
                "inverse_temperature": config.em_inverse_temperature}
    return {"variant": config.routing, "iterations": config.routing_iterations,
            "squash_constant": config.squash_constant}


def build_sidecar(
    checkpoint: Checkpoint,
    checkpoint_sha256: str,
    opset: int,
    reconstruction: bool,
    artifacts: dict[str, str | None],
    int8: dict[str, Any] | None,
    parity: dict[str, Any],
) -> dict[str, Any]:
    config = checkpoint.config
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": MODEL_NAME,
        "version": MODEL_VERSION,
        "exporter_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "opset": opset,
        "input": {
            "name": INPUT_NAME,
            "datatype": "FP32",
            "layout": "NCHW",
            "shape": [config.in_channels, config.height, config.width],
            "value_range": [0.0, 1.0],
        },
        "outputs": [
            {"name": name, "datatype": "FP32", "shape": shape}
            for name, shape in output_shapes(config, reconstruction).items()
        ],
        "class_names": list(checkpoint.class_names),
        "routing": routing_description(config),
        "checkpoint": {"file": CHECKPOINT_NAME, "sha256": checkpoint_sha256},
        "training_metrics": checkpoint.metrics,
        "artifacts": artifacts,
        "int8": int8,
        "parity": parity,
    }


def embed_metadata(model: onnx.ModelProto, sidecar: dict[str, Any]) -> None:
    """Replace the model's metadata_props with the sidecar's keys (values as JSON text)."""
    del model.metadata_props[:]
    for key, value in sidecar.items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    model.producer_name = "capsnet-serve"
    model.producer_version = __version__


def read_metadata(model: onnx.ModelProto) -> dict[str, Any]:
    """The sidecar facts embedded by `embed_metadata`."""
    return {prop.key: json.loads(prop.value) for prop in model.metadata_props}


def write_json(path: Path, values: dict[str, Any]) -> None:
    path.write_text(json.dumps(values, indent=2) + "\n")
