"""Bad KServe v2 REST requests (serving/transports/kserve_http.py), against a real server on loopback: each is answered
with its HTTP status and a JSON {"error": ...} naming the field, counted, and the server answers a good request
correctly right after."""

import copy
import gzip
import http.client
import json

import numpy as np
import pytest
from kserve_messages import MAX_BATCH_SIZE, images
from serving_helpers import metric, scrape

BINARY_HEADER = "Inference-Header-Content-Length"
INFER = "/v2/models/capsnet/infer"
GOOD = images(2, seed=41)  # (2, 1, 28, 28)
COUNT = GOOD.size  # 1568 values
RAW = GOOD.astype("<f4").tobytes()  # 6272 bytes


IMAGE_VALUES = COUNT // len(GOOD)  # 784
# Empty lists, one more than a full batch's values and the fields' allowance of commas: refused before parsing.
MANY_LISTS = (b'{"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28], "data": ['
              + b",".join([b"[]"] * (MAX_BATCH_SIZE * IMAGE_VALUES + 1024 + 1)) + b"]}]}")


def call(port: int, body: bytes, headers=None, path: str = INFER):
    """(status, headers, body) of a POST on a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def good_request() -> dict:
    return {"inputs": [{"name": "images", "datatype": "FP32", "shape": list(GOOD.shape),
                        "data": GOOD.ravel().tolist()}]}


def changed(change) -> tuple[bytes, dict]:
    """A good JSON request, changed by `change(document)` (which may return a new document)."""
    document = good_request()
    document = change(document) or document
    return json.dumps(document).encode(), {}


def with_input(**fields):
    return changed(lambda document: document["inputs"][0].update(fields))


def with_data(data, datatype="FP32", shape=None):
    return with_input(data=data, datatype=datatype, shape=shape or list(GOOD.shape))


def with_outputs(*outputs):
    return changed(lambda document: document.update(outputs=list(outputs)))


def binary(raw: bytes, size: int | None, *, json_data: bool = False, header_length: str | None = None):
    """The input as binary data: `raw` after the JSON, declared as `size` bytes (None: binary_data_size absent)."""
    tensor = {"name": "images", "datatype": "FP32", "shape": list(GOOD.shape)}
    if size is not None:
        tensor["parameters"] = {"binary_data_size": size}
    if json_data:
        tensor["data"] = GOOD.ravel().tolist()
    header = json.dumps({"inputs": [tensor]}).encode()
    return header + raw, {BINARY_HEADER: header_length or str(len(header))}


def uint8(values: list):
    return with_data(values + [0] * (COUNT - len(values)), datatype="UINT8")


def unencodable(value: str):
    """GOOD with one value replaced by a JSON token such as NaN (which Python's json reads and writes)."""
    values = GOOD.copy()
    values[1, 0, 3, 4] = float(value)
    return changed(lambda document: document["inputs"][0].update(data=values.ravel().tolist()))


def drop_data(document):
    del document["inputs"][0]["data"]


def nested_as(shape):
    return with_data(GOOD.reshape(shape).tolist())


# (id, (body, headers), HTTP status, the exact error, or a tuple of fragments it must contain)
CASES = [
    ("not-json", (b'{"inputs": [', {}), 400, ("request body: not valid JSON (JSONDecodeError: ",)),
    ("not-an-object", (b"[1, 2]", {}), 400, "request body: expected a JSON object, got a list"),
    ("no-inputs", (b"{}", {}), 400, "inputs: expected a list of input tensors, got null"),
    ("inputs-not-a-list", changed(lambda d: {"inputs": d["inputs"][0]}), 400,
     "inputs: expected a list of input tensors, got an object"),
    ("two-inputs", changed(lambda d: d["inputs"].append(copy.deepcopy(d["inputs"][0]))), 400,
     "inputs: expected exactly 1 input named 'images', got 'images', 'images'"),
    ("no-input", changed(lambda d: d.update(inputs=[])), 400,
     "inputs: expected exactly 1 input named 'images', got none"),
    ("wrong-input-name", with_input(name="pixels"), 400, "inputs[0].name: expected 'images', got 'pixels'"),
    ("fp64", with_input(datatype="FP64"), 400, "inputs[0].datatype: expected one of FP32, UINT8, got 'FP64'"),
    ("datatype-not-a-string", with_input(datatype=32), 400,
     "inputs[0].datatype: expected one of FP32, UINT8, got '32'"),
    ("shape-not-a-list", with_input(shape="2,1,28,28"), 400,
     "inputs[0].shape: expected a list of integers, got a string"),
    ("shape-with-a-string", with_input(shape=[2, 1, 28, "28"]), 400,
     'inputs[0].shape: expected a list of integers, got [2, 1, 28, "28"]'),
    ("shape-with-a-float", with_input(shape=[2.0, 1, 28, 28]), 400,
     "inputs[0].shape: expected a list of integers, got [2.0, 1, 28, 28]"),
    ("shape-with-a-bool", with_input(shape=[2, True, 28, 28]), 400,
     "inputs[0].shape: expected a list of integers, got [2, true, 28, 28]"),
    ("negative-dimension", with_input(shape=[-2, 1, 28, 28]), 400,
     "inputs[0].shape: dimensions must be >= 0, got [-2, 1, 28, 28]"),
    ("wrong-dims", with_input(shape=[2, 784]), 400, "inputs[0].shape: expected shape [N, 1, 28, 28], got [2, 784]"),
    ("wrong-image-size", with_input(shape=[2, 1, 14, 56]), 400,
     "inputs[0].shape: expected shape [N, 1, 28, 28], got [2, 1, 14, 56]"),
    ("empty-batch", with_data([], shape=[0, 1, 28, 28]), 400,
     "inputs[0].shape[0]: empty batch; expected 1 to 8 images"),
    ("over-the-batch-limit", with_data(images(MAX_BATCH_SIZE + 1, seed=0).ravel().tolist(), shape=[9, 1, 28, 28]), 400,
     "inputs[0].shape[0]: 9 images exceed the maximum of 8 per request; split them over several requests"),
    # the declared batch is refused before the data (one image's worth) is looked at
    ("over-the-batch-limit-before-data", with_data(GOOD[0].ravel().tolist(), shape=[100000, 1, 28, 28]), 400,
     "inputs[0].shape[0]: 100000 images exceed the maximum of 8 per request; split them over several requests"),
    ("too-few-values", with_data(GOOD.ravel().tolist()[:-1]), 400,
     "inputs[0].data: expected 1568 values for shape [2, 1, 28, 28], got 1567"),
    ("ragged", with_data([[0.1, 0.2], [0.3]]), 400,
     "inputs[0].data: expected a flat list of 1568 numbers, or lists nested as the shape [2, 1, 28, 28]; got lists of "
     "uneven lengths or nested too deep"),
    ("nested-as-another-shape", nested_as((2, 784)), 400,
     "inputs[0].data: nested as [2, 784], expected a flat list or nesting as the shape [2, 1, 28, 28]"),
    ("strings", with_data(["0.5"] * COUNT), 400,
     ("inputs[0].data: expected a list of numbers for datatype FP32, got values of type str",)),
    ("nulls", with_data([None] * COUNT), 400,
     "inputs[0].data: expected a list of numbers for datatype FP32, got values of type object"),
    ("a-single-value", with_data(0.5), 400,
     "inputs[0].data: expected a list of numbers for datatype FP32, got a single value"),
    ("uint8-300", uint8([300]), 400, "inputs[0].data: UINT8 values must be in 0..255, got 300"),
    ("uint8-minus-1", uint8([7, -1]), 400, "inputs[0].data: UINT8 values must be in 0..255, got -1"),
    ("uint8-floats", with_data(GOOD.ravel().tolist(), datatype="UINT8"), 400,
     "inputs[0].data: expected a list of integers 0..255 for datatype UINT8, got values of type float64"),
    ("nan", unencodable("NaN"), 400, "inputs[0]: image 1 contains NaN or Inf; expected finite values in [0, 1]"),
    ("infinity", unencodable("Infinity"), 400,
     "inputs[0]: image 1 contains NaN or Inf; expected finite values in [0, 1]"),
    ("out-of-range", with_data((GOOD * 3).ravel().tolist()), 400,
     ("inputs[0]: image 0 has values in [", "]; expected [0, 1] (divide 8-bit pixels by 255, or send them as uint8)")),
    ("binary-size-mismatch", binary(RAW[:-4], len(RAW)), 400,
     "inputs[0].parameters.binary_data_size: 6272 bytes, but 6268 bytes of binary data follow the JSON "
     "(Inference-Header-Content-Length)"),
    ("binary-too-short-for-the-shape", binary(RAW[:-4], len(RAW) - 4), 400,
     "inputs[0] binary data: expected 6272 bytes for FP32 shape [2, 1, 28, 28] (1568 elements x 4 bytes), got 6268"),
    ("binary-size-not-a-number", binary(RAW, "6272"), 400,
     "inputs[0].parameters.binary_data_size: expected a number of bytes, got '6272'"),
    ("header-length-not-a-number", binary(RAW, len(RAW), header_length="12 bytes"), 400,
     ("Inference-Header-Content-Length: expected the length of the JSON part, 0 to ", " bytes (the body's size), "
      "got '12 bytes'")),
    ("header-length-over-the-body", binary(RAW, len(RAW), header_length="99999"), 400,
     ("Inference-Header-Content-Length: expected the length of the JSON part, 0 to ", "got '99999'")),
    ("header-length-negative", binary(RAW, len(RAW), header_length="-1"), 400,
     ("Inference-Header-Content-Length: expected the length of the JSON part", "got '-1'")),
    ("header-length-signed", binary(RAW, len(RAW), header_length="+12"), 400,
     ("Inference-Header-Content-Length: expected the length of the JSON part", "got '+12'")),
    ("header-length-with-underscore", binary(RAW, len(RAW), header_length="1_2"), 400,
     ("Inference-Header-Content-Length: expected the length of the JSON part", "got '1_2'")),
    ("binary-without-binary-data-size", binary(RAW[:16], None, json_data=True), 400,
     "request body: 16 bytes of binary data follow the JSON, but no input has parameters.binary_data_size"),
    ("data-and-binary", binary(RAW, len(RAW), json_data=True), 400,
     "inputs[0]: data given both in `data` and as binary (binary_data_size); expected one of them"),
    ("no-data", changed(drop_data), 400,
     "inputs[0]: no data; expected `data` or binary data after the JSON (binary_data_size)"),
    ("shared-memory-input-and-data", with_input(parameters={"shared_memory_region": "region",
                                                           "shared_memory_byte_size": 6272}),
     400, "inputs[0]: data given both in shared memory (parameters.shared_memory_region) and as `data`; expected one "
          "of them"),
    ("shared-memory-output-alone", with_outputs({"name": "poses", "parameters": {"shared_memory_region": "region"}}),
     400, "outputs[0].parameters: shared memory needs shared_memory_region and shared_memory_byte_size "
          "(shared_memory_offset is optional), got shared_memory_region"),
    ("classification-count", with_outputs({"name": "probabilities", "parameters": {"classification": "3"}}), 400,
     "outputs[0].parameters.classification: expected a number of classes >= 1, got '3'"),
    ("unknown-output", with_outputs({"name": "probabilities"}, {"name": "logits"}), 400,
     "outputs[1].name: unknown output 'logits'; expected one of probabilities, poses, reconstruction"),
    ("output-twice", with_outputs({"name": "poses"}, {"name": "poses"}), 400,
     "outputs[1].name: output 'poses' is requested more than once"),
    ("output-without-a-name", with_outputs({"parameters": {}}), 400, "outputs[0].name: expected a string, got null"),
    ("outputs-not-a-list", changed(lambda d: d.update(outputs={"name": "poses"})), 400,
     "outputs: expected a list of requested outputs, got an object"),
    ("binary-data-not-a-bool", with_outputs({"name": "poses", "parameters": {"binary_data": "yes"}}), 400,
     "outputs[0].parameters.binary_data: expected true or false, got a string"),
    ("binary-data-output-not-a-bool", changed(lambda d: d.update(parameters={"binary_data_output": 1})), 400,
     "parameters.binary_data_output: expected true or false, got a number"),
    ("id-not-a-string", changed(lambda d: d.update(id=7)), 400, "id: expected a string, got a number"),
    # More values than a full batch holds are refused before the JSON is parsed (parsing holds the GIL)
    ("more-json-values-than-a-full-batch", (MANY_LISTS, {}), 400,
     f"request body: the JSON holds {MANY_LISTS.count(b',')} commas, more than a full batch of {MAX_BATCH_SIZE} "
     f"images has values ({MAX_BATCH_SIZE * IMAGE_VALUES}); send fewer images per request, or their data in binary"),
    # values nested deeper than the interpreter could print back
    ("shape-nested", with_input(shape=[[[[1]]]]), 400,
     "inputs[0].shape: expected a list of integers, got a list of nested values"),
    ("datatype-nested", with_input(datatype={"a": [1]}), 400,
     "inputs[0].datatype: expected one of FP32, UINT8, got 'an object of nested values'"),
    # compressed bodies
    ("gzip-garbage", (b"garbage", {"Content-Encoding": "gzip"}), 400,
     ("request body: not valid gzip data (",)),
    ("gzip-truncated", (gzip.compress(changed(lambda d: None)[0])[:-8], {"Content-Encoding": "gzip"}), 400,
     "request body: not one complete gzip stream"),
    ("deflate-garbage", (b"garbage", {"Content-Encoding": "deflate"}), 400,
     ("request body: not valid deflate data (",)),
    ("encoding-not-taken", (b"{}", {"Content-Encoding": "br"}), 415,
     "Content-Encoding 'br' is not taken; send the body as is, or as gzip or deflate"),
    # JSON true and false are not numbers (a list of them only is refused), even among numbers
    ("fp32-true-among-numbers", with_data([True, *GOOD.ravel().tolist()[1:]]), 400,
     "inputs[0].data: expected a list of numbers for datatype FP32, got true or false among them"),
    ("uint8-false-among-integers", uint8([3, False]), 400,
     "inputs[0].data: expected a list of integers 0..255 for datatype UINT8, got true or false among them"),
]


@pytest.fixture(scope="module")
def port(kserve_rest) -> int:
    return kserve_rest.server.http_port


def assert_good_request_answered(port: int, run_onnx) -> None:
    status, _headers, body = call(port, *changed(lambda d: d.update(outputs=[{"name": "probabilities"}])))
    assert status == 200, body
    probabilities = json.loads(body)["outputs"][0]
    assert (probabilities["name"], probabilities["shape"]) == ("probabilities", [2, 10])
    np.testing.assert_allclose(np.array(probabilities["data"], np.float32).reshape(2, 10),
                               run_onnx(GOOD)["probabilities"], rtol=1e-4, atol=1e-5)


def invalid_count(samples) -> float:
    return metric(samples, "capsnet_requests_total", api="kserve_http", method="ModelInfer", code="INVALID_ARGUMENT")


def case_param(case):
    if hasattr(case, "marks"):  # a pytest.param with marks: its first value is the id
        return pytest.param(*case.values[1:], id=case.values[0], marks=case.marks)
    return pytest.param(*case[1:], id=case[0])


@pytest.mark.parametrize("request_, status, expected", [case_param(case) for case in CASES])
def test_bad_request_is_refused_with_a_json_error_and_the_server_carries_on(kserve_rest, port, run_onnx, request_,
                                                                            status, expected):
    before = invalid_count(scrape(kserve_rest.metrics_url))
    answer_status, headers, body = call(port, *request_)
    assert answer_status == status, body
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(body)
    assert list(error) == ["error"]
    if isinstance(expected, str):
        assert error["error"] == expected
    else:
        for fragment in expected:
            assert fragment in error["error"], error["error"]
    assert invalid_count(scrape(kserve_rest.metrics_url)) - before == 1
    assert_good_request_answered(port, run_onnx)


def test_a_body_over_max_message_bytes_is_413(kserve_rest, port, run_onnx):
    limit = kserve_rest.server.max_message_bytes
    before = scrape(kserve_rest.metrics_url)
    status, _, body = call(port, b" " * (limit + 1), {"Content-Type": "application/json"})
    assert (status, json.loads(body)) == (413, {"error": (
        f"the request body exceeds the server's limit of {limit} bytes (--max-message-bytes); send fewer images per "
        "request, or their data in binary")})
    after = scrape(kserve_rest.metrics_url)
    exhausted = {"api": "kserve_http", "method": "ModelInfer", "code": "RESOURCE_EXHAUSTED"}
    assert metric(after, "capsnet_requests_total", **exhausted) \
        - metric(before, "capsnet_requests_total", **exhausted) == 1
    # exactly the limit is read, and parsed
    status, _, body = call(port, b" " * limit, {"Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"].startswith("request body: not valid JSON")
    assert_good_request_answered(port, run_onnx)
