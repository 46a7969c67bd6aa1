"""Serving a CNN baseline (`--arch gap-cnn`): a model of any image size whose only output is its probabilities. KServe
gRPC and REST answer 28x28 digits and 28x56 pairs as PyTorch does in process; metadata and Triton's config list the
one output; asking for poses is refused naming the outputs there are; our API and `capsnet predict` give the present
classes without poses; the reduced precisions and the torch backend pass their self-check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from serving_helpers import ServerThread, pairs, png, rest, rest_infer, server_config
from tritonclient.utils import InferenceServerException

from capsnet.cli import main
from capsnet.client.api import CapsNetClient
from capsnet.models.checkpoint import load_checkpoint
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import load_backend
from capsnet.training.data import load_dataset

OUTPUTS = [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]


@pytest.fixture(scope="module")
def cnn_server(gap_cnn_tiny_export):
    """The CNN baseline served at FP32 (its answers are compared with PyTorch's)."""
    running = ServerThread(server_config(gap_cnn_tiny_export, precision="fp32"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def pytorch(gap_cnn_tiny_export):
    """The exported checkpoint run in process: (N, C, H, W) float32 -> (N, J) probabilities."""
    model = load_checkpoint(gap_cnn_tiny_export / "model.ckpt").build_model().eval()

    def probabilities(images: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(images)).probabilities.numpy()

    return probabilities


def digits_and_pairs() -> list[np.ndarray]:
    """Three test digits (3, 1, 28, 28) and three pairs of them side by side (3, 1, 28, 56), in [0, 1]."""
    return [load_dataset("embedded").test.images[:3].astype(np.float32) / 255, pairs(3)[0]]


def test_kserve_grpc_and_rest_answer_28x28_and_28x56_as_pytorch_does(cnn_server, pytorch):
    triton = grpcclient.InferenceServerClient(url=cnn_server.target)
    try:
        for images in digits_and_pairs():
            size = "x".join(map(str, images.shape[2:]))
            tensor = grpcclient.InferInput("images", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            result = triton.infer("capsnet", [tensor])
            assert [output.name for output in result.get_response().outputs] == ["probabilities"]
            np.testing.assert_allclose(result.as_numpy("probabilities"), pytorch(images), rtol=0, atol=1e-5,
                                       err_msg=size)
            status, body = rest_infer(cnn_server, images)
            assert status == 200 and [output["name"] for output in body["outputs"]] == ["probabilities"], body
            answered = np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(body["outputs"][0]["shape"])
            np.testing.assert_allclose(answered, pytorch(images), rtol=0, atol=1e-5, err_msg=size)
    finally:
        triton.close()


def test_metadata_and_the_triton_config_list_the_one_output(cnn_server):
    triton = grpcclient.InferenceServerClient(url=cnn_server.target)
    try:
        metadata = triton.get_model_metadata("capsnet", as_json=True)
        config = triton.get_model_config("capsnet", as_json=True)["config"]
    finally:
        triton.close()
    assert [{**output, "shape": [int(d) for d in output["shape"]]} for output in metadata["outputs"]] == OUTPUTS
    assert [int(d) for d in metadata["inputs"][0]["shape"]] == [-1, 1, -1, -1]
    outputs = [(output["name"], [int(d) for d in output["dims"]]) for output in config["output"]]
    assert outputs == [("probabilities", [10])]
    status, body = rest(cnn_server, "GET", "/v2/models/capsnet")
    assert status == 200 and body["outputs"] == OUTPUTS
    status, body = rest(cnn_server, "GET", "/v2/models/capsnet/config")
    assert status == 200 and [output["name"] for output in body["output"]] == ["probabilities"]


def test_asking_for_poses_is_refused_naming_the_outputs_there_are(cnn_server):
    images = np.zeros((1, 1, 28, 56), dtype=np.float32)
    triton = grpcclient.InferenceServerClient(url=cnn_server.target)
    try:
        tensor = grpcclient.InferInput("images", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        with pytest.raises(InferenceServerException) as raised:
            triton.infer("capsnet", [tensor], outputs=[grpcclient.InferRequestedOutput("poses")])
    finally:
        triton.close()
    expected = "outputs[0].name: unknown output 'poses'; expected one of probabilities"
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and expected in raised.value.message()
    status, body = rest_infer(cnn_server, images, outputs=["probabilities", "poses"])
    assert status == 400 and "outputs[1].name: unknown output 'poses'; expected one of probabilities" in body["error"]


def test_our_api_gives_probabilities_present_classes_and_top_k_without_poses(cnn_server, pytorch):
    digits, pair_images = digits_and_pairs()
    with CapsNetClient(cnn_server.target) as client:
        info = client.model_info()
        predictions = client.classify([png(image) for image in [*pair_images, *digits]], top_k=3)  # two sizes at once
    assert info.pose_dim == 0 and list(info.output_names) == ["probabilities"] and info.routing.variant == ""
    expected = np.concatenate([pytorch(pair_images), pytorch(digits)])
    for prediction, probabilities in zip(predictions, expected, strict=True):
        ranked = np.argsort(-probabilities, kind="stable")
        assert prediction.poses is None and prediction.resized_from is None
        np.testing.assert_allclose(prediction.probabilities, probabilities, rtol=0, atol=1e-5)
        assert [index for index, _, _ in prediction.top_classes] == list(ranked[:3])
        assert [index for index, _, _ in prediction.present_classes] == [
            index for index in ranked if probabilities[index] > 0.5]
    assert any(prediction.present_classes for prediction in predictions)  # a test that can tell present from absent


def test_capsnet_predict_prints_the_present_classes_and_refuses_poses_in_one_line(cnn_server, pytorch, tmp_path,
                                                                                  capsys):
    images = pairs(1)[0]
    path = tmp_path / "pair.png"
    path.write_bytes(png(images[0]))
    assert main(["predict", str(path), "--server", cnn_server.target, "--json", "--present-threshold", "0.2"]) == 0
    (answer,) = json.loads(capsys.readouterr().out)
    probabilities = pytorch(images)[0]
    assert "poses" not in answer and [item["class"] for item in answer["present_classes"]] == [
        index for index in np.argsort(-probabilities, kind="stable") if probabilities[index] > 0.2]
    assert main(["predict", str(path), "--server", cnn_server.target, "--poses"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"capsnet predict: error: {cnn_server.target}: --poses: model 'capsnet' has no poses (its outputs: "
                    "probabilities); leave --poses out")


@pytest.mark.parametrize("backend, precision", [("onnxruntime", "int8"), ("onnxruntime", "fp16"), ("torch", "fp32")])
def test_the_reduced_precisions_and_the_torch_backend_pass_their_self_check(gap_cnn_tiny_export, backend, precision):
    loaded = load_backend(load_artifacts(gap_cnn_tiny_export),
                          server_config(gap_cnn_tiny_export, backend=backend, precision=precision))
    try:
        assert loaded.backend.output_names == ("probabilities",)
        assert loaded.check.passed and loaded.check.precision == precision and loaded.check.images == 128
        assert set(loaded.check.max_abs_diff) == {"probabilities"}
        answered = loaded.backend.run(pairs(2)[0])
        assert set(answered) == {"probabilities"} and answered["probabilities"].shape == (2, 10)
    finally:
        loaded.backend.close()

