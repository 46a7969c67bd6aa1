"""The CapsNet API end to end: a real server on a loopback port, real gRPC clients."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from serving_helpers import ServerThread, server_config

from capsnet.client.api import CapsNetClient, image_message
from capsnet.v1 import capsnet_pb2 as pb

RNG = np.random.default_rng(0)


def random_images(count: int) -> np.ndarray:
    return RNG.random((count, 1, 28, 28), dtype=np.float32)  # (N, 1, 28, 28)


def direct(server, images: np.ndarray) -> dict[str, np.ndarray]:
    """The server's backend called directly, without gRPC or batching."""
    return server.server.service.backend.run(np.ascontiguousarray(images))


def png_bytes(pixels: np.ndarray, mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


def test_classify_float_tensors_equal_backend_output(server, stub):
    images = random_images(5)
    response = stub.Classify(pb.ClassifyRequest(images=[image_message(i) for i in images], include_reconstruction=True,
                                                top_k=3, request_id="req-1"), timeout=30)
    expected = direct(server, images)
    assert response.model_name == "capsnet" and response.model_version == "1" and response.request_id == "req-1"
    assert len(response.results) == 5
    for index, result in enumerate(response.results):
        np.testing.assert_allclose(result.probabilities, expected["probabilities"][index], rtol=0, atol=1e-6)
        assert list(result.poses.shape) == [10, 16]
        np.testing.assert_allclose(np.reshape(result.poses.values, (10, 16)), expected["poses"][index], rtol=0,
                                   atol=1e-6)
        assert list(result.reconstruction.shape) == [1, 28, 28]
        np.testing.assert_allclose(result.reconstruction.values, expected["reconstruction"][index], rtol=0, atol=1e-6)
        best = int(np.argmax(expected["probabilities"][index]))
        assert result.predicted_class == best and result.predicted_name == str(best)
        order = np.argsort(-expected["probabilities"][index], kind="stable")[:3]
        assert [c.index for c in result.top_classes] == order.tolist()
        assert result.top_classes[0].probability == pytest.approx(result.probabilities[best])
    timing = response.timing
    assert timing.total.ToNanoseconds() >= timing.compute.ToNanoseconds() > 0
    assert timing.queue.ToNanoseconds() >= 0


def test_options_default_poses_on_and_can_be_left_out(stub):
    image = image_message(random_images(1)[0])
    default = stub.Classify(pb.ClassifyRequest(images=[image]), timeout=30).results[0]
    assert len(default.poses.values) == 160 and not default.reconstruction.values and not default.top_classes
    without = stub.Classify(pb.ClassifyRequest(images=[image], exclude_poses=True), timeout=30).results[0]
    assert not without.poses.values and not without.poses.shape
    assert list(without.probabilities) == list(default.probabilities)


def test_uint8_tensor_and_png_give_the_same_result(server, stub):
    pixels = RNG.integers(0, 256, (28, 28), dtype=np.uint8)
    as_tensor = image_message(pixels[None])  # (1, 28, 28) uint8
    as_png = pb.Image(encoded=png_bytes(pixels))
    response = stub.Classify(pb.ClassifyRequest(images=[as_tensor, as_png]), timeout=30)
    first, second = response.results
    assert list(first.probabilities) == list(second.probabilities)
    expected = direct(server, (pixels / np.float32(255)).astype(np.float32)[None, None])
    np.testing.assert_allclose(first.probabilities, expected["probabilities"][0], rtol=0, atol=1e-6)


def test_jpeg_is_converted_to_grayscale_and_resized(server, stub):
    rgb = RNG.integers(0, 256, (56, 42, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buffer, format="JPEG", quality=95)
    response = stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=buffer.getvalue())]), timeout=30)
    # The documented conversion: decode, to "L", bilinear resize to 28x28, /255.
    expected_pixels = Image.open(io.BytesIO(buffer.getvalue())).convert("L").resize((28, 28), Image.Resampling.BILINEAR)
    expected = direct(server, (np.asarray(expected_pixels, dtype=np.float32) / 255)[None, None])
    np.testing.assert_allclose(response.results[0].probabilities, expected["probabilities"][0], rtol=0, atol=1e-6)


def test_classify_stream_answers_each_request_in_order(server, stub):
    batches = [random_images(n) for n in (1, 3, 8, 2, 1, 5, 4, 1)]
    requests = [pb.ClassifyRequest(images=[image_message(i) for i in batch], request_id=f"r{k}", top_k=1)
                for k, batch in enumerate(batches)]
    responses = list(stub.ClassifyStream(iter(requests), timeout=60))
    assert [r.request_id for r in responses] == [f"r{k}" for k in range(len(batches))]
    for batch, response in zip(batches, responses):
        expected = direct(server, batch)["probabilities"]
        got = np.array([list(result.probabilities) for result in response.results])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.name, info.version, info.input_name) == ("capsnet", "1", "images")
    assert list(info.input_shape) == [1, 28, 28] and list(info.class_names) == [str(d) for d in range(10)]
    assert info.pose_dim == 16 and list(info.output_names) == ["probabilities", "poses", "reconstruction"]
    assert (info.max_batch_size, info.backend, info.precision) == (8, "onnxruntime", "fp32")
    assert info.routing.variant == "sabour" and info.routing.iterations == 3


def test_python_client(server):
    pixels = RNG.integers(0, 256, (28, 28), dtype=np.uint8)
    with CapsNetClient(server.target) as client:
        assert client.model_info().name == "capsnet"
        from_png, from_array = client.classify([png_bytes(pixels), pixels[None]], reconstruction=True, top_k=2)
    assert from_png.class_index == from_array.class_index
    assert from_png.poses.shape == (10, 16) and from_png.reconstruction.shape == (1, 28, 28)
    assert len(from_png.top_classes) == 2 and from_png.top_classes[0][0] == from_png.class_index
    assert from_png.probability == pytest.approx(float(from_png.probabilities.max()))


def test_python_client_takes_any_bytes_like_image_and_refuses_arrays_of_unknown_scale(server):
    pixels = RNG.integers(0, 256, (28, 28), dtype=np.uint8)
    encoded = png_bytes(pixels)
    with CapsNetClient(server.target) as client:
        answers = client.classify([encoded, bytearray(encoded), memoryview(encoded), pixels[None] / 255.0])  # float64
    assert all(np.allclose(answer.probabilities, answers[0].probabilities, atol=1e-6) for answer in answers)
    for dtype in ("int64", "uint16", "bool"):
        with pytest.raises(TypeError, match=f"uint8 .0-255. or floating point .0-1., got {dtype}"):
            image_message(pixels[None].astype(dtype))


def test_torch_reference_backend_serves_the_same_results(server, model_dir):
    images = random_images(4)
    reference = ServerThread(server_config(model_dir, backend="torch"))
    try:
        assert reference.server.service.spec.backend == "torch"
        assert reference.server.service.spec.platform == "pytorch"  # eager, not TorchScript
        with CapsNetClient(reference.target) as client:
            predictions = client.classify(list(images), reconstruction=True)
        torch_direct = direct(reference, images)
    finally:
        reference.stop()
    got = np.stack([p.probabilities for p in predictions])  # (4, J)
    np.testing.assert_allclose(got, torch_direct["probabilities"], rtol=0, atol=1e-6)
    # The exported graph against its checkpoint: same model, float rounding apart.
    np.testing.assert_allclose(got, direct(server, images)["probabilities"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.stack([p.poses for p in predictions]), direct(server, images)["poses"], rtol=0,
                               atol=1e-4)
