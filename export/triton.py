"""A Triton Inference Server model repository: REPO/<name>/config.pbtxt and REPO/<name>/1/model.*.

config.pbtxt is protobuf text format of Triton's model_config.proto (ModelConfig). Shapes there
exclude the batch axis, which Triton adds itself up to max_batch_size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from capsnet.export.config import TritonConfig
from capsnet.model_description.classes import class_names_parameters
from capsnet.model_description.decoder import DecoderDescription
from capsnet.model_description.schema import ModelDescription

CONFIG_NAME = "config.pbtxt"
MODEL_VERSION_DIR = "1"
# platform and the file name Triton's backend looks for
PLATFORMS = {"onnx": ("onnxruntime_onnx", "model.onnx"), "plan": ("tensorrt_plan", "model.plan")}
TRITON_DATATYPES = {"FP32": "TYPE_FP32", "INT64": "TYPE_INT64"}


def _tensor_entry(name: str, datatype: str, dims: list[int]) -> str:
    # Triton's dims may not be empty with max_batch_size > 0: a value per batch item is dims [1], reshaped to the
    # graph's (B,)
    shape = f'    dims: [ {", ".join(map(str, dims))} ]' if dims else "    dims: [ 1 ]\n    reshape: { shape: [ ] }"
    return f'  {{\n    name: "{name}"\n    data_type: {TRITON_DATATYPES[datatype]}\n{shape}\n  }}'


def config_pbtxt(description: ModelDescription, model_format: str, config: TritonConfig) -> str:
    inputs = [_tensor_entry(description.input_name, "FP32", description.input_dims)]
    outputs = [_tensor_entry(name, "FP32", list(shape)) for name, shape in description.output_shapes.items()]
    lines = _config_lines(description.name, model_format, inputs, outputs, config)
    parameters = class_names_parameters(description.class_names) if description.class_names else {}
    for key, value in parameters.items():
        text = value["string_value"].replace("\\", "\\\\").replace('"', '\\"')  # a protobuf text-format string
        lines.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{text}" }}\n}}')
    if model_format == "plan":
        lines.append("instance_group [\n  {\n    kind: KIND_GPU\n    count: 1\n  }\n]")  # engines run on GPUs only
    return "\n".join(lines) + "\n"


def _config_lines(name: str, model_format: str, inputs: list[str], outputs: list[str],
                  config: TritonConfig) -> list[str]:
    """What every model's config.pbtxt says: its name and platform, its tensors and its dynamic batching."""
    platform, _ = PLATFORMS[model_format]
    preferred = sorted({size for size in config.preferred_batch_sizes if size <= config.max_batch_size})
    lines = [
        f'name: "{name}"',
        f'platform: "{platform}"',
        f"max_batch_size: {config.max_batch_size}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + ",\n".join(outputs) + "\n]",
        "dynamic_batching {\n"
        f"  preferred_batch_size: [ {', '.join(map(str, preferred))} ]\n"
        f"  max_queue_delay_microseconds: {config.max_queue_delay_us}\n"
        "}",
    ]
    return lines


def write_model_directory(model_dir: Path, description: ModelDescription, model_file: Path, model_format: str,
                          config: TritonConfig) -> None:
    """Fill `model_dir` (REPO/<name>) with config.pbtxt and version 1 of the model."""
    _write(model_dir, model_file, model_format, config_pbtxt(description, model_format, config))


def write_decoder_directory(model_dir: Path, name: str, decoder: DecoderDescription, model_file: Path,
                            config: TritonConfig) -> None:
    """Fill `model_dir` (REPO/<name>) with the decoder alone: poses and a class index in, its reconstruction out."""
    inputs, outputs = decoder.tensors()
    # no class names: the decoder's output is no class
    lines = _config_lines(name, "onnx", [_tensor_entry(t["name"], t["datatype"], t["shape"]) for t in inputs],
                          [_tensor_entry(t["name"], t["datatype"], t["shape"]) for t in outputs], config)
    _write(model_dir, model_file, "onnx", "\n".join(lines) + "\n")


def _write(model_dir: Path, model_file: Path, model_format: str, config_text: str) -> None:
    _, file_name = PLATFORMS[model_format]
    version_dir = model_dir / MODEL_VERSION_DIR
    version_dir.mkdir(parents=True)
    shutil.copyfile(model_file, version_dir / file_name)
    (model_dir / CONFIG_NAME).write_text(config_text)
