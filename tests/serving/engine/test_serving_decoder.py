"""The decoder served beside the classifier as a model of its own (`capsnet-decoder`), through the one request path:
called with tritonclient over gRPC and REST, it redraws what the classifier drew and any pose as any class, as the
exported graph does; it has metadata, a config, statistics and metrics like any model; bad input is refused with
the field named, and the server carries on."""

from __future__ import annotations

import json

import grpc
import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from capsnet.model_description.schema import ModelDescription
from capsnet.training.data import load_dataset, to_float
from capsnet.v1 import capsnet_pb2 as pb
from serving_helpers import metric, rest, scrape

DECODER = "capsnet-decoder"
GRID = 16 * 11  # a perturbation grid: every pose dimension at 11 steps, one call


@pytest.fixture(scope="module")
def triton(server):
    client = grpcclient.InferenceServerClient(server.target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def triton_http(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.server.http_port}", network_timeout=30)
    yield client
    client.close()


@pytest.fixture(scope="module")
def classified(triton):
    """Five test digits through the served classifier: (poses (5, J, D), predicted classes, reconstructions)."""
    images = to_float(load_dataset("embedded").test.images[:5]).numpy()  # (5, 1, 28, 28)
    given = grpcclient.InferInput("images", list(images.shape), "FP32")
    given.set_data_from_numpy(images)
    answer = triton.infer("capsnet", [given])
    return (answer.as_numpy("poses"), answer.as_numpy("probabilities").argmax(axis=1),
            answer.as_numpy("reconstruction"))


def decode(client, module, poses: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The served decoder's reconstructions of `poses` (N, J, D) drawn as `classes` (N,), by tritonclient `module`."""
    inputs = [module.InferInput("poses", list(poses.shape), "FP32"),
              module.InferInput("class_index", [len(classes)], "INT64")]
    inputs[0].set_data_from_numpy(poses.astype(np.float32))
    inputs[1].set_data_from_numpy(classes.astype(np.int64))
    return client.infer(DECODER, inputs).as_numpy("reconstruction")


def moved(poses: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first digit's capsule with each dimension moved by +0.2 (within length 1), placed as each class's."""
    pose = poses[0, classes[0]]  # (D,)
    items = []
    for dim in range(len(pose)):
        shifted = pose.copy()
        shifted[dim] += 0.2
        shifted *= min(1.0, 0.999 / np.linalg.norm(shifted))
        items.append(shifted)
    as_class = np.arange(len(items)) % poses.shape[1]  # (D,)
    batch = np.zeros((len(items), *poses.shape[1:]), dtype=np.float32)  # (D, J, D)
    batch[np.arange(len(items)), as_class] = items
    return batch, as_class


def test_the_decoder_redraws_the_classifiers_reconstruction_and_any_pose_as_any_class(triton, triton_http,
                                                                                     classified, model_dir):
    poses, classes, drawn = classified
    for client, module in ((triton, grpcclient), (triton_http, httpclient)):
        np.testing.assert_allclose(decode(client, module, poses, classes), drawn, rtol=0, atol=1e-5)
    batch, as_class = moved(poses, classes)
    session = onnxruntime.InferenceSession(str(model_dir / "decoder.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = session.run(["reconstruction"], {"poses": batch, "class_index": as_class})
    served = decode(triton, grpcclient, batch, as_class)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
    assert np.abs(served - drawn[0]).max() > 1e-3  # a moved pose draws something else
    np.testing.assert_allclose(decode(triton_http, httpclient, batch, as_class), served, rtol=0, atol=1e-6)


def test_it_has_metadata_config_statistics_and_metrics_like_any_model(server, model_dir, triton, classified):
    metadata = triton.get_model_metadata(DECODER, as_json=True)
    assert metadata["inputs"] == [{"name": "poses", "datatype": "FP32", "shape": ["-1", "10", "16"]},
                                  {"name": "class_index", "datatype": "INT64", "shape": ["-1"]}]
    assert metadata["outputs"] == [{"name": "reconstruction", "datatype": "FP32", "shape": ["-1", "784"]}]
    config = triton.get_model_config(DECODER, as_json=True)["config"]
    assert config["max_batch_size"] == GRID  # a whole grid in one call, past the server's --max-batch-size 8
    assert config["input"][1] == {"name": "class_index", "data_type": "TYPE_INT64", "dims": ["1"],
                                  "reshape": {}}  # to no dims: the graph takes (N,)
    assert config["parameters"]["max_pose_length"]["string_value"] == "1"
    # how far the poses show, as the export measured it: what the page tells its users
    recorded = ModelDescription.read(model_dir).decoder.pose
    assert json.loads(config["parameters"]["pose_figures"]["string_value"]) == recorded.to_json()
    assert [entry["name"] for entry in triton.get_model_repository_index(as_json=True)["models"]] == [
        "capsnet", DECODER]

    def counts():
        stats = triton.get_inference_statistics(DECODER, as_json=True)["model_stats"][0]
        return (int(stats["inference_stats"]["success"].get("count", 0)), int(stats.get("inference_count", 0)),
                metric(scrape(server.metrics_url), "capsnet_images_total", model=DECODER, version="1"))

    before = counts()
    poses, classes, _ = classified
    grid = np.repeat(poses[:1], GRID, axis=0)  # (176, J, D)
    decode(triton, grpcclient, grid, np.full(GRID, classes[0]))
    assert np.subtract(counts(), before).tolist() == [1, GRID, GRID]


def test_our_api_serves_the_classifier_unnamed_and_refuses_the_decoder(stub, classified):
    image = pb.Image(tensor=pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=[1, 28, 28], data=bytes(784)))
    assert len(stub.Classify(pb.ClassifyRequest(images=[image])).results) == 1  # the one model that takes images
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetModelInfo(pb.GetModelInfoRequest(model_name=DECODER))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'capsnet-decoder' is a decoder" in raised.value.details()


def _long(poses: np.ndarray) -> np.ndarray:
    longer = poses.copy()
    longer[0, 3] = 0
    longer[0, 3, 0] = 1.5
    return longer


BAD = {  # what is sent instead (poses, classes), and what the answer says
    "a wrong shape": (lambda p, c: (p[:, :, :15], c),
                      "inputs[0].shape: 'poses' takes shape [N, 10, 16], got [2, 10, 15]"),
    "a class out of range": (lambda p, c: (p, np.array([0, 10])),
                             "class_index: item 1 is class 10; expected 0 to 9 (the model's 10 classes)"),
    "NaN": (lambda p, c: (np.where(np.arange(16) == 5, np.nan, p), c), "poses: item 0 contains NaN or Inf"),
    "a pose longer than a squashed capsule": (lambda p, c: (_long(p), c),
                                             "poses: item 0 capsule 3 has length 1.5000; expected at most 1"),
    "fewer classes than poses": (lambda p, c: (p, c[:1]), "inputs[1].shape: 1 class indices for 2 poses"),
    "a batch over the limit": (lambda p, c: (np.repeat(p[:1], GRID + 1, axis=0), np.zeros(GRID + 1)),
                               f"{GRID + 1} images exceed the maximum of {GRID} per request"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_naming_the_field_and_the_server_carries_on(server, triton, classified, case):
    poses, classes, drawn = classified
    change, message = BAD[case]
    bad_poses, bad_classes = change(poses[:2], classes[:2])
    with pytest.raises(InferenceServerException) as raised:
        decode(triton, grpcclient, bad_poses, bad_classes)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and message in raised.value.message()
    status, answer = rest(server, "POST", f"/v2/models/{DECODER}/infer", {"inputs": [  # JSON's NaN, as Python writes it
        {"name": "poses", "datatype": "FP32", "shape": list(bad_poses.shape), "data": bad_poses.ravel().tolist()},
        {"name": "class_index", "datatype": "INT64", "shape": [len(bad_classes)],
         "data": bad_classes.astype(int).tolist()}]})
    assert status == 400 and message in answer["error"]
    np.testing.assert_allclose(decode(triton, grpcclient, poses[:1], classes[:1]), drawn[:1], rtol=0, atol=1e-5)
