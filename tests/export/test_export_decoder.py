"""The decoder alone, as `capsnet export --reconstruction` writes it: decoder.onnx (poses and a class index in, the
reconstruction out), its description in model.json, its parity with PyTorch's decoder, and its model in the Triton
repository, parsed with Triton's own schema."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime
import pytest
import torch
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.model_description.files import file_sha256
from capsnet.model_description.schema import ModelDescription
from capsnet.models.checkpoint import load_checkpoint


def test_model_json_describes_the_decoder_and_its_parity(tiny_export):
    decoder = tiny_export.sidecar["decoder"]
    assert decoder["file"] == "decoder.onnx" and decoder["max_pose_length"] == 1.0
    assert decoder["inputs"] == [{"name": "poses", "datatype": "FP32", "shape": [10, 16]},
                                 {"name": "class_index", "datatype": "INT64", "shape": []}]
    assert decoder["outputs"] == [{"name": "reconstruction", "datatype": "FP32", "shape": [784]}]
    parity = decoder["parity"]
    assert parity["rows"] == 128 + 10 + 16 * 11  # the reference poses, one as every class, each dimension moved
    assert parity["max_abs_diff"] <= parity["tolerance"] == 1e-4 and parity["vs_full_graph_max_abs_diff"] <= 1e-4
    assert tiny_export.sidecar["sha256"]["decoder.onnx"] == file_sha256(tiny_export.out / "decoder.onnx")
    assert ModelDescription.read(tiny_export.out).decoder.pose_shape == (10, 16)


def test_model_json_records_the_pose_figures_capsnet_eval_measures(tiny_export, tmp_path):
    recorded = tiny_export.sidecar["decoder"]["pose"]
    assert main(["eval", str(tiny_export.checkpoint), "--pose", "--pose-out", str(tmp_path / "pose.json")]) == 0
    measured = json.loads((tmp_path / "pose.json").read_text())
    assert recorded["images"] == measured["images"] == 1000 and recorded["split"] == "test"
    for key in ("reconstruction_mse", "template_mse", "fidelity"):
        assert recorded[key] == pytest.approx(measured[key], rel=1e-5)
    assert recorded["sensitivity"] == pytest.approx(measured["sensitivity"], rel=1e-4, abs=1e-3)
    assert ModelDescription.read(tiny_export.out).decoder.pose.visible_dimensions == recorded["visible_dimensions"]


def test_the_decoder_graph_draws_as_pytorchs_decoder_at_any_batch_size(tiny_export):
    model = load_checkpoint(tiny_export.checkpoint).build_model().eval()
    session = onnxruntime.InferenceSession(str(tiny_export.out / "decoder.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for count in (1, 13):
        poses = rng.uniform(-0.25, 0.25, (count, 10, 16)).astype(np.float32)  # (N, J, D), each shorter than 1
        classes = rng.integers(10, size=count)  # (N,)
        (drawn,) = session.run(["reconstruction"], {"poses": poses, "class_index": classes})
        with torch.inference_mode():
            expected = model.decoder(torch.from_numpy(poses), torch.from_numpy(classes)).numpy()
        assert drawn.shape == (count, 784)
        np.testing.assert_allclose(drawn, expected, rtol=0, atol=1e-5)


def test_the_triton_repository_holds_the_decoder_as_a_model_of_its_own(tiny_export):
    folder = tiny_export.repo / "capsnet-decoder"
    config = json_format.MessageToDict(text_format.Parse((folder / "config.pbtxt").read_text(),
                                                         model_config_pb2.ModelConfig()),
                                       preserving_proto_field_name=True)
    assert (config["name"], config["platform"], config["max_batch_size"]) == ("capsnet-decoder", "onnxruntime_onnx",
                                                                              256)
    assert config["input"] == [
        {"name": "poses", "data_type": "TYPE_FP32", "dims": ["10", "16"]},
        {"name": "class_index", "data_type": "TYPE_INT64", "dims": ["1"], "reshape": {}},  # reshaped to (B,)
    ]
    assert config["output"] == [{"name": "reconstruction", "data_type": "TYPE_FP32", "dims": ["784"]}]
    assert (folder / "1" / "model.onnx").read_bytes() == (tiny_export.out / "decoder.onnx").read_bytes()


def test_a_decoder_without_the_models_poses_and_reconstruction_is_refused(tiny_export):
    damaged = {**tiny_export.sidecar, "outputs": tiny_export.sidecar["outputs"][:2]}  # no reconstruction
    with pytest.raises(CapsNetError, match="decoder is listed, but the model's outputs have no poses and"):
        ModelDescription.from_json(damaged, "model.json")
    other = {**tiny_export.sidecar, "decoder": {**tiny_export.sidecar["decoder"], "outputs": []}}
    with pytest.raises(CapsNetError, match="decoder's inputs and outputs must be"):
        ModelDescription.from_json(other, "model.json")
