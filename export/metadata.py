"""The export's description of the model (capsnet/model_description/schema.py): written as `model.json`,
and the same facts inside every ONNX file's metadata_props.

In metadata_props each top-level key is one entry whose value is that key's JSON text, so
`json.loads` gives back exactly what model.json holds (less the file hashes: a file cannot hold its own).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import onnx

from capsnet.runtime.fused_support import gpu_engine
from capsnet import __version__
from capsnet.model_description.schema import POSES_NAME, PROBABILITIES_NAME, RECONSTRUCTION_NAME, ModelDescription
from capsnet.models.checkpoint import Checkpoint


def output_shapes(config, reconstruction: bool) -> dict[str, tuple[int, ...]]:
    """The outputs the graphs declare, each shape without the batch axis: the probabilities, a capsule network's
    poses (a CNN baseline has none: its only output is the probabilities), and the reconstruction if asked."""
    shapes: dict[str, tuple[int, ...]] = {PROBABILITIES_NAME: (config.num_classes,)}
    if config.has_capsules:
        shapes[POSES_NAME] = (config.num_classes, config.digit_caps_dim)
    if reconstruction:
        shapes[RECONSTRUCTION_NAME] = (config.input_size,)
    return shapes


def routing_description(config) -> dict[str, Any]:
    """The sidecar's `routing`: dynamic routing's variant and squash constant, EM routing's λ, or nothing for a
    model without routing."""
    if not config.has_capsules:
        return {}
    if config.arch == "em":
        return {"variant": "em", "iterations": config.routing_iterations,
                "inverse_temperature": config.em_inverse_temperature, "gpu_engine": gpu_engine(config)}
    return {"variant": config.routing, "iterations": config.routing_iterations,
            "squash_constant": config.squash_constant, "gpu_engine": gpu_engine(config)}


def describe(checkpoint: Checkpoint, opset: int, reconstruction: bool, **facts: Any) -> ModelDescription:
    """The description of an export of `checkpoint`; `facts` are the ModelDescription fields export measured
    (artifacts, reference_set, int8, fp16, parity); `sha256` is filled in once the files are final."""
    config = checkpoint.config
    return ModelDescription(
        input_shape=(config.in_channels, config.height, config.width),
        input_sizes=config.input_sizes,
        class_names=tuple(checkpoint.class_names),
        output_shapes=output_shapes(config, reconstruction),
        routing=routing_description(config),
        opset=opset,
        exporter_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        training_metrics=checkpoint.metrics,
        **facts,
    )


def embed_metadata(model: onnx.ModelProto, description: ModelDescription) -> None:
    """Replace the model's metadata_props with the description's keys (values as JSON text)."""
    del model.metadata_props[:]
    for key, value in description.to_json(with_hashes=False).items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    model.producer_name = "capsnet-serve"
    model.producer_version = __version__


def read_metadata(model: onnx.ModelProto) -> dict[str, Any]:
    """The description embedded by `embed_metadata`."""
    return {prop.key: json.loads(prop.value) for prop in model.metadata_props}
