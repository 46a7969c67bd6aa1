"""KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`).

A thin adapter onto the shared request path (`InferenceService`): it turns a `ModelInferRequest`
into an image batch, lets the service validate and infer it, and turns the result back into a
`ModelInferResponse`. One model is served, under the name and version in its model.json.

Inputs: one tensor named like the model input (`images`), shape [N, C, H, W], datatype FP32
(values in [0, 1]) or UINT8 (scaled by 1/255), given either typed (`contents`) or raw
(`raw_input_contents`, little-endian). Outputs are answered in the same form as the input.
What a request must hold and what is answered are the protocol's, shared with REST (`serving/kserve.py`); here
only what is gRPC's: the messages, typed or raw contents, and the call's deadline.
The batch size is checked from the declared shape before any contents are read, and large contents are
converted off the event loop. Errors are `serving/errors.py` kinds; the interceptor makes them statuses.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
from google.protobuf import json_format

from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.kserve import model_config_pb2 as config_pb
from capsnet.serving import kserve
from capsnet.serving.errors import InvalidInput
from capsnet.serving.service import InferenceService, ModelSpec

SERVICE_NAME = "inference.GRPCInferenceService"

# Typed contents with more values than this are converted in a worker thread: a Python list of them
# costs about 30 ns a value, which would stall every other call on the event loop.
INLINE_TYPED_VALUES = 4096
RAW_OR_TYPED = "raw_input_contents or contents"


def add_to_server(server: grpc.aio.Server, service: InferenceService) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service), server)


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService):
        self._service = service

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self._service.lifecycle.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._service.ready)

    async def ModelReady(self, request, context):
        kserve.check_model(self._service.spec, request.name, request.version, "name", "version")
        return pb.ModelReadyResponse(ready=self._service.ready)

    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(kserve.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request, context):
        kserve.check_model(self._service.spec, request.name, request.version, "name", "version")
        return json_format.ParseDict(kserve.model_metadata(self._service.spec), pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        kserve.check_model(self._service.spec, request.name, request.version, "name", "version")
        config = json_format.ParseDict(kserve.model_config(self._service), config_pb.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, request, context):
        arrival = time.monotonic()
        service, spec = self._service, self._service.spec
        kserve.check_model(spec, request.model_name, request.model_version, "model_name", "model_version")
        service.check_arrival(arrival)
        tensor, typed = _input_tensor(request, spec)
        service.check_batch_size(tensor.shape[0], "inputs[0].shape[0]")
        names = kserve.requested_outputs(spec, [(output.name, output.parameters) for output in request.outputs])
        if typed and tensor.count > INLINE_TYPED_VALUES:
            images = await asyncio.to_thread(_input_images, request, tensor, typed)
        else:
            images = _input_images(request, tensor, typed)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        result = await service.infer(images, field="inputs[0]", reconstruction="reconstruction" in names,
                                     deadline=deadline, arrival=arrival)
        arrays = {"probabilities": result.probabilities, "poses": result.poses,
                  "reconstruction": result.reconstruction}
        return _response(request, spec, {name: arrays[name] for name in names})


def _input_tensor(request: pb.ModelInferRequest, spec: ModelSpec) -> tuple[kserve.InputTensor, bool]:
    """The input's header, checked, and whether its contents come typed (else raw)."""
    inputs = request.inputs
    first = inputs[0] if len(inputs) == 1 else pb.ModelInferRequest.InferInputTensor()
    tensor = kserve.check_input(spec, [tensor.name for tensor in inputs], first.name, first.datatype, list(first.shape))
    kserve.refuse_parameters(first.parameters, "inputs[0]", output=False, data_where=RAW_OR_TYPED)
    _, typed_field = kserve.INPUT_DATATYPES[tensor.datatype]
    typed = [field.name for field, _ in first.contents.ListFields()]
    if request.raw_input_contents:
        if typed:
            raise InvalidInput(f"inputs[0].contents: data given both typed ({typed[0]}) and in raw_input_contents; "
                               "expected one of them")
    elif typed and typed != [typed_field]:
        raise InvalidInput(f"inputs[0].contents: datatype {tensor.datatype} expects {typed_field}, "
                           f"got {', '.join(typed)}")
    elif not typed and tensor.count:
        raise InvalidInput(f"inputs[0]: no data; expected contents.{typed_field} or raw_input_contents[0]")
    return tensor, not request.raw_input_contents


def _input_images(request: pb.ModelInferRequest, tensor: kserve.InputTensor, typed: bool) -> np.ndarray:
    """The input's contents as a float32 array of its declared shape (values not yet validated)."""
    if typed:
        _, typed_field = kserve.INPUT_DATATYPES[tensor.datatype]
        values = _typed_values(getattr(request.inputs[0].contents, typed_field), f"inputs[0].contents.{typed_field}",
                               tensor)
    else:
        raw = request.raw_input_contents
        if len(raw) != 1:
            raise InvalidInput(f"raw_input_contents: expected 1 entry (one per input), got {len(raw)}")
        values = kserve.raw_values(raw[0], tensor, "raw_input_contents[0]")
    return kserve.images_from_values(values, tensor)


def _typed_values(contents, field: str, tensor: kserve.InputTensor) -> np.ndarray:
    if len(contents) != tensor.count:
        raise InvalidInput(f"{field}: expected {tensor.count} values for shape {tensor.shape}, got {len(contents)}")
    if tensor.datatype == "UINT8":
        wide = np.array(contents, dtype=np.uint32)
        kserve.check_uint8_range(wide, field)
        return wide.astype(np.uint8)
    return np.array(contents, dtype=tensor.dtype)


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
