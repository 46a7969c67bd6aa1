"""Every kind of bad request gets INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) with a message naming the
field and what was expected, and the server answers the next good request correctly."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import shutil
import struct
import zlib

import grpc
import numpy as np
import pytest
from PIL import Image
from serving_helpers import ServerThread, server_config

from capsnet.client.api import image_message
from capsnet.serving.protocol.images import PNG_SIGNATURE
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

GOOD = np.random.default_rng(1).random((1, 28, 28), dtype=np.float32)  # (1, 28, 28)


def tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=(1, 28, 28), data=None) -> pb.Image:
    data = GOOD.tobytes() if data is None else data
    return pb.Image(tensor=pb.Tensor(dtype=dtype, shape=shape, data=data))


def with_value(value: float, index: int = 300) -> pb.Image:
    image = GOOD.copy()
    image.flat[index] = value
    return image_message(image)


def png(width: int, height: int, mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def png_16bit_rgb(width: int, height: int) -> bytes:
    """A valid 16-bit RGB PNG (Pillow cannot write one): signature, IHDR, IDAT, IEND."""
    rows = b"".join(b"\0" + bytes(range(256))[:6 * width].ljust(6 * width, b"\x80") for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)  # bit depth 16, colour type 2 (RGB)
    return (PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(rows))
            + png_chunk(b"IEND", b""))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def text_chunk_first(data: bytes) -> bytes:
    """The PNG `data` with a tEXt chunk between its signature and its IHDR."""
    return PNG_SIGNATURE + png_chunk(b"tEXt", b"Comment\0first") + data[len(PNG_SIGNATURE):]


def png_header_only(width: int, height: int) -> bytes:
    """A grey PNG declaring width x height, with no pixels: the header is all a size check may read."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IEND", b"")


CASES = {
    "wrong shape": ([tensor(shape=(1, 27, 28))],
                    "images[0].tensor.shape: expected [1, 28, 28] (the model's C, H, W), got [1, 27, 28]"),
    "wrong rank": ([tensor(shape=(28, 28))], "images[0].tensor.shape: expected [1, 28, 28]"),
    "unset dtype": ([tensor(dtype=pb.DATA_TYPE_UNSPECIFIED)],
                    "images[0].tensor.dtype: expected DATA_TYPE_UINT8 or DATA_TYPE_FLOAT32, got DATA_TYPE_UNSPECIFIED"),
    "unknown dtype": ([tensor(dtype=7)],
                      "images[0].tensor.dtype: expected DATA_TYPE_UINT8 or DATA_TYPE_FLOAT32, got 7"),
    "byte count": ([image_message(GOOD), tensor(data=b"\0" * 100)],
                   "images[1].tensor.data: expected 3136 bytes for DATA_TYPE_FLOAT32 shape [1, 28, 28], got 100"),
    "uint8 byte count": ([tensor(dtype=pb.DATA_TYPE_UINT8)],
                         "images[0].tensor.data: expected 784 bytes for DATA_TYPE_UINT8 shape [1, 28, 28], got 3136"),
    "undecodable": ([pb.Image(encoded=b"certainly not a PNG")],
                    "images[0].encoded: cannot decode (19 bytes): expected a PNG or JPEG"),
    "truncated png": ([pb.Image(encoded=png(28, 28)[:40])], "images[0].encoded: cannot decode (40 bytes)"),
    "decompression bomb": ([pb.Image(encoded=png(5000, 5000))], "images[0].encoded: a 5000x5000 image is too large"),
    "over pillow's pixel limit": ([pb.Image(encoded=png_header_only(60000, 60000))],
                                  "images[0].encoded: a 60000x60000 image is too large; expected at most 224x224"),
    "over 8x the model's size": ([pb.Image(encoded=png(225, 28))],
                                 "images[0].encoded: a 225x28 image is too large; expected at most 224x224 "
                                 "(8x the model's 28x28, --max-image-scale)"),
    "16-bit grey png": ([pb.Image(encoded=png(28, 28, "I;16"))],
                        "images[0].encoded: a 16-bit PNG; expected an 8-bit PNG"),
    "16-bit rgb png": ([pb.Image(encoded=png_16bit_rgb(28, 28))],
                       "images[0].encoded: a 16-bit PNG; expected an 8-bit PNG"),
    # Pillow reads a PNG whose IHDR is not its first chunk; the bit depth is then not at a fixed offset
    "16-bit png, a chunk before ihdr": ([pb.Image(encoded=text_chunk_first(png(28, 28, "I;16")))],
                                        "images[0].encoded: a 16-bit PNG; expected an 8-bit PNG"),
    "no data": ([pb.Image()], "images[0]: no data; expected encoded (PNG/JPEG bytes) or tensor"),
    "empty batch": ([], "images: empty batch; expected 1 to 8 images"),
    "batch over limit": ([image_message(GOOD)] * 9, "images: 9 images exceed the maximum of 8 per request"),
    "nan": ([image_message(GOOD), with_value(np.nan)],
            "images: image 1 contains NaN or Inf; expected finite values in [0, 1]"),
    "inf": ([with_value(np.inf)], "images: image 0 contains NaN or Inf"),
    "out of range": ([with_value(1.5)], "images: image 0 has values in [0"),
    "negative": ([with_value(-0.25)], "images: image 0 has values in [-0.25"),
}


def assert_still_answers(server, stub) -> None:
    response = stub.Classify(pb.ClassifyRequest(images=[image_message(GOOD)]), timeout=30)
    expected = server.server.service.backend.run(GOOD[None].copy())["probabilities"][0]
    np.testing.assert_allclose(response.results[0].probabilities, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_bad_request_is_invalid_argument(server, stub, case):
    images, message = CASES[case]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(pb.ClassifyRequest(images=images), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert message in caught.value.details()
    assert_still_answers(server, stub)


def test_decode_errors_name_no_python_objects(server, stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=b"certainly not a PNG")]), timeout=30)
    assert caught.value.details() == "images[0].encoded: cannot decode (19 bytes): expected a PNG or JPEG file"


def test_image_within_the_scale_but_over_pillows_pixel_limit_is_too_large(model_dir):
    # 20000x20000 is within 1000x the model's 28x28, yet Pillow refuses its 400 M pixels as a decompression bomb
    running = ServerThread(server_config(model_dir, max_image_scale=1000, max_message_bytes=1_000_000))
    try:
        with grpc.insecure_channel(running.target) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                capsnet_pb2_grpc.CapsNetServiceStub(channel).Classify(
                    pb.ClassifyRequest(images=[pb.Image(encoded=png_header_only(20000, 20000))]), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == ("images[0].encoded: a 20000x20000 image is too large; expected at most "
                                          f"{2 * Image.MAX_IMAGE_PIXELS} pixels (the image decoder's limit)")
    finally:
        running.stop()


def test_top_k_over_classes(server, stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(pb.ClassifyRequest(images=[image_message(GOOD)], top_k=11), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "top_k: expected 0 to 10 (the number of classes), got 11"
    assert_still_answers(server, stub)


def test_oversized_message_is_rejected_cleanly(server, stub):
    too_big = pb.Image(encoded=b"\0" * (16 * 1024 * 1024 + 1))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(pb.ClassifyRequest(images=[too_big]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in caught.value.details()
    assert_still_answers(server, stub)


def test_bad_request_in_a_stream_ends_it_with_its_status(server, stub):
    good = pb.ClassifyRequest(images=[image_message(GOOD)], request_id="good")
    bad = pb.ClassifyRequest(images=[tensor(shape=(3, 28, 28))], request_id="bad")
    call = stub.ClassifyStream(iter([good, bad, good]), timeout=30)
    assert next(call).request_id == "good"
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[0].tensor.shape: expected [1, 28, 28]" in caught.value.details()
    assert_still_answers(server, stub)


def test_a_stream_ended_by_an_error_leaves_no_unretrieved_errors(server, stub, caplog):
    """Requests after the failing one may fail too before the stream ends (here while the first one computes):
    the handler drops their errors on purpose, rather than leaving them for asyncio to log as "exception was
    never retrieved" when the tasks are freed."""
    good = pb.ClassifyRequest(images=[image_message(GOOD)] * 8, request_id="good")  # computes while the rest fail
    bad = [pb.ClassifyRequest(images=[tensor(shape=(3, 28, 28))], request_id=f"bad{i}") for i in range(4)]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.ClassifyStream(iter([good, *bad]), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server.call(asyncio.sleep(0.2))  # the handler's cleanup runs on the server's loop
    gc.collect()
    server.call(asyncio.sleep(0.1))  # asyncio reports unretrieved errors through the loop's handler
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert_still_answers(server, stub)


def test_reconstruction_of_a_model_exported_without_it(model_dir, tmp_path):
    # The same graph, but model.json serves only probabilities and poses, as an export without --reconstruction
    # (which writes no decoder either).
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    sidecar = json.loads((copy / "model.json").read_text())
    sidecar["outputs"] = [o for o in sidecar["outputs"] if o["name"] != "reconstruction"]
    sidecar["decoder"] = None
    (copy / "model.json").write_text(json.dumps(sidecar))
    running = ServerThread(server_config(copy))
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Classify(pb.ClassifyRequest(images=[image_message(GOOD)], include_reconstruction=True), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(
                "reconstruction: this model was exported without the reconstruction output")
            result = stub.Classify(pb.ClassifyRequest(images=[image_message(GOOD)]), timeout=30).results[0]
            assert len(result.poses.values) == 160 and not result.reconstruction.values
    finally:
        running.stop()
