"""Serving a model that takes any image size: several sizes in KServe gRPC and REST and our API, sizes outside the
range refused alike naming it, PNGs taken at their own size, batches of one size, the present classes; and a
fixed-size model resizing another PNG keeping its aspect ratio, and saying so."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from serving_helpers import ServerThread, graph_probabilities, metric, pairs, png, rest_infer, scrape, server_config
from tritonclient.utils import InferenceServerException

from capsnet.cli import main
from capsnet.client.api import CapsNetClient
from capsnet.training.data import load_dataset
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc

SIZES = [(28, 28), (28, 56), (56, 56), (40, 100)]
RANGE = "14x14 to 256x256"


@pytest.fixture(scope="module")
def reference(shared_tiny_export):
    return graph_probabilities(shared_tiny_export)


def test_kserve_grpc_and_rest_answer_every_valid_size_as_the_graph_does(any_size_server, reference):
    triton = grpcclient.InferenceServerClient(url=any_size_server.target)
    try:
        metadata = triton.get_model_metadata("capsnet", as_json=True)
        assert [int(d) for d in metadata["inputs"][0]["shape"]] == [-1, 1, -1, -1]
        config = triton.get_model_config("capsnet", as_json=True)["config"]
        assert [int(d) for d in config["input"][0]["dims"]] == [1, -1, -1]
        for seed, (height, width) in enumerate(SIZES):
            images, _ = pairs(3, height, width, seed) if width >= 56 and height >= 28 else (
                np.random.default_rng(seed).random((3, 1, height, width), dtype=np.float32), None)
            tensor = grpcclient.InferInput("images", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            answered = triton.infer("capsnet", [tensor]).as_numpy("probabilities")
            np.testing.assert_allclose(answered, reference(images), rtol=0, atol=1e-5, err_msg=f"{height}x{width}")
            status, body = rest_infer(any_size_server, images)
            assert status == 200
            rest = np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(body["outputs"][0]["shape"])
            np.testing.assert_allclose(rest, reference(images), rtol=0, atol=1e-5, err_msg=f"{height}x{width}")
    finally:
        triton.close()


@pytest.mark.parametrize("height, width", [(13, 28), (28, 257), (300, 300)])
def test_a_size_outside_the_range_is_refused_naming_it_by_every_api(any_size_server, height, width):
    images = np.zeros((1, 1, height, width), dtype=np.float32)
    status, body = rest_infer(any_size_server, images)
    assert status == 400 and RANGE in body["error"] and f"[1, 1, {height}, {width}]" in body["error"]
    triton = grpcclient.InferenceServerClient(url=any_size_server.target)
    try:
        tensor = grpcclient.InferInput("images", [1, 1, height, width], "FP32")
        tensor.set_data_from_numpy(images)
        with pytest.raises(InferenceServerException) as raised:
            triton.infer("capsnet", [tensor])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and RANGE in raised.value.message()
    finally:
        triton.close()
    with grpc.insecure_channel(any_size_server.target) as channel:
        stub = pb_grpc.CapsNetServiceStub(channel)
        for image in (pb.Image(encoded=png(images[0])), pb.Image(tensor=pb.Tensor(
                dtype=pb.DATA_TYPE_FLOAT32, shape=[1, height, width], data=images[0].tobytes()))):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Classify(pb.ClassifyRequest(images=[image]))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and RANGE in raised.value.details()


def test_our_api_takes_pngs_at_their_own_size_and_reports_the_present_classes(any_size_server, reference):
    images, classes = pairs(6)
    single = load_dataset("embedded").test.images[:2].astype(np.float32) / 255  # (2, 1, 28, 28)
    sent = [png(image) for image in images] + [png(image) for image in single]  # two sizes in one request
    with CapsNetClient(any_size_server.target) as client:
        info = client.model_info()
        assert list(info.input_sizes) == [1, 14, 14, 256, 256]
        stats = any_size_server.server.service.stats
        before = (stats.requests["success"].count, stats.inference_count)
        predictions = client.classify(sent, top_k=2, poses=False)
        # one request of two sizes, counted once with all its images
        assert (stats.requests["success"].count, stats.inference_count) == (before[0] + 1, before[1] + len(sent))
        lowered = client.classify(sent[:1], present_threshold=0.05)
    expected = np.concatenate([reference(images), reference(single)])
    for prediction, probabilities in zip(predictions, expected):
        assert prediction.resized_from is None
        np.testing.assert_allclose(prediction.probabilities, probabilities, rtol=0, atol=1e-5)
        present = [index for index in np.argsort(-probabilities, kind="stable") if probabilities[index] > 0.5]
        assert [index for index, _, _ in prediction.present_classes] == present
    # the threshold is the request's: lower, more classes are present
    assert [index for index, _, _ in lowered[0].present_classes] == [
        index for index in np.argsort(-expected[0], kind="stable") if expected[0][index] > 0.05]
    # the model trained on single digits names both digits of most pairs among its two longest capsules
    found = sum({index for index, _, _ in prediction.top_classes} == pair
                for prediction, pair in zip(predictions, classes))
    assert found >= 1, [prediction.top_classes for prediction in predictions[:6]]


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_a_present_threshold_outside_0_to_1_is_refused(any_size_server, threshold):
    with CapsNetClient(any_size_server.target) as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.classify([np.zeros((1, 28, 28), dtype=np.float32)], present_threshold=threshold)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "present_threshold" in raised.value.details()


def test_concurrent_requests_of_several_sizes_are_batched_by_size_and_answered_as_alone(any_size_server, reference):
    rng = np.random.default_rng(3)
    requests = [rng.random((2, 1, *SIZES[index % len(SIZES)]), dtype=np.float32) for index in range(16)]

    def infer(images):
        status, body = rest_infer(any_size_server, images)
        assert status == 200, body
        return np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(len(images), -1)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(infer, requests))
    for images, answered in zip(requests, answers):
        np.testing.assert_allclose(answered, reference(images), rtol=0, atol=1e-5)


def test_capsnet_predict_prints_the_present_classes_of_a_pair(any_size_server, tmp_path, capsys, reference):
    images, _ = pairs(1)
    path = tmp_path / "pair.png"
    path.write_bytes(png(images[0]))
    assert main(["predict", str(path), "--server", any_size_server.target, "--json", "--present-threshold", "0.2"]) == 0
    (answer,) = json.loads(capsys.readouterr().out)
    probabilities = reference(images)[0]
    assert [item["class"] for item in answer["present_classes"]] == [
        index for index in np.argsort(-probabilities, kind="stable") if probabilities[index] > 0.2]
    assert answer["resized_from"] is None
    assert main(["predict", str(path), "--server", any_size_server.target, "--present-threshold", "2"]) != 0
    assert "--present-threshold must be 0 to 1" in capsys.readouterr().err


def test_a_fixed_size_model_resizes_another_png_keeping_its_aspect_ratio_and_says_so(server, stub):
    images, _ = pairs(1)
    answer = stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=png(images[0]))])).results[0]
    assert list(answer.resized_from) == [28, 56]
    # what it was given: the pair scaled to 14x28, centred on black in 28x28 (not squashed to 28x28)
    strip = Image.fromarray(np.round(images[0, 0] * 255).astype(np.uint8)).resize((28, 14), Image.Resampling.BILINEAR)
    fitted = np.zeros((28, 28), dtype=np.uint8)
    fitted[7:21, :] = np.asarray(strip)
    expected = stub.Classify(pb.ClassifyRequest(images=[pb.Image(tensor=pb.Tensor(
        dtype=pb.DATA_TYPE_UINT8, shape=[1, 28, 28], data=fitted.tobytes()))])).results[0]
    assert not expected.resized_from
    np.testing.assert_allclose(answer.probabilities, expected.probabilities, rtol=0, atol=1e-6)


def test_a_batch_holds_one_size_and_takes_later_requests_of_that_size_past_others(shared_tiny_export, reference):
    """Three requests meeting in the queue (a generous delay): 28x28, then 28x56, then 28x28 again. Two backend runs,
    one per size, the third request joining the first's batch past the second."""
    running = ServerThread(server_config(shared_tiny_export, precision="fp32", max_batch_size=8,
                                         max_queue_delay_us=500_000))
    rng = np.random.default_rng(4)
    sent = [rng.random((2, 1, 28, 28), dtype=np.float32), rng.random((3, 1, 28, 56), dtype=np.float32),
            rng.random((2, 1, 28, 28), dtype=np.float32)]
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.CapsNetServiceStub(channel)
            before = scrape(running.metrics_url)
            futures = [stub.Classify.future(pb.ClassifyRequest(images=[pb.Image(tensor=pb.Tensor(
                dtype=pb.DATA_TYPE_FLOAT32, shape=list(image.shape), data=image.tobytes())) for image in images]),
                timeout=60) for images in sent]
            answers = [future.result() for future in futures]
            after = scrape(running.metrics_url)
    finally:
        running.stop()
    for images, answer in zip(sent, answers):
        got = np.array([list(result.probabilities) for result in answer.results], dtype=np.float32)
        np.testing.assert_allclose(got, reference(images), rtol=0, atol=1e-5)
    def new(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    runs = new("capsnet_batch_size_count")
    three_or_four = new("capsnet_batch_size_bucket", le="4.0") - new("capsnet_batch_size_bucket", le="2.0")
    # 2 + 2 images of 28x28 in one run, 3 of 28x56 in the other
    assert runs == 2 and three_or_four == 2 and new("capsnet_batch_size_sum") == 7, (
        f"{runs} runs, {three_or_four} of 3-4")


def test_capsnet_predict_says_when_a_fixed_size_model_resized_the_image(server, tmp_path, capsys):
    images, _ = pairs(1)
    path = tmp_path / "pair.png"
    path.write_bytes(png(images[0]))
    assert main(["predict", str(path), "--server", server.target]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{path}: ") and "; present: " in line
    assert line.endswith("; resized from 28x56, aspect ratio kept")
