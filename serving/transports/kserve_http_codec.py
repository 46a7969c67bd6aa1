"""KServe v2 REST's inference messages: JSON, with Triton's binary tensor data extension, to and from the data plane's
neutral request and answer (`serving/protocol/kserve.py`).

A request is a JSON object; with the `Inference-Header-Content-Length` header it is that many bytes of JSON followed
by the input's raw little-endian bytes (`parameters.binary_data_size` on the input). Outputs asked with
`parameters.binary_data: true` (or all, with the request's `binary_data_output: true`) are answered the same way, the
others as JSON `data`. JSON with more values than a full batch is refused before it is parsed, and large JSON is
parsed and written off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping

import numpy as np

from capsnet.serving.engine.service import ModelSpec
from capsnet.serving.errors import InvalidInput
from capsnet.serving.protocol import kserve

BINARY_HEADER = "Inference-Header-Content-Length"
# JSON bodies larger than this are parsed, and JSON answers this large written, in a worker thread, as gRPC's typed
# contents are converted: about 10 ms a megabyte that every other call on the event loop would wait for.
INLINE_JSON_BYTES = 64 * 1024
# Commas a request's JSON may hold beyond one per value of a full batch (its other fields). json.loads and numpy hold
# the GIL while they read a body: 1.7 MB of `[[],[],...]` held it 300 ms, so that gRPC health checks timed out.
JSON_FIELD_COMMAS = 1024


_ABSENT = object()  # an input without `data`


class RestDecoder:
    """An infer request's body (inflated) and its Inference-Header-Content-Length, read for the data plane; it keeps
    how each output is to be answered, for encode()."""

    data_where = "inputs[0].data or after the JSON (binary_data_size)"

    def __init__(self, body: bytes, header_length: str | None):
        self._body = body
        self._header_length = header_length
        self._binary = b""  # the binary data after the JSON
        self._parameters: list[Mapping] = []  # each input's parameters
        self._data: list = []  # each input's JSON `data`
        self._binary_default = False  # binary_data_output: outputs not asked otherwise are answered in binary
        self._binary_asked: dict[str, bool] = {}  # requested output -> its binary_data

    async def header(self, spec: ModelSpec) -> kserve.InferHeader:
        text, self._binary = _split_body(self._body, self._header_length)
        max_values = spec.max_batch_size * math.prod(spec.sizes.largest)  # a full batch of the largest images
        if (commas := text.count(b",")) > max_values + JSON_FIELD_COMMAS:
            raise InvalidInput(f"request body: the JSON holds {commas} commas, more than a full batch of "
                               f"{spec.max_batch_size} images has values ({max_values}); send fewer images "
                               "per request, or their data in binary")
        document = await _in_a_thread_if_large(len(text), parse_json, text)
        if not isinstance(document, dict):
            raise InvalidInput(f"request body: expected a JSON object, got {_json_type(document)}")
        if "id" in document and not isinstance(document["id"], str):
            raise InvalidInput(f"id: expected a string, got {_json_type(document['id'])}")
        tensors = _typed(document.get("inputs"), list, "inputs", "a list of input tensors")
        outputs = _typed(document.get("outputs", []), list, "outputs", "a list of requested outputs")
        requested = [_output(output, f"outputs[{index}]") for index, output in enumerate(outputs)]
        self._binary_default = _flag(_typed(document.get("parameters", {}), dict, "parameters", "an object"),
                                     "binary_data_output", "parameters")
        self._binary_asked = {name: _flag(parameters, "binary_data", f"outputs[{index}].parameters",
                                          self._binary_default)
                              for index, (name, parameters) in enumerate(requested)}
        inputs = [_input(tensor, f"inputs[{index}]") for index, tensor in enumerate(tensors)]
        self._parameters = [tensor.parameters for tensor in inputs]
        self._data = [tensor.get("data", _ABSENT) for tensor in tensors]
        return kserve.InferHeader(inputs, requested, document.get("id"))

    def check_data(self, tensor: kserve.InputTensor, shared: bool, index: int = 0) -> None:
        """In `data` or as binary (binary_data_size), not both; neither when in shared memory."""
        parameters, data, field = self._parameters[index], self._data[index], f"inputs[{index}]"
        if shared:
            if data is not _ABSENT or "binary_data_size" in parameters:
                given = "`data`" if data is not _ABSENT else "binary (binary_data_size)"
                raise InvalidInput(f"{field}: data given both in shared memory (parameters.shared_memory_region) "
                                   f"and as {given}; expected one of them")
            if self._binary:
                raise InvalidInput(f"request body: {len(self._binary)} bytes of binary data follow the JSON, but the "
                                   "input is in shared memory")
        elif "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"{field}.parameters.binary_data_size: expected a number of bytes, got {size!r}")
            if data is not _ABSENT:
                raise InvalidInput(f"{field}: data given both in `data` and as binary (binary_data_size); "
                                   "expected one of them")
        elif data is _ABSENT:
            raise InvalidInput(f"{field}: no data; expected `data` or binary data after the JSON (binary_data_size)")

    async def values(self, tensor: kserve.InputTensor, index: int = 0) -> np.ndarray:
        # the inputs' binary data follow the JSON one after another, in the inputs' order
        sizes = [parameters.get("binary_data_size", 0) for parameters in self._parameters]
        if "binary_data_size" in self._parameters[index]:
            size, start = sizes[index], sum(sizes[:index])
            if len(self._binary) != sum(sizes):
                raise InvalidInput(f"inputs[{index}].parameters.binary_data_size: {size} bytes"
                                   f"{f' of {sum(sizes)} declared' if size != sum(sizes) else ''}, but "
                                   f"{len(self._binary)} bytes of binary data follow the JSON ({BINARY_HEADER})")
            return kserve.raw_values(self._binary[start:start + size], tensor, f"inputs[{index}] binary data")
        if self._binary and not any(sizes):
            raise InvalidInput(f"request body: {len(self._binary)} bytes of binary data follow the JSON, but no input "
                               "has parameters.binary_data_size")
        return await _in_a_thread_if_large(tensor.count * 8, _json_values, self._data[index], tensor,
                                           f"inputs[{index}].data")

    async def encode(self, answer: kserve.InferResponse) -> tuple[bytes, str, dict[str, str]]:
        """The answer's body, content type and headers."""
        binary = {output.name for output in answer.outputs if self._binary_asked.get(output.name, self._binary_default)}
        size = sum(output.data.size for output in answer.outputs
                   if output.data is not None and output.name not in binary) * 20  # ~20 B a value
        return await _in_a_thread_if_large(size, _encode, answer, binary)


async def _in_a_thread_if_large(size: int, function, *args):
    """`function(*args)`, in a worker thread when its JSON is `size` bytes or more."""
    if size > INLINE_JSON_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON part of the body and the binary data after it."""
    if header_length is None:
        return body, b""
    length = int(header_length) if header_length.isascii() and header_length.isdigit() else -1  # no sign, space or _
    if not 0 <= length <= len(body):
        raise InvalidInput(f"{BINARY_HEADER}: expected the length of the JSON part, 0 to {len(body)} bytes (the body's "
                           f"size), got {header_length[:40]!r}")
    return body[:length], body[length:]


def parse_json(text: bytes):
    """A request body's JSON; InvalidInput naming the body where it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the interpreter's stack
        raise InvalidInput(f"request body: not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None


def _input(tensor, field: str) -> kserve.InferInput:
    """An input tensor's header from its JSON object."""
    _typed(tensor, dict, field, "an object")
    shape = _typed(tensor.get("shape", []), list, f"{field}.shape", "a list of integers")
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in shape):
        raise InvalidInput(f"{field}.shape: expected a list of integers, got {_describe(shape)}")
    datatype = tensor.get("datatype")
    return kserve.InferInput(_name(tensor, field), datatype if isinstance(datatype, str) else _describe(datatype),
                             shape, _typed(tensor.get("parameters", {}), dict, f"{field}.parameters", "an object"))


def _output(output, field: str) -> kserve.RequestedOutput:
    _typed(output, dict, field, "an object")
    return kserve.RequestedOutput(_name(output, field),
                                  _typed(output.get("parameters", {}), dict, f"{field}.parameters", "an object"))


def _json_values(data, tensor: kserve.InputTensor, field: str) -> np.ndarray:
    """The input's values from JSON `data`: flat, or nested as its shape."""
    count = tensor.count
    try:
        values = np.array(data)
    except ValueError:  # ragged, or nested deeper than numpy's 64 dimensions
        raise InvalidInput(f"{field}: expected a flat list of {count} numbers, or lists nested as the shape "
                           f"{tensor.shape}; got lists of uneven lengths or nested too deep") from None
    kinds = "iuf" if tensor.datatype == "FP32" else "iu"
    expected = {"UINT8": "integers 0..255", "INT64": "integers"}.get(tensor.datatype, "numbers")
    if values.dtype.kind not in kinds or values.ndim == 0:
        kind = {"U": "str", "S": "str", "O": "object"}.get(values.dtype.kind, values.dtype.name)  # not str672
        raise InvalidInput(f"{field}: expected a list of {expected} for datatype {tensor.datatype}, got "
                           f"{'a single value' if values.ndim == 0 else f'values of type {kind}'}")
    if _holds_booleans(data, values.ndim):  # numpy reads [true, 0.5] as [1.0, 0.5]
        raise InvalidInput(f"{field}: expected a list of {expected} for datatype {tensor.datatype}, got true or false "
                           "among them")
    if values.ndim > 1 and list(values.shape) != tensor.shape:
        raise InvalidInput(f"{field}: nested as {list(values.shape)}, expected a flat list or nesting as the shape "
                           f"{tensor.shape}")
    if values.size != count:
        raise InvalidInput(f"{field}: expected {count} values for shape {tensor.shape}, got {values.size}")
    values = values.ravel()
    if tensor.datatype == "UINT8":
        kserve.check_uint8_range(values, field)
    return values.astype(tensor.dtype)


def _holds_booleans(data: list, depth: int) -> bool:
    """Whether JSON `data`, lists nested `depth` deep (evenly: numpy read them as an array), holds true or false."""
    for _ in range(depth - 1):
        data = [item for inner in data for item in inner]
    return any(type(item) is bool for item in data)


def _encode(answer: kserve.InferResponse, binary: set[str]) -> tuple[bytes, str, dict[str, str]]:
    document: dict = {"model_name": answer.model_name, "model_version": answer.model_version}
    if answer.id is not None:
        document["id"] = answer.id
    chunks = []
    document["outputs"] = []
    for answered in answer.outputs:
        output: dict[str, object] = {"name": answered.name, "datatype": answered.datatype,
                                     "shape": list(answered.shape)}
        array = answered.data
        if array is None:  # written into the region the request named
            pass
        elif answered.name in binary:
            raw = kserve.serialize_bytes(array) if answered.datatype == "BYTES" else \
                np.ascontiguousarray(array, dtype="<f4").tobytes()
            chunks.append(raw)
            output["parameters"] = {"binary_data_size": len(raw)}
        elif answered.datatype == "BYTES":
            output["data"] = [item.decode() for item in array.ravel()]
        else:
            output["data"] = array.ravel().tolist()
        document["outputs"].append(output)
    header = json.dumps(document).encode()
    if not chunks:
        return header, "application/json", {}
    return b"".join([header, *chunks]), "application/octet-stream", {BINARY_HEADER: str(len(header))}


def _name(tensor: dict, field: str) -> str:
    return _typed(tensor.get("name"), str, f"{field}.name", "a string")


def _flag(parameters: Mapping, key: str, field: str, default: bool = False) -> bool:
    return _typed(parameters.get(key, default), bool, f"{field}.{key}", "true or false")


def _typed(value, kind: type, field: str, expected: str):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidInput(f"{field}: expected {expected}, got {_json_type(value)}")
    return value


def _describe(value) -> str:
    """A JSON value for a message: as it is (cut) unless it nests lists or objects, which go by their type (their JSON
    could be deeper than the interpreter's recursion limit)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if any(isinstance(item, (list, dict)) for item in items):
        return f"{_json_type(value)} of nested values"
    return json.dumps(value)[:200]


def _json_type(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")
