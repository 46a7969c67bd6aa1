"""KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`).

A thin adapter onto the shared request path (`InferenceService`): it turns a `ModelInferRequest`
into an image batch, lets the service validate and infer it, and turns the result back into a
`ModelInferResponse`. One model is served, under the name and version in its model.json.

Inputs: one tensor named like the model input (`images`), shape [N, C, H, W], datatype FP32
(values in [0, 1]) or UINT8 (scaled by 1/255), given either typed (`contents`) or raw
(`raw_input_contents`, little-endian). Outputs are answered in the same form as the input.
Request-level parameters are ignored; tensor parameters (shared memory, classification) are refused.
"""

from __future__ import annotations

import functools
import math
import time

import grpc
import numpy as np

from capsnet import __version__
from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.serving.service import InferenceService, ModelSpec, ServingError

SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "capsnet-serve"

# datatype -> (little-endian numpy dtype of the raw bytes, InferTensorContents field of typed data)
_INPUT_DATATYPES = {
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "UINT8": (np.dtype("u1"), "uint_contents"),
}


def add_to_server(server: grpc.aio.Server, service: InferenceService) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service), server)


def _aborts_on_serving_error(handler):
    """Answer a `ServingError` raised by the handler with its gRPC status and message."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except ServingError as err:
            await context.abort(err.code, err.message)

    return wrapper


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService):
        self._service = service

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._service.ready)

    @_aborts_on_serving_error
    async def ModelReady(self, request, context):
        _check_model(self._service.spec, request.name, request.version, "name", "version")
        return pb.ModelReadyResponse(ready=self._service.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=[])

    @_aborts_on_serving_error
    async def ModelMetadata(self, request, context):
        spec = self._service.spec
        _check_model(spec, request.name, request.version, "name", "version")
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=spec.name,
            versions=[spec.version],
            platform=spec.platform,
            inputs=[tensor(name=spec.input_name, datatype="FP32", shape=[-1, *spec.input_shape])],
            outputs=[tensor(name=name, datatype="FP32", shape=[-1, *shape])
                     for name, shape in _output_shapes(spec).items()],
        )

    @_aborts_on_serving_error
    async def ModelInfer(self, request, context):
        spec = self._service.spec
        _check_model(spec, request.model_name, request.model_version, "model_name", "model_version")
        images = self._service.validate_images(_input_images(request, spec), "inputs[0]")
        names = _requested_outputs(request, spec)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        result = await self._service.infer(images, reconstruction="reconstruction" in names, deadline=deadline)
        arrays = {"probabilities": result.probabilities, "poses": result.poses,
                  "reconstruction": result.reconstruction}
        return _response(request, spec, {name: arrays[name] for name in names})


def _check_model(spec: ModelSpec, name: str, version: str, name_field: str, version_field: str) -> None:
    if name != spec.name:
        raise ServingError(grpc.StatusCode.NOT_FOUND,
                           f"{name_field}: unknown model {name!r}; this server serves {spec.name!r}")
    if version not in ("", spec.version):
        raise ServingError(grpc.StatusCode.NOT_FOUND,
                           f"{version_field}: model {spec.name!r} has no version {version!r}; "
                           f"expected '' or {spec.version!r}")


def _output_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape without the batch axis of every output the model serves, in serving order."""
    channels, height, width = spec.input_shape
    classes = len(spec.class_names)
    shapes = {"probabilities": (classes,), "poses": (classes, spec.pose_dim),
              "reconstruction": (channels * height * width,)}
    return {name: shapes[name] for name in spec.output_names}


def _invalid(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _refuse_parameters(parameters, field: str) -> None:
    if parameters:
        raise _invalid(f"{field}.parameters: expected none (no shared memory or classification here), "
                       f"got {', '.join(sorted(parameters))}")


def _input_images(request: pb.ModelInferRequest, spec: ModelSpec) -> np.ndarray:
    """The one input tensor as a float32 array of its declared shape (not yet validated)."""
    if len(request.inputs) != 1:
        got = ", ".join(repr(tensor.name) for tensor in request.inputs) or "none"
        raise _invalid(f"inputs: expected exactly 1 input named {spec.input_name!r}, got {got}")
    tensor = request.inputs[0]
    if tensor.name != spec.input_name:
        raise _invalid(f"inputs[0].name: expected {spec.input_name!r}, got {tensor.name!r}")
    if tensor.datatype not in _INPUT_DATATYPES:
        raise _invalid(f"inputs[0].datatype: expected one of {', '.join(_INPUT_DATATYPES)}, got {tensor.datatype!r}")
    _refuse_parameters(tensor.parameters, "inputs[0]")
    shape = list(tensor.shape)
    if min(shape, default=0) < 0:
        raise _invalid(f"inputs[0].shape: dimensions must be >= 0, got {shape}")
    count = math.prod(shape)
    dtype, typed_field = _INPUT_DATATYPES[tensor.datatype]
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    if request.raw_input_contents:
        if typed:
            raise _invalid(f"inputs[0].contents: data given both typed ({typed[0]}) and in raw_input_contents; "
                           "expected one of them")
        values = _raw_values(request.raw_input_contents, dtype, count, tensor.datatype, shape)
    elif typed and typed != [typed_field]:
        raise _invalid(f"inputs[0].contents: datatype {tensor.datatype} expects {typed_field}, "
                       f"got {', '.join(typed)}")
    elif not typed and count:
        raise _invalid(f"inputs[0]: no data; expected contents.{typed_field} or raw_input_contents[0]")
    else:
        values = _typed_values(getattr(tensor.contents, typed_field), f"inputs[0].contents.{typed_field}",
                               dtype, count, shape)
    images = values.reshape(shape)
    if tensor.datatype == "UINT8":
        return images.astype(np.float32) / np.float32(255)
    return images.astype(np.float32, copy=False)


def _raw_values(raw, dtype: np.dtype, count: int, datatype: str, shape: list[int]) -> np.ndarray:
    if len(raw) != 1:
        raise _invalid(f"raw_input_contents: expected 1 entry (one per input), got {len(raw)}")
    expected = count * dtype.itemsize
    if len(raw[0]) != expected:
        raise _invalid(f"raw_input_contents[0]: expected {expected} bytes for {datatype} shape {shape} "
                       f"({count} elements x {dtype.itemsize} bytes), got {len(raw[0])}")
    return np.frombuffer(raw[0], dtype=dtype)


def _typed_values(contents, field: str, dtype: np.dtype, count: int, shape: list[int]) -> np.ndarray:
    if len(contents) != count:
        raise _invalid(f"{field}: expected {count} values for shape {shape}, got {len(contents)}")
    if dtype == np.uint8:
        wide = np.array(contents, dtype=np.uint32)
        if count and wide.max() > 255:
            raise _invalid(f"{field}: UINT8 values must be in 0..255, got {int(wide.max())}")
        return wide.astype(dtype)
    return np.array(contents, dtype=dtype)


def _requested_outputs(request: pb.ModelInferRequest, spec: ModelSpec) -> list[str]:
    """Names of the outputs to answer, in request order; all the model serves when none are named."""
    if not request.outputs:
        return list(spec.output_names)
    names = []
    for index, output in enumerate(request.outputs):
        field = f"outputs[{index}]"
        if output.name not in spec.output_names:
            raise _invalid(f"{field}.name: unknown output {output.name!r}; expected one of "
                           f"{', '.join(spec.output_names)}")
        if output.name in names:
            raise _invalid(f"{field}.name: output {output.name!r} is requested more than once")
        _refuse_parameters(output.parameters, field)
        names.append(output.name)
    return names


def _response(request: pb.ModelInferRequest, spec: ModelSpec, arrays: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    """Outputs raw when the input came raw (as tritonclient expects), typed otherwise."""
    response = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
    raw = bool(request.raw_input_contents)
    for name, array in arrays.items():
        output = response.outputs.add(name=name, datatype="FP32", shape=array.shape)
        if raw:
            response.raw_output_contents.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
        else:
            output.contents.fp32_contents.extend(array.ravel().tolist())
    return response
