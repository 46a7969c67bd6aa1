"""Bad KServe v2 requests: each is refused with its status and a message naming the field, and the
server answers a good request correctly right after."""

import math

import grpc
import numpy as np
import pytest

from capsnet.kserve import grpc_service_pb2 as pb
from kserve_messages import images, infer_request, response_arrays

INVALID = grpc.StatusCode.INVALID_ARGUMENT
GOOD = images(2, seed=7)


def with_images(batch: np.ndarray):
    def change(request):
        request.CopyFrom(infer_request(batch, raw=True))
    return change


def set_fields(**fields):
    def change(request):
        for name, value in fields.items():
            setattr(request, name, value)
    return change


def set_input(**fields):
    def change(request):
        for name, value in fields.items():
            setattr(request.inputs[0], name, value)
    return change


def set_shape(shape):
    def change(request):
        request.inputs[0].ClearField("shape")
        request.inputs[0].shape.extend(shape)
    return change


def add_outputs(*names):
    def change(request):
        for name in names:
            request.outputs.add(name=name)
    return change


def with_nan_and_inf(value: float):
    batch = GOOD.copy()
    batch[1, 0, 3, 4] = value
    return with_images(batch)


def typed_and_raw(request):
    request.inputs[0].contents.fp32_contents.extend(GOOD.ravel().tolist())


def drop_input(request):
    request.ClearField("inputs")
    request.ClearField("raw_input_contents")


def truncate_raw(request):
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]


def second_raw_entry(request):
    request.raw_input_contents.append(request.raw_input_contents[0])


def typed_too_few(request):
    request.CopyFrom(infer_request(GOOD, raw=False))
    del request.inputs[0].contents.fp32_contents[-1]


def typed_wrong_field(request):
    request.CopyFrom(infer_request(GOOD, raw=False))
    request.inputs[0].contents.ClearField("fp32_contents")
    request.inputs[0].contents.int_contents.extend([0] * GOOD.size)


def no_data(request):
    request.ClearField("raw_input_contents")


def uint8_over_255(request):
    request.CopyFrom(infer_request(GOOD, raw=False))
    request.inputs[0].datatype = "UINT8"
    request.inputs[0].contents.ClearField("fp32_contents")
    request.inputs[0].contents.uint_contents.extend([256] + [0] * (GOOD.size - 1))


def classification_parameter(request):
    request.outputs.add(name="probabilities").parameters["classification"].int64_param = 0


def shared_memory_parameter(request):
    request.inputs[0].parameters["shared_memory_region"].string_param = "region"


# (id, change to a good raw request, status, substrings the message must contain)
CASES = [
    ("unknown-model", set_fields(model_name="mnist"), grpc.StatusCode.NOT_FOUND,
     ["model_name", "'mnist'", "'capsnet'"]),
    ("unknown-version", set_fields(model_version="7"), grpc.StatusCode.NOT_FOUND, ["model_version", "'7'", "'1'"]),
    ("unknown-output", add_outputs("probabilities", "logits"), INVALID, ["outputs[1].name", "'logits'", "poses"]),
    ("duplicate-output", add_outputs("poses", "poses"), INVALID, ["outputs[1].name", "'poses'", "more than once"]),
    ("output-parameter", classification_parameter, INVALID, ["outputs[0].parameters.classification", ">= 1, got 0"]),
    ("input-parameter", shared_memory_parameter, INVALID, ["inputs[0].parameters", "shared_memory_region"]),
    ("missing-input", drop_input, INVALID, ["inputs:", "exactly 1 input", "'images'", "none"]),
    ("wrong-input-name", set_input(name="pixels"), INVALID, ["inputs[0].name", "'images'", "'pixels'"]),
    ("wrong-datatype", set_input(datatype="FP64"), INVALID, ["inputs[0].datatype", "FP32", "'FP64'"]),
    ("raw-byte-count", truncate_raw, INVALID, ["raw_input_contents[0]", f"expected {GOOD.size * 4} bytes",
                                               f"got {GOOD.size * 4 - 4}"]),
    ("two-raw-entries", second_raw_entry, INVALID, ["raw_input_contents:", "expected 1 entry", "got 2"]),
    ("raw-and-typed", typed_and_raw, INVALID, ["inputs[0].contents", "fp32_contents", "raw_input_contents"]),
    ("no-data", no_data, INVALID, ["inputs[0]", "no data", "fp32_contents", "raw_input_contents"]),
    ("typed-count", typed_too_few, INVALID, ["inputs[0].contents.fp32_contents", f"expected {GOOD.size}",
                                            f"got {GOOD.size - 1}"]),
    ("typed-wrong-field", typed_wrong_field, INVALID, ["inputs[0].contents", "fp32_contents", "int_contents"]),
    ("uint8-over-255", uint8_over_255, INVALID, ["inputs[0].contents.uint_contents", "0..255", "256"]),
    ("negative-dimension", set_shape([-1, 1, 28, 28]), INVALID, ["inputs[0].shape", "[-1, 1, 28, 28]"]),
    ("wrong-shape", set_shape([2, 1, 14, 56]), INVALID,
     ["inputs[0]", "expected shape [N, 1, 28, 28]", "[2, 1, 14, 56]"]),
    ("wrong-rank", set_shape([2, 784]), INVALID, ["inputs[0]", "expected shape [N, 1, 28, 28]", "[2, 784]"]),
    ("nan", with_nan_and_inf(math.nan), INVALID, ["inputs[0]", "NaN"]),
    ("inf", with_nan_and_inf(math.inf), INVALID, ["inputs[0]", "Inf"]),
    ("out-of-range", with_images(GOOD * 3), INVALID, ["inputs[0]", "[0, 1]"]),
    ("empty-batch", with_images(images(0, seed=0)), INVALID, ["inputs[0]", "empty"]),
    ("over-batch-limit", with_images(images(9, seed=0)), INVALID, ["inputs[0]", "9 images", "maximum of 8"]),
    # The declared batch is refused before the contents (here one image's worth) are looked at.
    ("over-batch-before-contents", set_shape([100000, 1, 28, 28]), INVALID,
     ["inputs[0].shape[0]: 100000 images exceed the maximum of 8"]),
]


@pytest.mark.parametrize("change, code, fragments", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_request_is_refused_and_server_carries_on(kserve_stub, run_onnx, change, code, fragments):
    request = infer_request(GOOD, raw=True)
    change(request)
    with pytest.raises(grpc.RpcError) as caught:
        kserve_stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == code, caught.value.details()
    for fragment in fragments:
        assert fragment in caught.value.details()

    arrays = response_arrays(kserve_stub.ModelInfer(infer_request(GOOD, raw=True), timeout=30))
    np.testing.assert_allclose(arrays["probabilities"], run_onnx(GOOD)["probabilities"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rpc, request_type", [("ModelReady", pb.ModelReadyRequest),
                                               ("ModelMetadata", pb.ModelMetadataRequest)])
@pytest.mark.parametrize("fields, fragments", [({"name": "mnist"}, ["name:", "'mnist'", "'capsnet'"]),
                                               ({"name": "capsnet", "version": "2"}, ["version:", "'2'", "'1'"])])
def test_unknown_model_is_not_found(kserve_stub, rpc, request_type, fields, fragments):
    with pytest.raises(grpc.RpcError) as caught:
        getattr(kserve_stub, rpc)(request_type(**fields), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    for fragment in fragments:
        assert fragment in caught.value.details()


@pytest.mark.parametrize("name", ["m" * 20_000, "é" * 20_000])  # é: 2 UTF-8 bytes, 6 once percent-encoded
def test_a_huge_quoted_value_is_cut_so_the_status_still_arrives(kserve_stub, name):
    request = infer_request(GOOD, raw=True)
    request.inputs[0].name = name
    with pytest.raises(grpc.RpcError) as caught:
        kserve_stub.ModelInfer(request, timeout=10)
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details  # not RESOURCE_EXHAUSTED from gRPC
    assert details.startswith(f"inputs[0].name: expected 'images', got '{name[0]}") and details.endswith(f"{name[0]}'")
    assert "bytes cut ...]" in details and len(details.encode()) <= 1500


@pytest.mark.parametrize("name", ["m" * 20_000, "é" * 20_000])
def test_a_huge_model_name_is_refused_quoting_its_start(kserve_stub, name):
    with pytest.raises(grpc.RpcError) as caught:
        kserve_stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (f"name: {name[:40]!r} (cut from 20000 characters) is not a model name: expected "
                                      "1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit")
