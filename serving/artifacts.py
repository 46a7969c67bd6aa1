"""Reads an export directory (docs/artifacts.md) and checks it is whole before anything is loaded.

A missing or damaged directory is a CapsNetError at startup, naming the file and what is wrong, so
`capsnet serve` exits at once instead of failing on the first request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from capsnet.errors import CapsNetError

FORMAT_NAME = "capsnet-model"
FORMAT_VERSION = 1
# model.json "artifacts" key of the ONNX file for each precision
ONNX_KEYS = {"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8"}
PLAN_INFO_KEYS = ("tensorrt_version", "gpu_name", "compute_capability", "precision", "min_batch", "opt_batch", "max_batch")


@dataclass(frozen=True)
class ModelArtifacts:
    directory: Path
    name: str
    version: str
    input_name: str
    input_shape: tuple[int, int, int]  # (C, H, W)
    class_names: tuple[str, ...]
    pose_dim: int
    output_names: tuple[str, ...]
    routing: dict
    onnx: dict[str, Path]  # precision -> file, only those exported
    checkpoint: Path
    tensorrt_plan: Path | None
    tensorrt_info: dict | None  # model.plan.json


class _Reader:
    """Typed access to model.json fields, with errors that name the file and the key."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, message: str) -> CapsNetError:
        return CapsNetError(f"{self.path} is damaged: {message}")

    def get(self, table: dict, key: str, kind: type | tuple[type, ...], where: str = ""):
        if key not in table:
            raise self.fail(f"missing key {where}{key!r}")
        value = table[key]
        if not isinstance(value, kind):
            raise self.fail(f"{where}{key!r} has the wrong type ({type(value).__name__})")
        return value

    def file(self, directory: Path, name: str, what: str) -> Path:
        path = directory / name
        if not path.is_file():
            raise self.fail(f"it lists {what} {name!r}, which is missing from {directory}")
        return path


def load_artifacts(directory: str | Path) -> ModelArtifacts:
    directory = Path(directory)
    if not directory.is_dir():
        raise CapsNetError(f"model directory {directory} does not exist" if not directory.exists()
                           else f"model directory {directory} is not a directory")
    sidecar_path = directory / "model.json"
    if not sidecar_path.is_file():
        raise CapsNetError(f"{directory} is not a capsnet model directory (no model.json); make one with `capsnet export`")
    reader = _Reader(sidecar_path)
    try:
        sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise reader.fail(f"not valid JSON ({err})") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT_NAME:
        raise reader.fail(f"'format' is not {FORMAT_NAME!r}")
    if sidecar.get("format_version") != FORMAT_VERSION:
        raise CapsNetError(f"{sidecar_path} has format version {sidecar.get('format_version')!r}; "
                           f"this capsnet-serve reads version {FORMAT_VERSION}")

    model_input = reader.get(sidecar, "input", dict)
    input_shape = tuple(reader.get(model_input, "shape", list, "input."))
    if len(input_shape) != 3 or not all(isinstance(d, int) and d > 0 for d in input_shape):
        raise reader.fail(f"input.shape must be [C, H, W] of positive integers, got {list(input_shape)}")
    if model_input.get("datatype") != "FP32" or model_input.get("layout") != "NCHW":
        raise reader.fail("input must be FP32 NCHW")
    class_names = tuple(reader.get(sidecar, "class_names", list))
    if not class_names or not all(isinstance(n, str) for n in class_names):
        raise reader.fail("class_names must be a non-empty list of strings")

    outputs = {}
    for index, output in enumerate(reader.get(sidecar, "outputs", list)):
        if not isinstance(output, dict):
            raise reader.fail(f"outputs[{index}] is not an object")
        outputs[reader.get(output, "name", str, f"outputs[{index}].")] = reader.get(output, "shape", list, f"outputs[{index}].")
    classes = len(class_names)
    channels, height, width = input_shape
    poses_shape = outputs.get("poses")
    if outputs.get("probabilities") != [classes] or not (
            isinstance(poses_shape, list) and len(poses_shape) == 2 and poses_shape[0] == classes):
        raise reader.fail(f"outputs must include probabilities [{classes}] and poses [{classes}, D]")
    if "reconstruction" in outputs and outputs["reconstruction"] != [channels * height * width]:
        raise reader.fail(f"output reconstruction must have shape [{channels * height * width}]")

    files = reader.get(sidecar, "artifacts", dict)
    onnx = {precision: reader.file(directory, files[key], f"artifacts.{key}")
            for precision, key in ONNX_KEYS.items() if files.get(key)}
    if "fp32" not in onnx:
        raise reader.fail("artifacts.onnx is not set")
    checkpoint = reader.file(directory, reader.get(reader.get(sidecar, "checkpoint", dict), "file", str, "checkpoint."),
                             "checkpoint.file")
    plan = plan_info = None
    if files.get("tensorrt"):
        plan = reader.file(directory, files["tensorrt"], "artifacts.tensorrt")
        plan_info = _read_plan_info(plan.with_name(plan.name + ".json"))

    return ModelArtifacts(
        directory=directory,
        name=reader.get(sidecar, "name", str),
        version=str(reader.get(sidecar, "version", (str, int))),
        input_name=reader.get(model_input, "name", str, "input."),
        input_shape=input_shape,
        class_names=class_names,
        pose_dim=int(poses_shape[1]),
        output_names=tuple(outputs),
        routing=dict(reader.get(sidecar, "routing", dict)),
        onnx=onnx,
        checkpoint=checkpoint,
        tensorrt_plan=plan,
        tensorrt_info=plan_info,
    )


def _read_plan_info(path: Path) -> dict:
    """model.plan.json: the GPU and TensorRT version the engine was built for."""
    if not path.is_file():
        raise CapsNetError(f"{path} is missing: a TensorRT plan is only loaded with the description of the GPU it was built for")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CapsNetError(f"{path} is damaged: not valid JSON ({err})") from None
    missing = [key for key in PLAN_INFO_KEYS if not isinstance(info, dict) or key not in info]
    if missing:
        raise CapsNetError(f"{path} is damaged: missing {', '.join(missing)}")
    return info
