"""Export of a model that takes any image size (shared-capsnet): ONNX graphs with a free height and width, model.json
saying which sizes are valid, Triton's config and KServe's metadata with -1 for them."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from capsnet.cli import main
from capsnet.export.onnx_export import CONTROL_FLOW_OPS
from capsnet.model_description.input_sizes import InputSizes
from capsnet.model_description.schema import ModelDescription
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset

SIZES = [(28, 28), (28, 56), (56, 56), (40, 100), (29, 45)]


def canvases(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """`count` height x width images, each with test digits pasted at random places: (count, 1, H, W) in [0, 1]."""
    digits = load_dataset("embedded").test.images  # (N, 1, 28, 28) uint8
    rng = np.random.default_rng(seed)
    images = np.zeros((count, 1, height, width), dtype=np.float32)
    for image in images:
        for _ in range(3):
            digit = digits[rng.integers(len(digits))][0].astype(np.float32) / 255
            top, left = rng.integers(0, max(1, height - 27)), rng.integers(0, max(1, width - 27))
            patch = digit[: height - top, : width - left]
            image[0, top:top + patch.shape[0], left:left + patch.shape[1]] = np.maximum(
                image[0, top:top + patch.shape[0], left:left + patch.shape[1]], patch)
    return images


def test_graph_takes_a_free_height_and_width_without_control_flow(shared_tiny_export):
    graph = onnx.load(str(shared_tiny_export / "model.onnx")).graph
    assert not CONTROL_FLOW_OPS & {node.op_type for node in graph.node}
    dims = [dim.dim_param or dim.dim_value for dim in graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 1, "height", "width"]
    for output in graph.output:  # probabilities (batch, 10), poses (batch, 10, 16): no size in them
        assert [dim.dim_param or dim.dim_value for dim in output.type.tensor_type.shape.dim][1:] in ([10], [10, 16])


@pytest.mark.parametrize("name", ["model.onnx", "model.int8.onnx"])
def test_every_size_matches_pytorch_and_each_image_alone_matches_its_batch(shared_tiny_export, name):
    import onnxruntime

    model = load_checkpoint(shared_tiny_export / "model.ckpt").build_model().eval()
    session = onnxruntime.InferenceSession(str(shared_tiny_export / name), providers=["CPUExecutionProvider"])
    fp32 = name == "model.onnx"
    for seed, (height, width) in enumerate(SIZES):
        images = canvases(5, height, width, seed)
        batched = session.run(["probabilities"], {"images": images})[0]  # (5, 10)
        alone = np.concatenate([session.run(["probabilities"], {"images": images[i:i + 1]})[0] for i in range(5)])
        np.testing.assert_allclose(alone, batched, rtol=0, atol=1e-5, err_msg=f"{name} at {height}x{width}")
        with torch.no_grad():
            expected = model(torch.from_numpy(images)).probabilities.numpy()
        # INT8 is held to its gate's bound (model_description.precision_gate.GATE_MAX_DIFF), FP32 to the export's parity
        np.testing.assert_allclose(batched, expected, rtol=0, atol=1e-4 if fp32 else 0.1,
                                   err_msg=f"{name} at {height}x{width}")


def test_model_json_says_which_sizes_are_valid_and_what_export_checked(shared_tiny_export):
    description = ModelDescription.read(shared_tiny_export)
    assert description.sizes == InputSizes(channels=1, min_height=14, min_width=14, max_height=256, max_width=256)
    assert description.input_shape == (1, 28, 28) and description.input_dims == [1, -1, -1]
    sidecar = json.loads((shared_tiny_export / "model.json").read_text())
    assert sidecar["input"]["sizes"]["multiple_of"] == 1
    checked = sidecar["parity"]["sizes"]
    assert list(checked) == [f"{h}x{w}" for h, w in SIZES]
    for result in checked.values():
        assert max(result["pytorch"]["max_abs_diff"].values()) <= 1e-4
        assert max(result["batch_invariance"]["max_abs_diff"].values()) <= 1e-4
    config = (shared_tiny_export.parent / "triton" / "capsnet" / "config.pbtxt").read_text()
    assert "dims: [ 1, -1, -1 ]" in config


def test_model_json_refuses_sizes_that_do_not_hold_its_shape(shared_tiny_export):
    from capsnet.errors import CapsNetError

    sidecar = json.loads((shared_tiny_export / "model.json").read_text())
    sidecar["input"]["sizes"]["min_height"] = 30
    with pytest.raises(CapsNetError, match=r"input.shape \[1, 28, 28\] is not one of the input.sizes"):
        ModelDescription.from_json(sidecar, "model.json")
    del sidecar["input"]["sizes"]  # an export of a fixed-size model written before sizes were recorded
    assert ModelDescription.from_json(sidecar, "model.json").sizes == InputSizes(1, 28, 28, 28, 28)


@pytest.mark.parametrize("option", ["--reconstruction", "--tensorrt", "--aoti=cpu"])
def test_options_for_one_size_are_refused_in_one_line(trained_shared_tiny_checkpoint, tmp_path, capsys, option):
    assert main(["export", str(trained_shared_tiny_checkpoint), "--out", str(tmp_path / "out"), option]) != 0
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "1-channel images of 14x14 to 256x256" in error, error
    assert not (tmp_path / "out").exists()
