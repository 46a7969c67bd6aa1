"""Export of a CNN baseline (`--arch gap-cnn`, `cnn-baseline`): a model without capsules, whose only output is its
probabilities. Its graphs (FP32, INT8, FP16), reference set, model.json and Triton config declare that one output; a
model of any size keeps its free height and width and is checked at the same sizes; model.json's format says so,
and a malformed description of the outputs is refused naming what is wrong."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch

from capsnet.errors import CapsNetError
from capsnet.export.metadata import output_shapes, read_metadata
from capsnet.model_description.input_sizes import InputSizes
from capsnet.model_description.schema import ModelDescription
from capsnet.models.checkpoint import load_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import load_dataset

GRAPHS = ["model.onnx", "model.int8.onnx", "model.fp16.onnx"]


@pytest.fixture(scope="module")
def sidecar(gap_cnn_tiny_export) -> dict:
    return json.loads((gap_cnn_tiny_export / "model.json").read_text())


@pytest.mark.parametrize("name", GRAPHS)
def test_every_graph_has_the_probabilities_alone_and_a_free_height_and_width(gap_cnn_tiny_export, name):
    model = onnx.load(str(gap_cnn_tiny_export / name))
    dims = [dim.dim_param or dim.dim_value for dim in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 1, "height", "width"]
    assert [(output.name, [dim.dim_param or dim.dim_value for dim in output.type.tensor_type.shape.dim])
            for output in model.graph.output] == [("probabilities", ["batch", 10])]
    assert read_metadata(model)["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [10]}]


def test_the_graph_answers_28x28_and_28x56_as_pytorch_does(gap_cnn_tiny_export):
    import onnxruntime

    model = load_checkpoint(gap_cnn_tiny_export / "model.ckpt").build_model().eval()
    session = onnxruntime.InferenceSession(str(gap_cnn_tiny_export / "model.onnx"), providers=["CPUExecutionProvider"])
    digits = load_dataset("embedded").test.images[:6].astype(np.float32) / 255  # (6, 1, 28, 28)
    for images in (digits, np.concatenate([digits[:3], digits[3:]], axis=3)):  # 28x28, then two digits in 28x56
        with torch.inference_mode():
            expected = model(torch.from_numpy(images)).probabilities.numpy()
        (answered,) = session.run(None, {"images": images})
        np.testing.assert_allclose(answered, expected, rtol=0, atol=1e-5, err_msg=str(images.shape))


def test_model_json_describes_a_model_without_poses_or_routing(gap_cnn_tiny_export, sidecar, shared_tiny_export):
    description = ModelDescription.read(gap_cnn_tiny_export)
    assert sidecar["format_version"] == 4 and sidecar["routing"] is None
    assert sidecar["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [10]}]
    assert description.output_names == ("probabilities",) and description.pose_dim == 0 and description.routing == {}
    assert description.to_json() == sidecar  # the reader gives back what export wrote
    # the capsule head of the same backbone still writes the format that servers reading version 3 load
    capsules = ModelDescription.read(shared_tiny_export)
    assert capsules.to_json()["format_version"] == 3 and capsules.pose_dim == 16
    # the same sizes as the capsule head, checked at the same sizes
    assert description.sizes == capsules.sizes == InputSizes(1, 14, 14, 256, 256)
    assert (list(sidecar["parity"]["sizes"]) == list(capsules.parity["sizes"])
            == ["28x28", "28x56", "56x56", "40x100", "29x45"])
    for result in sidecar["parity"]["sizes"].values():
        assert set(result["pytorch"]["max_abs_diff"]) == {"probabilities"}
        assert result["pytorch"]["max_abs_diff"]["probabilities"] <= 1e-4
    # the precision gate measured every variant written, and the checkpoint's reduced-precision convolutions
    assert set(sidecar["precision_gate"]["variants"]) == {"onnx_int8", "onnx_fp16", "torch_fp16", "torch_bf16"}
    with np.load(gap_cnn_tiny_export / "reference.npz") as reference:
        assert sorted(reference.files) == ["images", "probabilities"]
        assert reference["probabilities"].shape == (128, 10)


def test_the_triton_config_has_a_free_height_and_width_and_one_output(gap_cnn_tiny_export):
    config = (gap_cnn_tiny_export.parent / "triton" / "capsnet" / "config.pbtxt").read_text()
    assert "dims: [ 1, -1, -1 ]" in config
    outputs = config[config.index("output ["):config.index("dynamic_batching")]
    assert outputs.count("name:") == 1 and 'name: "probabilities"' in outputs and "dims: [ 10 ]" in outputs


def _without_poses(values: dict) -> dict:
    values["outputs"] = [output for output in values["outputs"] if output["name"] != "poses"]
    return values


@pytest.mark.parametrize("change, message", [
    # version 3 promised poses and routing: a file without them is not version 3
    (_without_poses, "outputs must include poses [10, D] in format version 3 (a model without poses is "
                     "format version 4)"),
    (lambda s: s.__setitem__("routing", None), "'routing' has the wrong type (NoneType)"),
    (lambda s: s.__setitem__("format_version", 5), "reads versions 3 and 4"),
    (lambda s: s.__setitem__("format_version", 4.0), "reads versions 3 and 4"),
    (lambda s: s["outputs"][1].__setitem__("shape", [10]), "output poses must have shape [10, D], got [10]"),
    (lambda s: s["outputs"][1].__setitem__("shape", [9, 16]), "output poses must have shape [10, D], got [9, 16]"),
    (lambda s: s["outputs"].pop(0), "outputs must include probabilities [10]"),
    (lambda s: s["outputs"].append(dict(s["outputs"][0])), "outputs[2].name 'probabilities' is listed twice"),
])
def test_model_json_with_malformed_outputs_is_refused_naming_them(shared_tiny_export, change, message):
    values = json.loads((shared_tiny_export / "model.json").read_text())
    change(values)
    with pytest.raises(CapsNetError) as raised:
        ModelDescription.from_json(values, "model.json")
    assert str(raised.value).startswith("model.json ") and message in str(raised.value)


def test_a_version_4_model_json_takes_poses_or_none(shared_tiny_export, sidecar):
    capsules = json.loads((shared_tiny_export / "model.json").read_text())
    assert ModelDescription.from_json({**capsules, "format_version": 4}, "model.json").pose_dim == 16
    baseline = copy.deepcopy(sidecar)
    baseline["outputs"] = []
    with pytest.raises(CapsNetError, match=r"outputs must include probabilities \[10\]"):
        ModelDescription.from_json(baseline, "model.json")


def test_a_cnn_baseline_declares_its_probabilities_alone_and_a_capsule_network_its_poses():
    assert output_shapes(preset("tiny", arch="cnn-baseline"), reconstruction=False) == {"probabilities": (10,)}
    assert output_shapes(preset("gap-cnn-tiny"), reconstruction=False) == {"probabilities": (10,)}
    assert output_shapes(preset("tiny"), reconstruction=True) == {"probabilities": (10,), "poses": (10, 16),
                                                                  "reconstruction": (784,)}
