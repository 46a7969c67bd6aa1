"""The decoder as a model of its own (model.json's `decoder`): a capsule network exported with its reconstruction
also writes the decoder alone, poses (B, J, D) and a class index (B,) in, the reconstruction out, so that a client
can draw what any pose would look like as any class (the paper's figure 4), served beside the classifier.

The class index picks the one capsule the decoder reads; the others are masked to zero, as in training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capsnet.model_description.pose import PoseFigures

DECODER_FILE = "decoder.onnx"
POSES_INPUT = "poses"
CLASS_INPUT = "class_index"
RECONSTRUCTION_OUTPUT = "reconstruction"
# the served decoder's model name: the classifier's with this suffix (KServe v2 and Triton's repository)
DECODER_SUFFIX = "-decoder"
# the parts of an export a server serves as models of their own: images in, or poses and a class in
CLASSIFIER_PART, DECODER_PART = "classifier", "decoder"
# a pose's length a squashed capsule never exceeds, and the rounding its graph may add (float32 ulps of 1)
UNIT_LENGTH = 1.0
LENGTH_SLACK = 1e-5


def decoder_model_name(classifier: str) -> str:
    return classifier + DECODER_SUFFIX


@dataclass(frozen=True)
class DecoderDescription:
    """decoder.onnx: inputs poses float32 [N, J, D] and class_index int64 [N], output reconstruction float32 [N, C*H*W]
    in [0, 1]. `max_pose_length`: 1 for squashed capsules (a longer pose is no capsule's output, and the decoder never
    saw one); None for matrix capsules (EM), whose pose entries are not bounded."""

    file: str
    classes: int  # J
    pose_dim: int  # D
    output_size: int  # C*H*W
    max_pose_length: float | None
    parity: dict = field(default_factory=dict)  # decoder.onnx on ONNX Runtime against PyTorch's decoder
    pose: PoseFigures | None = None  # how far its poses show in its drawings; absent from older exports

    @property
    def pose_shape(self) -> tuple[int, int]:
        return (self.classes, self.pose_dim)

    def tensors(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(inputs, outputs) as model.json and KServe list them: name, datatype and shape without the batch axis."""
        inputs: list[dict[str, Any]] = [{"name": POSES_INPUT, "datatype": "FP32",
                                         "shape": [self.classes, self.pose_dim]},
                                        {"name": CLASS_INPUT, "datatype": "INT64", "shape": []}]
        return inputs, [{"name": RECONSTRUCTION_OUTPUT, "datatype": "FP32", "shape": [self.output_size]}]

    def to_json(self) -> dict[str, Any]:
        inputs, outputs = self.tensors()
        return {"file": self.file, "inputs": inputs, "outputs": outputs, "max_pose_length": self.max_pose_length,
                "parity": self.parity, "pose": self.pose.to_json() if self.pose else None}

    @classmethod
    def from_json(cls, value: Any, fail, classes: int, pose_dim: int, output_size: int) -> "DecoderDescription":
        """model.json's `decoder`, which must describe the classifier's own poses and image (`fail(message)` makes
        the error naming the file)."""
        if not isinstance(value, dict) or not isinstance(value.get("file"), str):
            raise fail("decoder must be an object with a file name")
        expected = cls(value["file"], classes, pose_dim, output_size, None).tensors()
        if [value.get("inputs"), value.get("outputs")] != list(expected):
            raise fail(f"decoder's inputs and outputs must be {expected[0]} and {expected[1]} (the model's poses "
                       "and image)")
        length = value.get("max_pose_length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float)) or length <= 0):
            raise fail(f"decoder.max_pose_length must be a positive number or null, got {length!r}")
        parity = value.get("parity", {})
        if not isinstance(parity, dict):
            raise fail("decoder.parity must be an object")
        pose = None if value.get("pose") is None else PoseFigures.from_json(value["pose"], fail, pose_dim)
        return cls(value["file"], classes, pose_dim, output_size, None if length is None else float(length),
                   dict(parity), pose)

