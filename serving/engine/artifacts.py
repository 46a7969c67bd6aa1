"""Reads an export directory (docs/artifacts.md) and checks it is whole before anything is loaded.

A missing, damaged or altered directory is a CapsNetError at startup, naming the file and what is
wrong, so `capsnet serve` exits at once instead of failing on the first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from capsnet.model_description.files import PLAN_INFO_NAME, read_plan_info
from capsnet.model_description.schema import ONNX_KEYS, ModelDescription


@dataclass(frozen=True, kw_only=True)
class ModelArtifacts(ModelDescription):
    """model.json's description plus where its files are, each checked against its recorded digest."""

    directory: Path
    onnx: dict[str, Path]  # precision -> file, only those exported
    checkpoint: Path
    reference: Path  # the self-check images and their FP32 outputs
    tensorrt_plan: Path | None
    tensorrt_info: dict | None  # model.plan.json


def load_artifacts(directory: str | Path) -> ModelArtifacts:
    directory = Path(directory)
    description = ModelDescription.read(directory)
    files = description.artifacts
    onnx = {precision: description.resolve(directory, files[key], f"artifacts.{key}")
            for precision, key in ONNX_KEYS.items() if files.get(key)}
    plan = plan_info = None
    if files.get("tensorrt"):
        plan = description.resolve(directory, files["tensorrt"], "artifacts.tensorrt")
        plan_info = read_plan_info(description.resolve(directory, PLAN_INFO_NAME, "the TensorRT plan's description"))
    return ModelArtifacts(
        **description.description_fields(),
        directory=directory,
        onnx=onnx,
        checkpoint=description.resolve(directory, files["checkpoint"], "artifacts.checkpoint"),
        reference=description.resolve(directory, files["reference"], "artifacts.reference"),
        tensorrt_plan=plan,
        tensorrt_info=plan_info,
    )
