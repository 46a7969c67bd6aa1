"""The KServe v2 / Open Inference Protocol, whatever carries it: what a request must hold, the one path it takes, and
what is answered.

Both transports, gRPC (`serving/transports/kserve_grpc.py`) and HTTP/REST (`serving/transports/kserve_http.py`), hand
the data plane a transport-neutral InferRequest: the model it is for, when it arrived, its deadline, and a Decoder that
reads the transport's message step by step. The data plane runs the one sequence (as KServe's DataPlane does):

    model -> arrival -> tensor headers -> input -> its data's form -> batch size -> outputs -> data -> infer

so a request is judged alike, with the same messages naming the same fields, however it came; each transport only
decodes its message and encodes the neutral InferResponse. Errors are those of `serving/errors.py`. Metadata,
Triton's model config and statistics, and the repository extension's index are built here as plain data (the
protocol's JSON form), which gRPC turns into its messages and REST sends as it is.

A request is for a model of the model manager (`serving/engine/model_manager.py`) and one of its versions, named or the
default; it holds that version until answered, and the answer names it.

Triton's extensions that act on tensors are served here for both transports: shared memory (a tensor's
shared_memory_* parameters name a region of `serving/protocol/shared_memory.py`: the input is read from it by the
batcher, an output written into it (`serving/protocol/region_tensors.py`), and the request holds its regions until
answered) and classification (an output's top k classes as "score:index:label" strings).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from capsnet import __version__
from capsnet.model_description.classes import class_names_parameters
from capsnet.model_description.decoder import DECODER_PART
from capsnet.serving.engine.batcher import OutputSink
from capsnet.serving.engine.decoder import rows as decoder_rows
from capsnet.serving.engine.model_manager import ModelManager, ModelRef
from capsnet.serving.engine.service import InferenceService, ModelSpec, check_image_shape
from capsnet.serving.errors import InvalidInput, Unauthenticated
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.protocol.region_tensors import RegionImages, RegionOutput, check_room
from capsnet.serving.protocol.shared_memory import Region, RegionRef, SharedMemory, region_ref

SERVER_NAME = "capsnet-serve"

# datatype -> (little-endian numpy dtype of its raw bytes, InferTensorContents field of its typed data in gRPC)
INPUT_DATATYPES: dict[str, tuple[np.dtype, str]] = {
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "UINT8": (np.dtype("u1"), "uint_contents"),
    "INT64": (np.dtype("<i8"), "int64_contents"),  # a decoder's class index
}
IMAGE_DATATYPES = ("FP32", "UINT8")
MAX_POSE_LENGTH_PARAMETER = "max_pose_length"  # a decoder's model config parameter
POSE_FIGURES_PARAMETER = "pose_figures"  # a decoder's: how far its poses show (model.json's decoder.pose), as JSON
CLASSIFICATION_PARAMETER = "classification"  # on a requested output: its top k classes instead of the tensor
CLASSIFIED_OUTPUT = "probabilities"  # the output classification ranks: one score per class
# Accepted input headers and output lists remembered per version (a bound, against clients that vary them endlessly)
ACCEPTED_HEADERS = 256


# Triton's names of the protocol extensions served (ServerMetadata) on both transports; the shared-memory ones are
# added where they are served (SharedMemory.extensions).
EXTENSIONS = ["model_configuration", "statistics", "model_repository", "model_repository(unload_dependents)",
              "binary_tensor_data", "classification"]
# A load or unload's parameters this server takes: Triton's unload_dependents (no model here depends on another, so
# there is nothing more to unload). Triton's `config` and `file:` overrides are refused: a version serves only
# as its export folder was written and self-checked.
UNLOAD_PARAMETERS = ("unload_dependents",)


def server_metadata(shared_memory: SharedMemory) -> dict:
    return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS + shared_memory.extensions}


def model_inputs(spec: ModelSpec) -> list[dict]:
    """The inputs a model takes, as KServe's metadata lists them (the batch axis -1): images, or a decoder's poses
    and class index."""
    if spec.part == DECODER_PART and spec.decoder is not None:
        return [{**tensor, "shape": [-1, *tensor["shape"]]} for tensor in spec.decoder.tensors()[0]]
    return [{"name": spec.input_name, "datatype": "FP32", "shape": [-1, *spec.input_dims]}]


def decoder_parameters(spec: ModelSpec) -> dict[str, dict[str, str]]:
    """A decoder's config `parameters`: the longest pose it takes ("none": unbounded), which a client keeps
    perturbed poses within, and how far its poses show in its drawings where the export measured it."""
    if spec.part != DECODER_PART or spec.decoder is None:
        return {}
    length, pose = spec.decoder.max_pose_length, spec.decoder.pose
    return {MAX_POSE_LENGTH_PARAMETER: {"string_value": "none" if length is None else f"{length:g}"},
            **({POSE_FIGURES_PARAMETER: {"string_value": json.dumps(pose.to_json())}} if pose else {})}


def model_metadata(spec: ModelSpec, versions: list[str]) -> dict:
    return {
        "name": spec.name,
        "versions": versions,
        "platform": spec.platform,
        "inputs": model_inputs(spec),
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
        # a value per batch item (a class index) is dims [1] reshaped to none, as Triton must declare it
        "input": [{"name": tensor["name"], "data_type": f"TYPE_{tensor['datatype']}",
                   **({"dims": tensor["shape"][1:]} if len(tensor["shape"]) > 1 else
                      {"dims": [1], "reshape": {"shape": []}})} for tensor in model_inputs(spec)],
        "output": [{"name": name, "data_type": "TYPE_FP32", "dims": list(shape)}
                   for name, shape in spec.output_shapes.items()],
        "dynamic_batching": {"max_queue_delay_microseconds": round(service.batcher.config.max_queue_delay_s * 1e6)},
        "parameters": {**class_names_parameters(spec.class_names), **decoder_parameters(spec)},
    }


class InferInput(NamedTuple):
    """An input tensor's header as a request declares it (its data stays with the Decoder)."""
    name: str
    datatype: str
    shape: list[int]
    parameters: Mapping  # name -> its value (str, int, float or bool), whatever the transport's form


class RequestedOutput(NamedTuple):
    """An output a request asks for."""
    name: str
    parameters: Mapping  # as InferInput's


class OutputPlan(NamedTuple):
    """How a requested output is answered: classified (its top `classes`), and in a region or in the answer."""
    name: str
    classes: int | None  # None: the tensor itself
    region: RegionRef | None


class Output(NamedTuple):
    """An answered output: its data, or None where it was written into the region the request named."""
    name: str
    datatype: str  # FP32, or BYTES for classification
    shape: tuple[int, ...]
    data: np.ndarray | None  # float32, or an object array of bytes for BYTES


class InferHeader(NamedTuple):
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

    def check_data(self, tensor: InputTensor, shared: bool, index: int = 0) -> None:
        """Input `index`'s data is given once, in a form the transport takes (not yet read); `shared`: it is in a
        shared-memory region, and the request must carry none."""

    async def values(self, tensor: InputTensor, index: int = 0) -> np.ndarray:
        """Input `index`'s flat values, of the tensor's dtype and count."""


class InferRequest(NamedTuple):
    """An inference request, whatever carried it."""
    model: ModelRef
    decoder: Decoder
    arrival: float  # time.monotonic() it reached the server
    deadline: float | None = None  # time.monotonic() its caller gives up at


class InferResponse(NamedTuple):
    model_name: str
    model_version: str
    id: str | None
    outputs: list[Output]  # in the requested order


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
    if datatype not in IMAGE_DATATYPES:
        raise InvalidInput(f"inputs[0].datatype: expected one of {', '.join(IMAGE_DATATYPES)}, got {datatype!r}")
    if min(shape, default=0) < 0:
        raise InvalidInput(f"inputs[0].shape: dimensions must be >= 0, got {shape}")
    check_image_shape(spec, shape, "inputs[0].shape")
    return InputTensor(datatype, shape, math.prod(shape))


def check_decoder_inputs(spec: ModelSpec, inputs: list[InferInput]) -> list[tuple[int, InputTensor]]:
    """A decoder's two inputs' headers, poses then class index, each with its index in the request: the names, the
    datatypes, the shapes [N, J, D] and [N] (or [N, 1], as Triton's config declares it), one N; in the request itself
    (not in shared memory)."""
    assert spec.decoder is not None  # a decoder's spec
    expected = spec.decoder.tensors()[0]
    names = [tensor["name"] for tensor in expected]
    if sorted(tensor.name for tensor in inputs) != sorted(names):
        got = ", ".join(repr(tensor.name) for tensor in inputs) or "none"
        raise InvalidInput(f"inputs: expected the 2 inputs {' and '.join(map(repr, names))}, got {got}")
    checked = []
    for wanted in expected:
        index = next(i for i, tensor in enumerate(inputs) if tensor.name == wanted["name"])
        tensor, field = inputs[index], f"inputs[{index}]"
        if tensor.datatype != wanted["datatype"]:
            raise InvalidInput(f"{field}.datatype: {tensor.name!r} is {wanted['datatype']}, got {tensor.datatype!r}")
        shapes = [[-1, *wanted["shape"]]] + ([[-1, 1]] if not wanted["shape"] else [])
        if not any(len(tensor.shape) == len(shape) and tensor.shape[1:] == shape[1:] for shape in shapes) or (
                min(tensor.shape, default=0) < 0):
            taken = " or ".join(str(["N", *shape[1:]]).replace("'", "") for shape in shapes)
            raise InvalidInput(f"{field}.shape: {tensor.name!r} takes shape {taken}, got {tensor.shape}")
        if region_ref(tensor.parameters, field) is not None:
            raise InvalidInput(f"{field}.parameters.shared_memory_region: a decoder takes its inputs in the request, "
                               "not in shared memory")
        checked.append((index, InputTensor(tensor.datatype, tensor.shape, math.prod(tensor.shape))))
    (poses_index, poses), (classes_index, classes) = checked
    if poses.shape[0] != classes.shape[0]:
        raise InvalidInput(f"inputs[{classes_index}].shape: {classes.shape[0]} class indices for "
                           f"{poses.shape[0]} poses (inputs[{poses_index}]); expected one per pose")
    return checked


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


def requested_outputs(spec: ModelSpec, outputs: list[RequestedOutput]) -> list[OutputPlan]:
    """The outputs to answer, in request order; all the model serves when none are named."""
    if not outputs:
        return [OutputPlan(name, None, None) for name in spec.output_names]
    plans: list[OutputPlan] = []
    for index, (name, parameters) in enumerate(outputs):
        field = f"outputs[{index}]"
        if name not in spec.output_names:
            raise InvalidInput(f"{field}.name: unknown output {name!r}; expected one of {', '.join(spec.output_names)}")
        if name in [plan.name for plan in plans]:
            raise InvalidInput(f"{field}.name: output {name!r} is requested more than once")
        plans.append(OutputPlan(name, _classes(parameters, name, field), region_ref(parameters, field)))
    return plans


def _classes(parameters: Mapping, name: str, field: str) -> int | None:
    """The classification parameter's count of classes (None: not asked)."""
    if CLASSIFICATION_PARAMETER not in parameters:
        return None
    count = parameters[CLASSIFICATION_PARAMETER]
    if name != CLASSIFIED_OUTPUT:
        raise InvalidInput(f"{field}.parameters.{CLASSIFICATION_PARAMETER}: only {CLASSIFIED_OUTPUT!r} holds one score "
                           f"per class; {name!r} cannot be classified")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidInput(f"{field}.parameters.{CLASSIFICATION_PARAMETER}: expected a number of classes >= 1, got "
                           f"{count!r:.60}")
    return count


def classify(scores: np.ndarray, count: int, class_names: Sequence[str] | None) -> np.ndarray:
    """Triton's classification of (N, J) scores: (N, min(count, J)) bytes "score:index[:label]", highest first (ties:
    the lower index first), the score as C's %f prints it."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :count]  # (N, k)
    labels = [""] * scores.shape[1]  # a model without a name for each class: indices alone
    if class_names is not None and len(class_names) == scores.shape[1]:
        labels = [f":{name}" for name in class_names]
    strings = [[f"{row[index]:f}:{index}{labels[index]}".encode() for index in indices]
               for row, indices in zip(scores, top)]
    return np.array(strings, dtype=object).reshape(top.shape)


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor's raw form, as Triton's: each element, row-major, as a 4-byte little-endian length and its
    bytes."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in array.ravel())


class DataPlane:
    """The protocol's operations on the models this server serves, for both transports."""

    def __init__(self, models: ModelManager, lifecycle: Lifecycle, shared_memory: SharedMemory,
                 client_certificates: bool = False):
        """`client_certificates`: mutual TLS is on, and model control asks for a verified client certificate."""
        self.models = models
        self.lifecycle = lifecycle
        self.shared_memory = shared_memory
        self.client_certificates = client_certificates

    def server_metadata(self) -> dict:
        return server_metadata(self.shared_memory)

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

    async def model_statistics(self, ref: ModelRef) -> dict:
        return {"model_stats": await self.models.statistics(ref)}

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
        # a decoder takes two inputs, poses and class indices, batched as one row per item (serving/engine/decoder.py)
        pose_inputs = check_decoder_inputs(spec, header.inputs) if spec.part == DECODER_PART else None
        shared, first = None, 0
        if pose_inputs is not None:
            for index, part in pose_inputs:
                decoder.check_data(part, False, index)
            first, tensor = pose_inputs[0]
        else:
            tensor = _checked_input(model, header.inputs)
            shared = region_ref(header.inputs[0].parameters, "inputs[0]")
            decoder.check_data(tensor, shared is not None)
        model.check_batch_size(tensor.shape[0], f"inputs[{first}].shape[0]")
        plans = _planned_outputs(model, header.outputs)
        with contextlib.ExitStack() as held:  # the regions named, held until answered
            images: np.ndarray | RegionImages
            if pose_inputs is not None:
                (poses_index, poses), (classes_index, classes) = pose_inputs
                images = decoder_rows((await decoder.values(poses, poses_index)).reshape(poses.shape),
                                      await decoder.values(classes, classes_index))
            elif shared is not None:
                expected = tensor.count * tensor.dtype.itemsize
                if shared.byte_size != expected:
                    raise InvalidInput(f"inputs[0].parameters.shared_memory_byte_size: expected {expected} bytes for "
                                       f"{tensor.datatype} shape {tensor.shape}, got {shared.byte_size}")
                region = held.enter_context(self.shared_memory.held(shared, "inputs[0]"))
                images = RegionImages(region, shared.offset, tuple(tensor.shape), tensor.datatype, tensor.dtype,
                                      "inputs[0]")
            else:
                images = images_from_values(await decoder.values(tensor), tensor)
            regions = {plan.name: held.enter_context(self.shared_memory.held(plan.region, f"outputs[{index}]"))
                       for index, plan in enumerate(plans) if plan.region is not None}
            sinks: dict[str, OutputSink] = {}  # written into their regions by the batcher, from the batch's outputs
            for index, plan in enumerate(plans):
                if plan.region is not None and plan.classes is None:
                    shape = (tensor.shape[0], *spec.output_shapes[plan.name])
                    check_room(plan.region, math.prod(shape) * 4, shape, f"outputs[{index}]")
                    sinks[plan.name] = RegionOutput(regions[plan.name], plan.region.offset, shape[1:],
                                                    f"outputs[{index}]")
            names = [plan.name for plan in plans]
            result = await model.infer(images, field="inputs[0]", reconstruction="reconstruction" in names,
                                       deadline=request.deadline, arrival=request.arrival, sinks=sinks)
            outputs = [Output(plan.name, "FP32", (tensor.shape[0], *spec.output_shapes[plan.name]), None)
                       if plan.name in sinks else
                       self._answer(plan, result.outputs[plan.name], spec, regions.get(plan.name), f"outputs[{index}]")
                       for index, plan in enumerate(plans)]
        return InferResponse(spec.name, spec.version, header.id, outputs)

    @staticmethod
    def _answer(plan: OutputPlan, array: np.ndarray, spec: ModelSpec, region: Region | None, field: str) -> Output:
        """An output as asked and not sunk by the batcher: classified or not, written into its region (classes) or
        carried in the answer."""
        datatype, data = "FP32", array
        if plan.classes is not None:
            datatype, data = "BYTES", classify(array, plan.classes, spec.class_names)
        if region is None or plan.region is None:
            return Output(plan.name, datatype, data.shape, data)
        raw = (np.frombuffer(serialize_bytes(data), np.uint8) if datatype == "BYTES"
               else np.ascontiguousarray(data, "<f4"))
        check_room(plan.region, raw.nbytes, data.shape, field)
        region.write(raw, plan.region.offset, field)
        return Output(plan.name, datatype, data.shape, None)


def _checked_input(model: InferenceService, inputs: list[InferInput]) -> InputTensor:
    """check_input, remembered per version for the headers it accepted (the check is of the header and the version
    alone; a version takes a few shapes: batch sizes, and sizes of a model of any size)."""
    if len(inputs) != 1:
        return check_input(model.spec, inputs)
    name, datatype, shape, _ = inputs[0]
    return _remembered(model.accepted_inputs, (name, datatype, *shape), lambda: check_input(model.spec, inputs))


def _planned_outputs(model: InferenceService, outputs: list[RequestedOutput]) -> list[OutputPlan]:
    """requested_outputs, remembered per version for the lists of names it accepted without parameters (most
    clients name the same outputs in every request, or none)."""
    if any(parameters for _, parameters in outputs):
        return requested_outputs(model.spec, outputs)
    return _remembered(model.accepted_outputs, tuple(name for name, _ in outputs),
                       lambda: requested_outputs(model.spec, outputs))


def _remembered(accepted: dict, key: tuple, check: Callable[[], Any]) -> Any:
    """What check() answers for `key`, remembered in `accepted` (up to ACCEPTED_HEADERS keys) once it has passed; a
    refusal raises and is not remembered."""
    found = accepted.get(key)
    if found is None:
        found = check()
        if len(accepted) < ACCEPTED_HEADERS:
            accepted[key] = found
    return found


def _one_repository(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name: this server has one model repository; leave it empty, got "
                           f"{name[:40]!r}")
