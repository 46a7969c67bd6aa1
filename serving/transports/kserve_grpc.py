"""KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`).

A thin adapter onto the data plane (`serving/protocol/kserve.py`): ModelInfer decodes a `ModelInferRequest` for it (a
Decoder) and encodes its answer as a `ModelInferResponse`; the other RPCs read the data plane. Only what is gRPC's is
here: the messages, typed or raw contents, the call's deadline, and whether its peer showed a client certificate.

Inputs: one tensor named like the model input (`images`), shape [N, C, H, W], datatype FP32
(values in [0, 1]) or UINT8 (scaled by 1/255), given either typed (`contents`) or raw
(`raw_input_contents`, little-endian). Outputs are answered in the same form as the input.
Large typed contents are converted off the event loop. Errors are `serving/errors.py` kinds; the interceptor makes
them statuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import MappingProxyType

import grpc
import numpy as np
from google.protobuf import json_format

from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.kserve import model_config_pb2 as config_pb
from capsnet.serving.engine.service import ModelSpec
from capsnet.serving.errors import InvalidInput
from capsnet.serving.protocol import kserve
from capsnet.serving.protocol.shared_memory import CUDA, SYSTEM

SERVICE_NAME = "inference.GRPCInferenceService"

# Typed contents with more values than this are converted in a worker thread: a Python list of them
# costs about 30 ns a value, which would stall every other call on the event loop.
INLINE_TYPED_VALUES = 4096
NO_PARAMETERS: Mapping = MappingProxyType({})


def add_to_server(server: grpc.aio.Server, plane: kserve.DataPlane) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(plane), server)


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: kserve.DataPlane):
        self._plane = plane

    def _model(self, request):
        """The model version a ModelConfig request names."""
        return self._plane.model(_ref(request))

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self._plane.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._plane.ready)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self._plane.model_ready(_ref(request)))

    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(self._plane.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request, context):
        return json_format.ParseDict(self._plane.model_metadata(_ref(request)), pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        config = json_format.ParseDict(kserve.model_config(self._model(request)), config_pb.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        return json_format.ParseDict(await self._plane.model_statistics(_ref(request)), pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request, context):
        return json_format.ParseDict({"models": self._plane.repository_index(request.repository_name, request.ready)},
                                     pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request, context):
        await self._plane.load(request.repository_name, kserve.ModelRef(request.model_name), request.parameters,
                               _certified(context))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._plane.unload(request.repository_name, kserve.ModelRef(request.model_name), request.parameters,
                                 _certified(context))
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        return _regions(self._plane.shared_memory.status(SYSTEM, request.name), pb.SystemSharedMemoryStatusResponse())

    async def SystemSharedMemoryRegister(self, request, context):
        self._plane.shared_memory.register_system(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        self._plane.shared_memory.unregister(SYSTEM, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        return _regions(self._plane.shared_memory.status(CUDA, request.name), pb.CudaSharedMemoryStatusResponse())

    async def CudaSharedMemoryRegister(self, request, context):
        self._plane.shared_memory.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        self._plane.shared_memory.unregister(CUDA, request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def ModelInfer(self, request, context):
        arrival = time.monotonic()
        remaining = context.time_remaining()
        response = await self._plane.infer(kserve.InferRequest(
            kserve.ModelRef(request.model_name, request.model_version), _Decoder(request), arrival,
            None if remaining is None else arrival + remaining))
        return _encode(request, response)


def _ref(request) -> kserve.ModelRef:
    """The model a ModelReady, ModelMetadata, ModelConfig or ModelStatistics request names."""
    return kserve.ModelRef(request.name, request.version, "name", "version")


def _regions(regions: list[dict], response):
    """A shared-memory status response: its regions by name."""
    for region in regions:
        json_format.ParseDict(region, response.regions[region["name"]])
    return response


def _parameters(parameters) -> Mapping:
    """A tensor's InferParameter map as plain values (most tensors have none: one shared empty map then)."""
    if not parameters:
        return NO_PARAMETERS
    return {key: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
            for key, value in parameters.items()}


def _certified(context) -> bool:
    """Whether the call came over TLS with a client certificate gRPC verified."""
    return bool(context.auth_context().get("x509_pem_cert"))


class _Decoder:
    """A ModelInferRequest read for the data plane."""

    data_where = "raw_input_contents or contents"

    def __init__(self, request: pb.ModelInferRequest):
        self._request = request

    async def header(self, spec: ModelSpec) -> kserve.InferHeader:
        request = self._request
        return kserve.InferHeader(
            inputs=[kserve.InferInput(tensor.name, tensor.datatype, list(tensor.shape), _parameters(tensor.parameters))
                    for tensor in request.inputs],
            outputs=[kserve.RequestedOutput(output.name, _parameters(output.parameters)) for output in request.outputs],
            id=request.id)

    def check_data(self, tensor: kserve.InputTensor, shared: bool, index: int = 0) -> None:
        """Typed or raw, not both, and some unless the tensor is empty; none when in shared memory."""
        _, typed_field = kserve.INPUT_DATATYPES[tensor.datatype]
        typed = [field.name for field, _ in self._request.inputs[index].contents.ListFields()]
        if shared:
            if typed or self._request.raw_input_contents:
                raise InvalidInput(f"inputs[{index}]: data given both in shared memory "
                                   "(parameters.shared_memory_region) and "
                                   f"in {'contents' if typed else 'raw_input_contents'}; expected one of them")
        elif self._request.raw_input_contents:
            if typed:
                raise InvalidInput(f"inputs[{index}].contents: data given both typed ({typed[0]}) and in "
                                   "raw_input_contents; expected one of them")
        elif typed and typed != [typed_field]:
            raise InvalidInput(f"inputs[{index}].contents: datatype {tensor.datatype} expects {typed_field}, "
                               f"got {', '.join(typed)}")
        elif not typed and tensor.count:
            raise InvalidInput(f"inputs[{index}]: no data; expected contents.{typed_field} or "
                               f"raw_input_contents[{index}]")

    async def values(self, tensor: kserve.InputTensor, index: int = 0) -> np.ndarray:
        if not self._request.raw_input_contents and tensor.count > INLINE_TYPED_VALUES:
            return await asyncio.to_thread(_input_values, self._request, tensor, index)
        return _input_values(self._request, tensor, index)


def _input_values(request: pb.ModelInferRequest, tensor: kserve.InputTensor, index: int) -> np.ndarray:
    """Input `index`'s flat values, from its raw bytes or typed contents (not yet validated)."""
    raw = request.raw_input_contents
    if not raw:
        _, typed_field = kserve.INPUT_DATATYPES[tensor.datatype]
        return _typed_values(getattr(request.inputs[index].contents, typed_field),
                             f"inputs[{index}].contents.{typed_field}", tensor)
    if len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents: expected {len(request.inputs)} "
                           f"entr{'y' if len(request.inputs) == 1 else 'ies'} (one per input), got {len(raw)}")
    return kserve.raw_values(raw[index], tensor, f"raw_input_contents[{index}]")


def _typed_values(contents, field: str, tensor: kserve.InputTensor) -> np.ndarray:
    if len(contents) != tensor.count:
        raise InvalidInput(f"{field}: expected {tensor.count} values for shape {tensor.shape}, got {len(contents)}")
    if tensor.datatype == "UINT8":
        wide = np.array(contents, dtype=np.uint32)
        kserve.check_uint8_range(wide, field)
        return wide.astype(np.uint8)
    return np.array(contents, dtype=tensor.dtype)


def _encode(request: pb.ModelInferRequest, answer: kserve.InferResponse) -> pb.ModelInferResponse:
    """Outputs raw when the input was not typed (as tritonclient expects), typed otherwise; an output written into a
    region has no data, and an empty raw entry keeps the raw entries in the outputs' order."""
    response = pb.ModelInferResponse(model_name=answer.model_name, model_version=answer.model_version, id=answer.id)
    raw = not request.inputs or not request.inputs[0].HasField("contents")
    for output in answer.outputs:
        tensor = response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        if output.data is None:
            if raw:
                response.raw_output_contents.append(b"")
        elif output.datatype == "BYTES":
            if raw:
                response.raw_output_contents.append(kserve.serialize_bytes(output.data))
            else:
                tensor.contents.bytes_contents.extend(output.data.ravel().tolist())
        elif raw:
            response.raw_output_contents.append(np.ascontiguousarray(output.data, dtype="<f4").tobytes())
        else:
            tensor.contents.fp32_contents.extend(output.data.ravel().tolist())
    return response
