"""model.json's schema: `ModelDescription`, what export writes and every stage reads back through `from_json`,
which checks every key.

Every file an export writes is listed with its SHA-256 under `sha256`; readers resolve names only
inside the model directory (`resolve`), so a model.json cannot point at other files.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsnet.errors import CapsNetError
from capsnet.model_description.decoder import DecoderDescription
from capsnet.model_description.files import AOTI_PRECISIONS, SIDECAR_NAME, file_sha256, read_json
from capsnet.model_description.input_sizes import INPUT_SIZE_KEYS, InputSizes
from capsnet.model_description.backend_table import GATE_VARIANTS
from capsnet.model_description.precision_gate import GATE_KEYS, PrecisionGate, gate_criterion

FORMAT_NAME = "capsnet-model"
# 2: file hashes, the self-check reference set, the INT8 gate's data and CPU, the FP16 gate
# 3: AOTInductor packages; one precision gate for INT8, FP16 and BF16, measured per model (`precision_gate`)
# 4: a model without capsules (the CNN baselines): `probabilities` may be its only output and `routing` null. A model
#    with poses and routing means what it meant in 3 and is written as 3, so that servers reading 3 only still load
#    it; one without is written as 4, which they refuse by its version rather than as damaged.
FORMAT_VERSION = 4
FORMAT_VERSION_WITH_CAPSULES = 3
MODEL_NAME = "capsnet"
MODEL_VERSION = "1"
INPUT_NAME = "images"
PROBABILITIES_NAME = "probabilities"
POSES_NAME = "poses"
RECONSTRUCTION_NAME = "reconstruction"
# every output a model may have, in model.json's order: probabilities always, poses for a model with capsules, the
# decoder's reconstruction when exported with it
OUTPUT_NAMES = (PROBABILITIES_NAME, POSES_NAME, RECONSTRUCTION_NAME)
# `artifacts` key of each precision's ONNX file
ONNX_KEYS = {"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8"}
ARTIFACT_KEYS = ("onnx", "onnx_int8", "onnx_fp16", "tensorrt", "checkpoint", "reference")
AOTI_KEYS = ("file", "device", "precision", "torch_version", "min_batch", "max_batch", "built_on", "compute_capability",
             "parity")


@dataclass(frozen=True)
class AotiPackage:
    """One AOTInductor package (torch._inductor.aoti_compile_and_package): compiled for one device kind, precision and
    torch version, for batches of min_batch to max_batch images."""

    file: str
    device: str  # "cpu" | "cuda"
    precision: str
    torch_version: str  # the torch that compiled it; another one is refused
    min_batch: int
    max_batch: int
    built_on: str  # the GPU's name, or the CPU's description
    compute_capability: str | None  # CUDA: "major.minor" of the GPU it was compiled for
    parity: dict  # against eager PyTorch FP32 (fp32), or the precision gate's figures (fp16, bf16)

    def describe(self) -> str:
        where = f"{self.device} ({self.built_on}{f', sm {self.compute_capability}' if self.compute_capability else ''})"
        return (f"{self.file}: {where} {self.precision}, batch {self.min_batch}-{self.max_batch}, "
                f"torch {self.torch_version}")

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in AOTI_KEYS}


@dataclass(frozen=True)
class ModelDescription:
    input_shape: tuple[int, int, int]  # (C, H, W), float32 in [0, 1], NCHW
    class_names: tuple[str, ...]
    # without the batch axis: probabilities (J,)[, poses (J, D)][, reconstruction]
    output_shapes: dict[str, tuple[int, ...]]
    # {"variant", "iterations", "squash_constant", "gpu_engine"} (gpu_engine: "fused" or "unfused: <why>"), or EM's
    # {"variant": "em", "iterations", "inverse_temperature"};
    # {} for a model without routing (written as null)
    routing: dict
    artifacts: dict[str, str | None]  # ARTIFACT_KEYS -> file name in the model directory (None: not exported)
    opset: int
    name: str = MODEL_NAME
    version: str = MODEL_VERSION
    input_name: str = INPUT_NAME
    exporter_version: str = ""
    created: str = ""  # ISO-8601 UTC
    sha256: dict[str, str] = field(default_factory=dict)  # file name -> digest, for every listed file
    training_metrics: dict = field(default_factory=dict)
    reference_set: dict | None = None  # {"images", "dataset", "split"} of reference.npz
    int8: dict | None = None  # how the INT8 model was made: calibration, scheme, the CPU that quantised it
    parity: dict = field(default_factory=dict)  # exported graphs against their reference
    precision_gate: dict[str, PrecisionGate] = field(default_factory=dict)  # GATE_VARIANTS -> what export measured
    aoti: tuple[AotiPackage, ...] = ()  # AOTInductor packages
    # file name -> why not written: variants the export was asked for and the precision gate refused (their figures
    # are under precision_gate); absent from older exports, which wrote nothing when one was refused
    refused: dict[str, str] = field(default_factory=dict)
    input_sizes: InputSizes | None = None  # the sizes taken; None: input_shape only (filled in by __post_init__)
    decoder: DecoderDescription | None = None  # the decoder alone (exported with the reconstruction); absent before

    def __post_init__(self):
        if self.input_sizes is None:
            object.__setattr__(self, "input_sizes", InputSizes.fixed_at(self.input_shape))

    @property
    def sizes(self) -> InputSizes:
        assert self.input_sizes is not None  # __post_init__
        return self.input_sizes

    @property
    def input_dims(self) -> list[int]:
        return self.sizes.dims(self.input_shape)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self.output_shapes)

    @property
    def pose_dim(self) -> int:
        """The length of each class's pose vector; 0 for a model without poses."""
        poses = self.output_shapes.get(POSES_NAME)
        return poses[1] if poses else 0

    @property
    def format_version(self) -> int:
        """The oldest format that describes this model (FORMAT_VERSION's comment)."""
        return FORMAT_VERSION_WITH_CAPSULES if self.pose_dim and self.routing else FORMAT_VERSION

    def to_json(self, with_hashes: bool = True) -> dict[str, Any]:
        """model.json's content; without the hashes it is what each ONNX file embeds (a file cannot hold its own
        hash)."""
        channels, height, width = self.input_shape
        values = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "name": self.name,
            "version": self.version,
            "exporter_version": self.exporter_version,
            "created": self.created,
            "opset": self.opset,
            "input": {"name": self.input_name, "datatype": "FP32", "layout": "NCHW",
                      "shape": [channels, height, width], "sizes": self.sizes.to_dict(), "value_range": [0.0, 1.0]},
            "outputs": [{"name": name, "datatype": "FP32", "shape": list(shape)}
                        for name, shape in self.output_shapes.items()],
            "class_names": list(self.class_names),
            "routing": self.routing or None,
            "artifacts": {key: self.artifacts.get(key) for key in ARTIFACT_KEYS},
            "sha256": self.sha256,
            "reference_set": self.reference_set,
            "training_metrics": self.training_metrics,
            "int8": self.int8,
            "parity": self.parity,
            "precision_gate": {"criterion": gate_criterion(),
                               "variants": {name: gate.to_json() for name, gate in self.precision_gate.items()}},
            "aoti": [package.to_json() for package in self.aoti],
            "refused": self.refused,
            "decoder": self.decoder.to_json() if self.decoder else None,
        }
        if not with_hashes:
            del values["sha256"]
        return values

    def write(self, directory: Path) -> None:
        (directory / SIDECAR_NAME).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def read(cls, directory: str | os.PathLike) -> "ModelDescription":
        """DIR/model.json, checked; CapsNetError naming the file and the key otherwise."""
        directory = Path(directory)
        path = directory / SIDECAR_NAME
        try:
            if not directory.is_dir():
                raise CapsNetError(f"model directory {directory} does not exist" if not directory.exists()
                                   else f"model directory {directory} is not a directory")
            if not path.is_file():
                raise CapsNetError(f"{directory} is not a capsnet model directory (no {SIDECAR_NAME}); make one with "
                                   "`capsnet export`")
        except OSError as err:  # a directory this user may not search (is_file raises EACCES, not False)
            raise CapsNetError(f"cannot read {err.filename or path}: {err.strerror or err}") from None
        return cls.from_json(read_json(path), str(path))

    @classmethod
    def from_json(cls, values: Any, source: str) -> "ModelDescription":
        reader = _Reader(source)
        if not isinstance(values, dict) or values.get("format") != FORMAT_NAME:
            raise reader.fail(f"'format' is not {FORMAT_NAME!r}")
        version = values.get("format_version")
        if type(version) is not int or version not in (FORMAT_VERSION_WITH_CAPSULES, FORMAT_VERSION):
            raise CapsNetError(f"{source} has format version {version!r}; this capsnet-serve reads versions "
                               f"{FORMAT_VERSION_WITH_CAPSULES} and {FORMAT_VERSION} (re-export the checkpoint with "
                               "`capsnet export`)")
        model_input = reader.get(values, "input", dict)
        input_shape = tuple(reader.get(model_input, "shape", list, "input."))
        if len(input_shape) != 3 or not all(isinstance(d, int) and d > 0 for d in input_shape):
            raise reader.fail(f"input.shape must be [C, H, W] of positive integers, got {list(input_shape)}")
        if model_input.get("datatype") != "FP32" or model_input.get("layout") != "NCHW":
            raise reader.fail("input must be FP32 NCHW")
        class_names = tuple(reader.get(values, "class_names", list))
        if not class_names or not all(isinstance(n, str) for n in class_names):
            raise reader.fail("class_names must be a non-empty list of strings")
        output_shapes = reader.output_shapes(values, len(class_names), input_shape, version)
        artifacts = reader.get(values, "artifacts", dict)
        for key, name in artifacts.items():
            if key not in ARTIFACT_KEYS or not (name is None or isinstance(name, str)):
                raise reader.fail(f"artifacts.{key} is not one of {', '.join(ARTIFACT_KEYS)} with a file name or null")
        for key in ("onnx", "checkpoint", "reference"):
            if not artifacts.get(key):
                raise reader.fail(f"artifacts.{key} is not set")
        sha256 = reader.get(values, "sha256", dict)
        aoti = reader.aoti(values)
        decoder = reader.decoder(values, output_shapes)
        listed = [*(name for name in artifacts.values() if name), *(package.file for package in aoti),
                  *([decoder.file] if decoder else [])]
        unhashed = [name for name in listed if not isinstance(sha256.get(name), str)]
        if unhashed:
            raise reader.fail(f"sha256 has no digest for {', '.join(unhashed)}")
        optional = {key: reader.get(values, key, (dict, type(None))) for key in ("reference_set", "int8")}
        # informational, and absent from older exports, but served in GetModelInfo: objects or nothing
        extra = {key: dict(reader.get(values, key, (dict, type(None))) or {}) if key in values else {}
                 for key in ("training_metrics", "parity")}
        return cls(
            input_shape=input_shape,
            class_names=class_names,
            output_shapes=output_shapes,
            routing=reader.routing(values, version),
            artifacts={key: artifacts.get(key) for key in ARTIFACT_KEYS},
            opset=reader.get(values, "opset", int),
            name=reader.get(values, "name", str),
            version=str(reader.get(values, "version", (str, int))),
            input_name=reader.get(model_input, "name", str, "input."),
            exporter_version=str(values.get("exporter_version", "")),
            created=str(values.get("created", "")),
            sha256=dict(sha256),
            precision_gate=reader.precision_gate(values),
            aoti=aoti,
            refused=reader.refused(values),
            input_sizes=reader.input_sizes(model_input, input_shape),
            decoder=decoder,
            **extra,
            **optional,
        )

    def description_fields(self) -> dict[str, Any]:
        """The description's own fields (a subclass's left out), to build a subclass that adds to them."""
        return {name: getattr(self, name) for name in ModelDescription.__dataclass_fields__}

    def resolve(self, directory: Path, name: str | None, what: str) -> Path:
        """`name` inside `directory`, existing, and with the digest model.json records; CapsNetError otherwise."""
        source = directory / SIDECAR_NAME
        if not name:  # an artifact model.json records as not exported
            raise CapsNetError(f"{source} is damaged: it lists no file for {what}")
        try:
            root = directory.resolve()
            path = (root / name).resolve()
            inside = not Path(name).is_absolute() and root in path.parents
            exists = inside and path.is_file()
            digest = file_sha256(path) if exists else ""
        except (OSError, ValueError, RuntimeError) as err:
            # OSError: unreadable, name too long; ValueError: a NUL in the name; RuntimeError: a symlink loop
            if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EIO):
                raise CapsNetError(f"cannot read {err.filename or directory / name}: {err.strerror}") from None
            raise CapsNetError(f"{source} is damaged: {what} {name[:100]!r} cannot be opened inside {directory} "
                               f"({(err.strerror if isinstance(err, OSError) else None) or str(err)[:200]})") from None
        if not inside:
            raise CapsNetError(f"{source} is damaged: {what} {name!r} is not a file inside {directory}")
        if not exists:
            raise CapsNetError(f"{source} is damaged: it lists {what} {name!r}, which is missing from {directory}")
        if digest != self.sha256.get(name):
            raise CapsNetError(f"{path} does not match {source} (sha256 {digest[:12]}…, recorded "
                               f"{str(self.sha256.get(name))[:12]}…): the file was changed after export; "
                               "re-export it")
        return path


class _Reader:
    """Typed access to model.json fields, with errors that name the file and the key."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, message: str) -> CapsNetError:
        return CapsNetError(f"{self.source} is damaged: {message}")

    def get(self, table: dict, key: str, kind: type | tuple[type, ...], where: str = ""):
        if key not in table:
            raise self.fail(f"missing key {where}{key!r}")
        value = table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(f"{where}{key!r} has the wrong type ({type(value).__name__})")
        return value

    def routing(self, values: dict, version: int) -> dict:
        """The routing facts GetModelInfo sends as a proto (string variant, int32 iterations, float constants):
        a wrong type there would pass startup and fail every GetModelInfo call. Null from version 4: no routing."""
        if version >= FORMAT_VERSION and self.get(values, "routing", (dict, type(None))) is None:
            return {}
        routing = dict(self.get(values, "routing", dict))
        self.get(routing, "variant", str, "routing.")
        iterations = self.get(routing, "iterations", int, "routing.")
        if not 0 < iterations < 2**31:
            raise self.fail(f"routing.iterations must be a positive 32-bit integer, got {iterations}")
        if "gpu_engine" in routing:
            self.get(routing, "gpu_engine", str, "routing.")
        for key in ("squash_constant", "inverse_temperature"):
            if key in routing:
                value = self.get(routing, key, (int, float), "routing.")
                if isinstance(value, bool) or not math.isfinite(value):
                    raise self.fail(f"routing.{key} must be a finite number, got {value!r}")
        return routing

    def input_sizes(self, model_input: dict, shape: tuple[int, int, int]) -> InputSizes:
        """input.sizes: the sizes taken, which must hold input.shape (the size the reference images have);
        absent: input.shape only."""
        if "sizes" not in model_input:
            return InputSizes.fixed_at(shape)
        sizes = self.get(model_input, "sizes", dict, "input.")
        values = {key: self.get(sizes, key, int, "input.sizes.") for key in INPUT_SIZE_KEYS}
        if min(values.values()) < 1 or values["min_height"] > values["max_height"] or (
                values["min_width"] > values["max_width"]):
            raise self.fail(f"input.sizes must be positive with min <= max, got {values}")
        taken = InputSizes(**values)
        if shape not in taken:
            raise self.fail(f"input.shape {list(shape)} is not one of the input.sizes ({taken.describe()})")
        return taken

    def precision_gate(self, values: dict) -> dict[str, PrecisionGate]:
        """The gate's entries; the server compares and counts with them, so each is typed."""
        variants = self.get(self.get(values, "precision_gate", dict), "variants", dict, "precision_gate.")
        gates = {}
        for name, entry in variants.items():
            where = f"precision_gate.variants.{name}."
            if name not in GATE_VARIANTS or not isinstance(entry, dict):
                raise self.fail(f"precision_gate.variants.{name} is not one of {', '.join(GATE_VARIANTS)} with an "
                                "object")
            numbers = {key: self.get(entry, key, (int, float), where) for key in GATE_KEYS
                       if key not in ("precision", "computed_by", "measured_on", "test_images", "reference_images")}
            # the differences may be infinite: export records a variant with NaN outputs as not accepted
            if not all(math.isfinite(value) for key, value in numbers.items() if not key.endswith("diff")) or not (
                    0 <= numbers["argmax_agreement"] <= 1 and numbers["max_abs_diff"] >= 0):
                raise self.fail(f"{where[:-1]} needs finite numbers, argmax_agreement in [0, 1], max_abs_diff >= 0")
            counts = {key: self.get(entry, key, int, where) for key in ("test_images", "reference_images")}
            if min(counts.values()) < 1:
                raise self.fail(f"{where[:-1]} counts no images")
            precision = self.get(entry, "precision", str, where)
            if precision != name.partition("_")[2]:
                raise self.fail(f"{where}precision is {precision!r}, the variant {name!r} is {name.partition('_')[2]}")
            measured: dict[str, Any] = {**counts, **{key: float(value) for key, value in numbers.items()}}
            gates[name] = PrecisionGate(precision=precision, computed_by=self.get(entry, "computed_by", str, where),
                                        measured_on=self.get(entry, "measured_on", str, where), **measured)
        return gates

    def refused(self, values: dict) -> dict[str, str]:
        """The variants the precision gate refused, by file name, with why; none before exports recorded them."""
        if "refused" not in values:
            return {}
        refused = self.get(values, "refused", dict)
        if not all(isinstance(name, str) and isinstance(why, str) for name, why in refused.items()):
            raise self.fail("refused must map file names to reasons (strings)")
        listed = [name for name in refused if name in values.get("sha256", {})]
        if listed:
            raise self.fail(f"refused names {', '.join(listed)}, which sha256 lists as written")
        return dict(refused)

    def decoder(self, values: dict, outputs: dict[str, tuple[int, ...]]) -> DecoderDescription | None:
        """The decoder alone, of the model's own poses and reconstruction; absent or null: none."""
        if values.get("decoder") is None:
            return None
        if POSES_NAME not in outputs or RECONSTRUCTION_NAME not in outputs:
            raise self.fail("decoder is listed, but the model's outputs have no poses and reconstruction to decode")
        (classes, pose_dim), (size,) = outputs[POSES_NAME], outputs[RECONSTRUCTION_NAME]
        return DecoderDescription.from_json(values["decoder"], self.fail, classes, pose_dim, size)

    def aoti(self, values: dict) -> tuple[AotiPackage, ...]:
        packages = []
        for index, entry in enumerate(self.get(values, "aoti", list)):
            where = f"aoti[{index}]."
            if not isinstance(entry, dict):
                raise self.fail(f"aoti[{index}] is not an object")
            device = self.get(entry, "device", str, where)
            precision = self.get(entry, "precision", str, where)
            if precision not in AOTI_PRECISIONS.get(device, ()):
                raise self.fail(f"aoti[{index}] is {device} {precision}; packages are cpu fp32 or cuda fp32|fp16|bf16")
            batches = [self.get(entry, key, int, where) for key in ("min_batch", "max_batch")]
            if not 1 <= batches[0] <= batches[1]:
                raise self.fail(f"aoti[{index}] needs 1 <= min_batch <= max_batch, got {batches}")
            capability = entry.get("compute_capability")
            if (device == "cuda") != isinstance(capability, str):
                raise self.fail(f"{where}compute_capability must be a string for cuda and null for cpu")
            packages.append(AotiPackage(
                file=self.get(entry, "file", str, where), device=device, precision=precision,
                torch_version=self.get(entry, "torch_version", str, where), min_batch=batches[0], max_batch=batches[1],
                built_on=self.get(entry, "built_on", str, where), compute_capability=capability,
                parity=dict(self.get(entry, "parity", dict, where))))
        return tuple(packages)

    def output_shapes(self, values: dict, classes: int, input_shape: tuple[int, int, int],
                      version: int) -> dict[str, tuple[int, ...]]:
        """Each output's shape: probabilities [J], then poses [J, D] (required before version 4), and the
        reconstruction [C*H*W]."""
        shapes: dict[str, tuple[int, ...]] = {}
        for index, output in enumerate(self.get(values, "outputs", list)):
            if not isinstance(output, dict):
                raise self.fail(f"outputs[{index}] is not an object")
            shape = self.get(output, "shape", list, f"outputs[{index}].")
            if not all(isinstance(d, int) and d > 0 for d in shape):
                raise self.fail(f"outputs[{index}].shape must be positive integers, got {shape}")
            name = self.get(output, "name", str, f"outputs[{index}].")
            if name not in OUTPUT_NAMES:  # every backend returns only these
                raise self.fail(f"outputs[{index}].name {name!r} is not one of {', '.join(OUTPUT_NAMES)}")
            if name in shapes:
                raise self.fail(f"outputs[{index}].name {name!r} is listed twice")
            shapes[name] = tuple(shape)
        if shapes.get(PROBABILITIES_NAME) != (classes,):
            raise self.fail(f"outputs must include probabilities [{classes}]")
        poses = shapes.get(POSES_NAME)
        if poses is None and version < FORMAT_VERSION:
            raise self.fail(f"outputs must include poses [{classes}, D] in format version {version} (a model without "
                            f"poses is format version {FORMAT_VERSION})")
        if poses is not None and (len(poses) != 2 or poses[0] != classes):
            raise self.fail(f"output poses must have shape [{classes}, D], got {list(poses)}")
        channels, height, width = input_shape
        if RECONSTRUCTION_NAME in shapes and shapes[RECONSTRUCTION_NAME] != (channels * height * width,):
            raise self.fail(f"output reconstruction must have shape [{channels * height * width}]")
        return shapes

