"""The KServe v2 / Open Inference Protocol, whatever carries it: what a request must hold, the one path it takes, and
what is answered.

Both transports, gRPC (`serving/kserve_grpc.py`) and HTTP/REST (`serving/kserve_http.py`), hand the data plane a
transport-neutral InferRequest: the model it is for, when it arrived, its deadline, and a Decoder that reads the
transport's message step by step. The data plane runs the one sequence (as KServe's DataPlane does):

    model -> arrival -> tensor headers -> input -> its data's form -> batch size -> outputs -> data -> infer

so a request is judged alike, with the same messages naming the same fields, however it came; each transport only
decodes its message and encodes the neutral InferResponse. Errors are those of `serving/errors.py`. Metadata,
Triton's model config and statistics, and the repository extension's index are built here as plain data (the
protocol's JSON form), which gRPC turns into its messages and REST sends as it is.

A request is for a model of the model manager (`serving/model_manager.py`) and one of its versions, named or the
default; it holds that version until answered, and the answer names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from capsnet import __version__
from capsnet.model_description.classes import class_names_parameters
from capsnet.serving.errors import InvalidInput, Unauthenticated
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.model_manager import ModelManager, ModelRef
from capsnet.serving.service import InferenceService, ModelSpec, check_image_shape

SERVER_NAME = "capsnet-serve"

# datatype -> (little-endian numpy dtype of its raw bytes, InferTensorContents field of its typed data in gRPC)
INPUT_DATATYPES: dict[str, tuple[np.dtype, str]] = {
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "UINT8": (np.dtype("u1"), "uint_contents"),
}
# Tensor parameters that Triton acts on, which this server cannot: refused, so that no client is answered as if they
# had been honoured. Triton ignores any other tensor parameter, and so does this server.
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
CLASSIFICATION_PARAMETER = "classification"  # on a requested output: the top-k classes instead of the tensor


# Triton's names of the protocol extensions served (ServerMetadata); both transports serve all of them.
EXTENSIONS = ["model_configuration", "statistics", "model_repository", "model_repository(unload_dependents)"]
# A load or unload's parameters this server takes: Triton's unload_dependents (no model here depends on another, so
# there is nothing more to unload). Triton's `config` and `file:` overrides are refused: a version serves only
# as its export folder was written and self-checked.
UNLOAD_PARAMETERS = ("unload_dependents",)


def server_metadata() -> dict:
    return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}


def model_metadata(spec: ModelSpec, versions: list[str]) -> dict:
    return {
        "name": spec.name,
        "versions": versions,
        "platform": spec.platform,
        "inputs": [{"name": spec.input_name, "datatype": "FP32", "shape": [-1, *spec.input_dims]}],
        "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, *shape]}
                    for name, shape in spec.output_shapes.items()],
    }


def model_config(service: InferenceService) -> dict:
    """Triton's extension: what Triton answers for this model served with dynamic batching (tensors without the
    batch axis, which max_batch_size implies), in Triton's JSON form. perf_analyzer and model_analyzer ask it first."""
    spec = service.spec
    return {
        "name": spec.name,
        "platform": spec.platform,
        "max_batch_size": spec.max_batch_size,
        "input": [{"name": spec.input_name, "data_type": "TYPE_FP32", "dims": spec.input_dims}],
        "output": [{"name": name, "data_type": "TYPE_FP32", "dims": list(shape)}
                   for name, shape in spec.output_shapes.items()],
        "dynamic_batching": {"max_queue_delay_microseconds": round(service.batcher.config.max_queue_delay_s * 1e6)},
        "parameters": class_names_parameters(spec.class_names),
    }


def refuse_parameters(parameters: Mapping, field: str, *, output: bool, data_where: str) -> None:
    """Refuse the tensor parameters this server cannot honour; ignore the others (binary_data_size, ...) as Triton
    does. `data_where`: where an input's data goes instead of shared memory."""
    if shared := [key for key in SHARED_MEMORY_PARAMETERS if key in parameters]:
        where = "the response carries the outputs" if output else f"send the data in {data_where}"
        raise InvalidInput(f"{field}.parameters: shared memory is not supported by this server, got "
                           f"{', '.join(shared)}; {where}")
    if output and CLASSIFICATION_PARAMETER in parameters:
        raise InvalidInput(f"{field}.parameters: the classification extension is not supported by this server, got "
                           f"{CLASSIFICATION_PARAMETER!r}; ask for 'probabilities' and take the top classes from them")


@dataclass(frozen=True)
class InferInput:
    """An input tensor's header as a request declares it (its data stays with the Decoder)."""
    name: str
    datatype: str
    shape: list[int]
    parameters: Mapping


class RequestedOutput(NamedTuple):
    """An output a request asks for."""
    name: str
    parameters: Mapping


@dataclass(frozen=True)
class InferHeader:
    """What a request declares besides its data."""
    inputs: list[InferInput]
    outputs: list[RequestedOutput]
    id: str | None  # None: the request has none (REST leaves it out of the answer then)


class Decoder(Protocol):
    """A transport's reading of its infer message, in the path's order; each step raises InvalidInput naming the
    transport's own fields, and only what a step needs is read (a refused batch size costs no data decoding)."""

    data_where: str  # where a request puts its input's data, for messages

    async def header(self, spec: ModelSpec) -> InferHeader:
        """The request's tensors and outputs as declared."""

    def check_data(self, tensor: InputTensor) -> None:
        """The input's data is given once, in a form the transport takes (not yet read)."""

    async def values(self, tensor: InputTensor) -> np.ndarray:
        """The input's flat values, of the tensor's dtype and count."""


@dataclass(frozen=True)
class InferRequest:
    """An inference request, whatever carried it."""
    model: ModelRef
    decoder: Decoder
    arrival: float  # time.monotonic() it reached the server
    deadline: float | None = None  # time.monotonic() its caller gives up at


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str | None
    outputs: dict[str, np.ndarray]  # name -> (N, ...) float32, in the requested order


@dataclass(frozen=True)
class InputTensor:
    """The input tensor's header, checked: what it declares, before its contents are read."""
    datatype: str
    shape: list[int]
    count: int  # values the shape declares

    @property
    def dtype(self) -> np.dtype:
        return INPUT_DATATYPES[self.datatype][0]


def check_input(spec: ModelSpec, inputs: list[InferInput]) -> InputTensor:
    """The one input's header, from the name to the shape."""
    if len(inputs) != 1:
        got = ", ".join(repr(tensor.name) for tensor in inputs) or "none"
        raise InvalidInput(f"inputs: expected exactly 1 input named {spec.input_name!r}, got {got}")
    name, datatype, shape = inputs[0].name, inputs[0].datatype, inputs[0].shape
    if name != spec.input_name:
        raise InvalidInput(f"inputs[0].name: expected {spec.input_name!r}, got {name!r}")
    if datatype not in INPUT_DATATYPES:
        raise InvalidInput(f"inputs[0].datatype: expected one of {', '.join(INPUT_DATATYPES)}, got {datatype!r}")
    if min(shape, default=0) < 0:
        raise InvalidInput(f"inputs[0].shape: dimensions must be >= 0, got {shape}")
    check_image_shape(spec, shape, "inputs[0].shape")
    return InputTensor(datatype, shape, math.prod(shape))


def raw_values(data: bytes, tensor: InputTensor, field: str) -> np.ndarray:
    """The input's values from its raw little-endian bytes, which must be exactly what its shape declares."""
    expected = tensor.count * tensor.dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(f"{field}: expected {expected} bytes for {tensor.datatype} shape {tensor.shape} "
                           f"({tensor.count} elements x {tensor.dtype.itemsize} bytes), got {len(data)}")
    return np.frombuffer(data, dtype=tensor.dtype)


def check_uint8_range(wide: np.ndarray, field: str) -> None:
    """UINT8 data given as numbers (gRPC's uint_contents, JSON) must fit a byte; `wide` holds them unclipped."""
    if wide.size and (wide.min() < 0 or wide.max() > 255):
        bad = wide.min() if wide.min() < 0 else wide.max()
        raise InvalidInput(f"{field}: UINT8 values must be in 0..255, got {int(bad)}")


def images_from_values(values: np.ndarray, tensor: InputTensor) -> np.ndarray:
    """(N, C, H, W) float32 from the input's flat values (not yet validated); UINT8 pixels are scaled to [0, 1]."""
    images = values.reshape(tensor.shape)  # (N, C, H, W)
    if tensor.datatype == "UINT8":
        return images.astype(np.float32) / np.float32(255)
    return images.astype(np.float32, copy=False)


def requested_outputs(spec: ModelSpec, outputs: list[RequestedOutput]) -> list[str]:
    """Names of the outputs to answer, in request order; all the model serves when none are named."""
    if not outputs:
        return list(spec.output_names)
    names = []
    for index, (name, parameters) in enumerate(outputs):
        field = f"outputs[{index}]"
        if name not in spec.output_names:
            raise InvalidInput(f"{field}.name: unknown output {name!r}; expected one of {', '.join(spec.output_names)}")
        if name in names:
            raise InvalidInput(f"{field}.name: output {name!r} is requested more than once")
        refuse_parameters(parameters, field, output=True, data_where="")
        names.append(name)
    return names


class DataPlane:
    """The protocol's operations on the models this server serves, for both transports."""

    def __init__(self, models: ModelManager, lifecycle: Lifecycle, client_certificates: bool = False):
        """`client_certificates`: mutual TLS is on, and model control asks for a verified client certificate."""
        self.models = models
        self.lifecycle = lifecycle
        self.client_certificates = client_certificates

    @property
    def live(self) -> bool:
        return self.lifecycle.live

    @property
    def ready(self) -> bool:
        return self.lifecycle.ready

    def model(self, ref: ModelRef) -> InferenceService:
        """The serving version `ref` names; ModelNotFound or ModelNotReady naming the field at fault."""
        return self.models.resolve(ref)

    def model_ready(self, ref: ModelRef) -> bool:
        return self.models.ready(ref)

    def model_metadata(self, ref: ModelRef) -> dict:
        spec = self.model(ref).spec
        return model_metadata(spec, self.models.versions(spec.name))

    def model_statistics(self, ref: ModelRef) -> dict:
        return {"model_stats": self.models.statistics(ref)}

    def repository_index(self, repository: str, ready_only: bool) -> list[dict]:
        _one_repository(repository)
        return self.models.index(ready_only)

    async def load(self, repository: str, ref: ModelRef, parameters: Mapping, certified: bool) -> None:
        """`certified`: the call came with a verified client certificate."""
        self._check_control(repository, parameters, (), certified)
        await self.models.load(ref.name, ref.name_field)

    async def unload(self, repository: str, ref: ModelRef, parameters: Mapping, certified: bool) -> None:
        self._check_control(repository, parameters, UNLOAD_PARAMETERS, certified)
        await self.models.unload(ref.name, ref.name_field)

    def _check_control(self, repository: str, parameters: Mapping, taken: tuple[str, ...], certified: bool) -> None:
        if self.client_certificates and not certified:
            raise Unauthenticated("model control needs a verified client certificate (mutual TLS)")
        self.models.check_control()
        _one_repository(repository)
        if other := [key for key in parameters if key not in taken]:
            raise InvalidInput(f"parameters: {', '.join(repr(key[:40]) for key in other[:5])} not taken: this server "
                               "loads a model only as its export folder in the repository holds it"
                               + (f"; it takes {', '.join(taken)}" if taken else ""))

    async def infer(self, request: InferRequest) -> InferResponse:
        with self.models.use(request.model) as model:
            return await self._infer(model, request)

    async def _infer(self, model: InferenceService, request: InferRequest) -> InferResponse:
        spec, decoder = model.spec, request.decoder
        model.check_arrival(request.arrival)
        header = await decoder.header(spec)
        tensor = check_input(spec, header.inputs)
        refuse_parameters(header.inputs[0].parameters, "inputs[0]", output=False, data_where=decoder.data_where)
        decoder.check_data(tensor)
        model.check_batch_size(tensor.shape[0], "inputs[0].shape[0]")
        names = requested_outputs(spec, header.outputs)
        images = images_from_values(await decoder.values(tensor), tensor)
        result = await model.infer(images, field="inputs[0]", reconstruction="reconstruction" in names,
                                   deadline=request.deadline, arrival=request.arrival)
        arrays = {"probabilities": result.probabilities, "poses": result.poses,
                  "reconstruction": result.reconstruction}
        outputs = {name: array for name in names if (array := arrays[name]) is not None}  # reconstruction: if asked
        return InferResponse(spec.name, spec.version, header.id, outputs)


def _one_repository(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name: this server has one model repository; leave it empty, got "
                           f"{name[:40]!r}")
