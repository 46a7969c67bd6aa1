"""KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`).

A thin adapter onto the shared request path (`InferenceService`): it turns a `ModelInferRequest`
into an image batch, lets the service validate and infer it, and turns the result back into a
`ModelInferResponse`. One model is served, under the name and version in its model.json.

Inputs: one tensor named like the model input (`images`), shape [N, C, H, W], datatype FP32
(values in [0, 1]) or UINT8 (scaled by 1/255), given either typed (`contents`) or raw
(`raw_input_contents`, little-endian). Outputs are answered in the same form as the input.
Request-level parameters are ignored. Of the tensor parameters, those Triton acts on and this server cannot
(shared memory, classification) are refused; any other is ignored, as Triton does (the KServe Python SDK sends
`binary_data_size` with every input).
Triton's ModelConfig extension is answered too (the model's config as Triton's model_config.proto has it), which
perf_analyzer and model_analyzer ask first.
The batch size is checked from the declared shape before any contents are read, and large contents are
converted off the event loop. Errors are `serving/errors.py` kinds; the interceptor makes them statuses.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import grpc
import numpy as np

from capsnet import __version__
from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.kserve import model_config_pb2 as config_pb
from capsnet.serving.errors import InvalidInput, ModelNotFound
from capsnet.serving.service import InferenceService, ModelSpec

SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "capsnet-serve"

# datatype -> (little-endian numpy dtype of the raw bytes, InferTensorContents field of typed data)
_INPUT_DATATYPES = {
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "UINT8": (np.dtype("u1"), "uint_contents"),
}
# Tensor parameters that Triton's gRPC endpoint acts on, which this server cannot: refused, so that no client is
# answered as if they had been honoured. Triton ignores any other tensor parameter, and so does this server.
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
CLASSIFICATION_PARAMETER = "classification"  # on a requested output: the top-k classes instead of the tensor
# Typed contents with more values than this are converted in a worker thread: a Python list of them
# costs about 30 ns a value, which would stall every other call on the event loop.
INLINE_TYPED_VALUES = 4096


def add_to_server(server: grpc.aio.Server, service: InferenceService) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service), server)


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService):
        self._service = service

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._service.ready)

    async def ModelReady(self, request, context):
        _check_model(self._service.spec, request.name, request.version, "name", "version")
        return pb.ModelReadyResponse(ready=self._service.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=[])

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
                     for name, shape in spec.output_shapes.items()],
        )

    async def ModelConfig(self, request, context):
        """Triton's extension: what Triton answers for this model served with dynamic batching (tensors without the
        batch axis, which max_batch_size implies). perf_analyzer and model_analyzer ask it before anything else."""
        spec = self._service.spec
        _check_model(spec, request.name, request.version, "name", "version")
        fp32 = config_pb.DataType.TYPE_FP32
        delay_us = round(self._service.batcher.config.max_queue_delay_s * 1_000_000)
        return pb.ModelConfigResponse(config=config_pb.ModelConfig(
            name=spec.name,
            platform=spec.platform,
            max_batch_size=spec.max_batch_size,
            input=[config_pb.ModelInput(name=spec.input_name, data_type=fp32, dims=spec.input_shape)],
            output=[config_pb.ModelOutput(name=name, data_type=fp32, dims=shape)
                    for name, shape in spec.output_shapes.items()],
            dynamic_batching=config_pb.ModelDynamicBatching(max_queue_delay_microseconds=delay_us),
        ))

    async def ModelInfer(self, request, context):
        arrival = time.monotonic()
        service, spec = self._service, self._service.spec
        _check_model(spec, request.model_name, request.model_version, "model_name", "model_version")
        service.check_arrival(arrival)
        tensor = _input_tensor(request, spec)
        service.check_batch_size(tensor.shape[0], "inputs[0].shape[0]")
        names = _requested_outputs(request, spec)
        if tensor.typed and tensor.count > INLINE_TYPED_VALUES:
            images = await asyncio.to_thread(_input_images, request, tensor)
        else:
            images = _input_images(request, tensor)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        result = await service.infer(images, field="inputs[0]", reconstruction="reconstruction" in names,
                                     deadline=deadline, arrival=arrival)
        arrays = {"probabilities": result.probabilities, "poses": result.poses,
                  "reconstruction": result.reconstruction}
        return _response(request, spec, {name: arrays[name] for name in names})


def _check_model(spec: ModelSpec, name: str, version: str, name_field: str, version_field: str) -> None:
    if name != spec.name:
        raise ModelNotFound(f"{name_field}: unknown model {name!r}; this server serves {spec.name!r}")
    if version not in ("", spec.version):
        raise ModelNotFound(f"{version_field}: model {spec.name!r} has no version {version!r}; "
                            f"expected '' or {spec.version!r}")


def _refuse_parameters(parameters, field: str, *, output: bool) -> None:
    """Refuse the tensor parameters this server cannot honour; ignore the others (binary_data_size, ...) as Triton does."""
    if shared := [key for key in SHARED_MEMORY_PARAMETERS if key in parameters]:
        where = "the response carries the outputs" if output else "send the data in raw_input_contents or contents"
        raise InvalidInput(f"{field}.parameters: shared memory is not supported by this server, got "
                           f"{', '.join(shared)}; {where}")
    if output and CLASSIFICATION_PARAMETER in parameters:
        raise InvalidInput(f"{field}.parameters: the classification extension is not supported by this server, got "
                           f"{CLASSIFICATION_PARAMETER!r}; ask for 'probabilities' and take the top classes from them")


@dataclass(frozen=True)
class _InputTensor:
    """The input tensor's header, checked: what it declares, before its contents are read."""
    datatype: str
    shape: list[int]
    count: int  # values the shape declares
    typed: bool  # contents given typed (else raw)


def _input_tensor(request: pb.ModelInferRequest, spec: ModelSpec) -> _InputTensor:
    if len(request.inputs) != 1:
        got = ", ".join(repr(tensor.name) for tensor in request.inputs) or "none"
        raise InvalidInput(f"inputs: expected exactly 1 input named {spec.input_name!r}, got {got}")
    tensor = request.inputs[0]
    if tensor.name != spec.input_name:
        raise InvalidInput(f"inputs[0].name: expected {spec.input_name!r}, got {tensor.name!r}")
    if tensor.datatype not in _INPUT_DATATYPES:
        raise InvalidInput(f"inputs[0].datatype: expected one of {', '.join(_INPUT_DATATYPES)}, got {tensor.datatype!r}")
    _refuse_parameters(tensor.parameters, "inputs[0]", output=False)
    shape = list(tensor.shape)
    if min(shape, default=0) < 0:
        raise InvalidInput(f"inputs[0].shape: dimensions must be >= 0, got {shape}")
    if len(shape) != 4 or tuple(shape[1:]) != spec.input_shape:
        raise InvalidInput(f"inputs[0].shape: expected shape [N, {', '.join(map(str, spec.input_shape))}], got {shape}")
    _, typed_field = _INPUT_DATATYPES[tensor.datatype]
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    count = math.prod(shape)
    if request.raw_input_contents:
        if typed:
            raise InvalidInput(f"inputs[0].contents: data given both typed ({typed[0]}) and in raw_input_contents; "
                               "expected one of them")
    elif typed and typed != [typed_field]:
        raise InvalidInput(f"inputs[0].contents: datatype {tensor.datatype} expects {typed_field}, "
                           f"got {', '.join(typed)}")
    elif not typed and count:
        raise InvalidInput(f"inputs[0]: no data; expected contents.{typed_field} or raw_input_contents[0]")
    return _InputTensor(tensor.datatype, shape, count, typed=not request.raw_input_contents)


def _input_images(request: pb.ModelInferRequest, tensor: _InputTensor) -> np.ndarray:
    """The input's contents as a float32 array of its declared shape (values not yet validated)."""
    dtype, typed_field = _INPUT_DATATYPES[tensor.datatype]
    if tensor.typed:
        values = _typed_values(getattr(request.inputs[0].contents, typed_field), f"inputs[0].contents.{typed_field}",
                               dtype, tensor.count, tensor.shape)
    else:
        values = _raw_values(request.raw_input_contents, dtype, tensor.count, tensor.datatype, tensor.shape)
    images = values.reshape(tensor.shape)  # (N, C, H, W)
    if tensor.datatype == "UINT8":
        return images.astype(np.float32) / np.float32(255)
    return images.astype(np.float32, copy=False)


def _raw_values(raw, dtype: np.dtype, count: int, datatype: str, shape: list[int]) -> np.ndarray:
    if len(raw) != 1:
        raise InvalidInput(f"raw_input_contents: expected 1 entry (one per input), got {len(raw)}")
    expected = count * dtype.itemsize
    if len(raw[0]) != expected:
        raise InvalidInput(f"raw_input_contents[0]: expected {expected} bytes for {datatype} shape {shape} "
                           f"({count} elements x {dtype.itemsize} bytes), got {len(raw[0])}")
    return np.frombuffer(raw[0], dtype=dtype)


def _typed_values(contents, field: str, dtype: np.dtype, count: int, shape: list[int]) -> np.ndarray:
    if len(contents) != count:
        raise InvalidInput(f"{field}: expected {count} values for shape {shape}, got {len(contents)}")
    if dtype == np.uint8:
        wide = np.array(contents, dtype=np.uint32)
        if count and wide.max() > 255:
            raise InvalidInput(f"{field}: UINT8 values must be in 0..255, got {int(wide.max())}")
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
            raise InvalidInput(f"{field}.name: unknown output {output.name!r}; expected one of "
                               f"{', '.join(spec.output_names)}")
        if output.name in names:
            raise InvalidInput(f"{field}.name: output {output.name!r} is requested more than once")
        _refuse_parameters(output.parameters, field, output=True)
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
