"""A Triton Inference Server model repository: REPO/<name>/config.pbtxt and REPO/<name>/1/model.*.

config.pbtxt is protobuf text format of Triton's model_config.proto (ModelConfig). Shapes there
exclude the batch axis, which Triton adds itself up to max_batch_size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from capsnet.export.config import TritonConfig
from capsnet.model_description.classes import class_names_parameters
from capsnet.model_description.schema import ModelDescription

CONFIG_NAME = "config.pbtxt"
MODEL_VERSION_DIR = "1"
# platform and the file name Triton's backend looks for
PLATFORMS = {"onnx": ("onnxruntime_onnx", "model.onnx"), "plan": ("tensorrt_plan", "model.plan")}
TRITON_DATATYPES = {"FP32": "TYPE_FP32"}


def _tensor_entry(name: str, datatype: str, dims: list[int]) -> str:
    return (f'  {{\n    name: "{name}"\n    data_type: {TRITON_DATATYPES[datatype]}\n'
            f'    dims: [ {", ".join(map(str, dims))} ]\n  }}')


def config_pbtxt(description: ModelDescription, model_format: str, config: TritonConfig) -> str:
    platform, _ = PLATFORMS[model_format]
    inputs = [_tensor_entry(description.input_name, "FP32", description.input_dims)]
    outputs = [_tensor_entry(name, "FP32", list(shape)) for name, shape in description.output_shapes.items()]
    preferred = sorted({size for size in config.preferred_batch_sizes if size <= config.max_batch_size})
    lines = [
        f'name: "{description.name}"',
        f'platform: "{platform}"',
        f"max_batch_size: {config.max_batch_size}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + ",\n".join(outputs) + "\n]",
        "dynamic_batching {\n"
        f"  preferred_batch_size: [ {', '.join(map(str, preferred))} ]\n"
        f"  max_queue_delay_microseconds: {config.max_queue_delay_us}\n"
        "}",
    ]
    for key, value in class_names_parameters(description.class_names).items():
        text = value["string_value"].replace("\\", "\\\\").replace('"', '\\"')  # a protobuf text-format string
        lines.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{text}" }}\n}}')
    if model_format == "plan":
        lines.append("instance_group [\n  {\n    kind: KIND_GPU\n    count: 1\n  }\n]")  # engines run on GPUs only
    return "\n".join(lines) + "\n"


def write_model_directory(model_dir: Path, description: ModelDescription, model_file: Path, model_format: str,
                          config: TritonConfig) -> None:
    """Fill `model_dir` (REPO/<name>) with config.pbtxt and version 1 of the model."""
    _, file_name = PLATFORMS[model_format]
    version_dir = model_dir / MODEL_VERSION_DIR
    version_dir.mkdir(parents=True)
    shutil.copyfile(model_file, version_dir / file_name)
    (model_dir / CONFIG_NAME).write_text(config_pbtxt(description, model_format, config))
