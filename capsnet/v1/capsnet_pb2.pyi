import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_FLOAT32: DataType

class ClassifyRequest(_message.Message):
    __slots__ = ("images", "exclude_poses", "include_reconstruction", "top_k", "request_id", "model_name", "model_version", "present_threshold")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_POSES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_RECONSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRESENT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    exclude_poses: bool
    include_reconstruction: bool
    top_k: int
    request_id: str
    model_name: str
    model_version: str
    present_threshold: float
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., exclude_poses: bool = ..., include_reconstruction: bool = ..., top_k: _Optional[int] = ..., request_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., present_threshold: _Optional[float] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("encoded", "tensor")
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    encoded: bytes
    tensor: Tensor
    def __init__(self, encoded: _Optional[bytes] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("results", "model_name", "model_version", "timing", "request_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    model_name: str
    model_version: str
    timing: ServerTiming
    request_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("probabilities", "predicted_class", "predicted_name", "poses", "reconstruction", "top_classes", "present_classes", "resized_from")
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_NAME_FIELD_NUMBER: _ClassVar[int]
    POSES_FIELD_NUMBER: _ClassVar[int]
    RECONSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    TOP_CLASSES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_CLASSES_FIELD_NUMBER: _ClassVar[int]
    RESIZED_FROM_FIELD_NUMBER: _ClassVar[int]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    predicted_class: int
    predicted_name: str
    poses: FloatArray
    reconstruction: FloatArray
    top_classes: _containers.RepeatedCompositeFieldContainer[ClassScore]
    present_classes: _containers.RepeatedCompositeFieldContainer[ClassScore]
    resized_from: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, probabilities: _Optional[_Iterable[float]] = ..., predicted_class: _Optional[int] = ..., predicted_name: _Optional[str] = ..., poses: _Optional[_Union[FloatArray, _Mapping]] = ..., reconstruction: _Optional[_Union[FloatArray, _Mapping]] = ..., top_classes: _Optional[_Iterable[_Union[ClassScore, _Mapping]]] = ..., present_classes: _Optional[_Iterable[_Union[ClassScore, _Mapping]]] = ..., resized_from: _Optional[_Iterable[int]] = ...) -> None: ...

class FloatArray(_message.Message):
    __slots__ = ("shape", "values")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class ClassScore(_message.Message):
    __slots__ = ("index", "name", "probability")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    probability: float
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., probability: _Optional[float] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue", "compute", "total")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    queue: _duration_pb2.Duration
    compute: _duration_pb2.Duration
    total: _duration_pb2.Duration
    def __init__(self, queue: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., compute: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., total: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("name", "version", "input_name", "input_shape", "class_names", "pose_dim", "output_names", "max_batch_size", "backend", "precision", "routing", "self_check", "choice", "input_sizes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUT_NAME_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    POSE_DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    INPUT_SIZES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    input_name: str
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    class_names: _containers.RepeatedScalarFieldContainer[str]
    pose_dim: int
    output_names: _containers.RepeatedScalarFieldContainer[str]
    max_batch_size: int
    backend: str
    precision: str
    routing: Routing
    self_check: SelfCheck
    choice: str
    input_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., input_name: _Optional[str] = ..., input_shape: _Optional[_Iterable[int]] = ..., class_names: _Optional[_Iterable[str]] = ..., pose_dim: _Optional[int] = ..., output_names: _Optional[_Iterable[str]] = ..., max_batch_size: _Optional[int] = ..., backend: _Optional[str] = ..., precision: _Optional[str] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., self_check: _Optional[_Union[SelfCheck, _Mapping]] = ..., choice: _Optional[str] = ..., input_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class SelfCheck(_message.Message):
    __slots__ = ("precision", "images", "argmax_agreement", "max_abs_diff", "passed", "cpu")
    class MaxAbsDiffEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    precision: str
    images: int
    argmax_agreement: float
    max_abs_diff: _containers.ScalarMap[str, float]
    passed: bool
    cpu: str
    def __init__(self, precision: _Optional[str] = ..., images: _Optional[int] = ..., argmax_agreement: _Optional[float] = ..., max_abs_diff: _Optional[_Mapping[str, float]] = ..., passed: bool = ..., cpu: _Optional[str] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("variant", "iterations", "squash_constant")
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    SQUASH_CONSTANT_FIELD_NUMBER: _ClassVar[int]
    variant: str
    iterations: int
    squash_constant: float
    def __init__(self, variant: _Optional[str] = ..., iterations: _Optional[int] = ..., squash_constant: _Optional[float] = ...) -> None: ...
