"""`capsnet export`: a checkpoint in, serving artifacts out (docs/artifacts.md is the contract).

Everything is written to a temporary directory beside the target and renamed into place once
complete, so a failed or interrupted export never leaves half an artifact set, and a previous
export in the target is only replaced by a complete new one. The ONNX graph must match PyTorch
on real images before anything is published.

A requested TensorRT engine that cannot be built (no GPU, no tensorrt package, a failed build or
parity check) does not hold back the other artifacts: they are published, then the export fails.
Nor does a reduced-precision variant that the precision gate refuses: FP32 and the variants that pass
are published, and model.json names the refused one under `refused`, its figures under `precision_gate`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from capsnet.runtime.cpu import CpuKind
from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig, ExportConfig
from capsnet.export.decoder import check_decoder, export_decoder
from capsnet.export import aoti
from capsnet.export.fp16 import convert_fp16
from capsnet.export.metadata import describe, embed_metadata, output_shapes
from capsnet.export.onnx_export import check_graph, export_onnx, export_program, graph_opset, op_counts
from capsnet.export.parity import (
    FP32_TOLERANCE,
    PARITY_BATCH_SIZES,
    Batch,
    Outputs,
    compare,
    onnxruntime_outputs,
    onnxruntime_session,
    onnxruntime_probabilities,
    parity_batches,
    spread,
    tiled,
    torch_outputs,
)
from capsnet.export.precision import measure_gate, torch_gates
from capsnet.export.quantize import SCHEME, quantize_int8
from capsnet.export.tensorrt_build import (
    MIN_ARGMAX_AGREEMENT,
    PARITY_TOLERANCE,
    build_engine,
    engine_outputs,
    source_variant,
    tensorrt_major_version,
)
from capsnet.export.tensorrt_ops import tensorrt_problems
from capsnet.export.triton import CONFIG_NAME, write_decoder_directory, write_model_directory
from capsnet.model_description.decoder import DecoderDescription, decoder_model_name
from capsnet.model_description.files import (
    CHECKPOINT_NAME,
    ONNX_FP16_NAME,
    ONNX_INT8_NAME,
    ONNX_NAME,
    PLAN_INFO_NAME,
    PLAN_NAME,
    REFERENCE_NAME,
    SIDECAR_NAME,
    file_sha256,
)
from capsnet.model_description.precision_gate import PrecisionGate, compare_outputs, outputs_in_batches
from capsnet.model_description.schema import MODEL_NAME, AotiPackage, ModelDescription
from capsnet.runtime.tensorrt_runner import unavailable_reason
from capsnet.runtime.torch_runner import cuda_unavailable_reason
from capsnet.runtime.fused_support import fused_unsupported_reason
from capsnet.runtime.reduced_precision import convolutions_in
from capsnet.models.checkpoint import Checkpoint, load_checkpoint
from capsnet.models.config import CAPSULE_ARCHITECTURES
from capsnet.training.data import Dataset
from capsnet.training.evaluate import load_checkpoint_data
from capsnet.training.pose import measure_pose

if TYPE_CHECKING:
    from onnxruntime import InferenceSession
    from torch.export import ExportedProgram

log = logging.getLogger(__name__)

REFERENCE_IMAGES = 128  # the self-check's images; the precision gate's figures are measured on them
# (H, W) a model of any size is checked at besides its own: one and two digits side by side, four, a wide image
# whose backbone grid is neither square nor any multiple of the training size, and an odd height and width, which
# the backbone's pools floor; those it takes
PARITY_SIZES = ((28, 28), (28, 56), (56, 56), (40, 100), (29, 45))
SIZE_PARITY_IMAGES = 7


def _check_model_options(checkpoint: Checkpoint, config: ExportConfig) -> None:
    """What the model cannot be exported with, refused at once in one line: a model of any size has no decoder, and
    the TensorRT engine and AOTInductor packages are built here for one image size (rather than exported for 28×28
    only); a CNN baseline has no decoder either."""
    arch, sizes = checkpoint.config.arch, checkpoint.config.input_sizes
    if not sizes.fixed:
        asked = [option for option, wanted in (("--reconstruction", config.reconstruction),
                                               ("--tensorrt", config.tensorrt), ("--aoti", config.aoti is not None))
                 if wanted]
        if asked:
            raise CapsNetError(f"a {arch} model takes {sizes.describe()}; {' and '.join(asked)} "
                               f"{'is' if len(asked) == 1 else 'are'} for models of one size (it has no decoder, and "
                               "the engine and packages are built for one size): export its ONNX graphs without them")
    if config.reconstruction and arch not in CAPSULE_ARCHITECTURES:
        raise CapsNetError(f"a {arch} model has no decoder, so no reconstruction: --reconstruction is for "
                           f"{' and '.join(CAPSULE_ARCHITECTURES)} models; export it without")


def export_model(checkpoint_path: str | os.PathLike, out_dir: str | os.PathLike, **options: Any) -> ModelDescription:
    """Export `checkpoint_path` into `out_dir`; `options` are ExportConfig fields. Returns its description."""
    config = ExportConfig(**options)
    if not str(out_dir):  # Path("") is the working directory
        raise CapsNetError("--out needs a directory, got an empty path")
    checkpoint_path, out_dir = Path(checkpoint_path), Path(out_dir)
    checkpoint = load_checkpoint(checkpoint_path)
    _check_model_options(checkpoint, config)
    _check_target(out_dir, SIDECAR_NAME)
    triton_model_dir = Path(config.triton_repo) / MODEL_NAME if config.triton_repo else None
    # the decoder alone is a model of its own in the Triton repository, beside the classifier
    triton_decoder_dir = (triton_model_dir.parent / decoder_model_name(MODEL_NAME)
                          if triton_model_dir is not None and config.reconstruction else None)
    if triton_model_dir is not None:
        if triton_model_dir.parent.exists() and not triton_model_dir.parent.is_dir():
            raise CapsNetError(f"Triton repository {triton_model_dir.parent} exists and is not a directory")
        _check_target(triton_model_dir, CONFIG_NAME)
        if triton_decoder_dir is not None:
            _check_target(triton_decoder_dir, CONFIG_NAME)
        _check_apart(out_dir, triton_model_dir.parent)
    _check_aoti_possible(config)
    tensorrt_error = unavailable_reason(config.engine().gpu) if config.tensorrt else None
    if tensorrt_error:
        log.warning("--tensorrt: %s; writing the other artifacts, then failing", tensorrt_error)
    # parity, INT8 calibration and its per-class gate need the model's own data, every class of it
    dataset = load_checkpoint_data(checkpoint, checkpoint_path, config.data, every_class=True)

    staging = _staging_dir(out_dir)
    triton_staging = decoder_staging = None
    try:
        description, tensorrt_error = _write_artifacts(staging, checkpoint_path, checkpoint, dataset, config,
                                                       tensorrt_error)
        if triton_model_dir is not None:
            outside = _outside_repository(triton_model_dir.parent)
            triton_staging = _staging_dir(triton_model_dir, beside=outside)
            model_format = "plan" if description.artifacts["tensorrt"] else "onnx"
            model_file = staging / (PLAN_NAME if model_format == "plan" else ONNX_NAME)
            write_model_directory(triton_staging, description, model_file, model_format, config.triton())
            if triton_decoder_dir is not None and description.decoder is not None:
                decoder_staging = _staging_dir(triton_decoder_dir, beside=outside)
                write_decoder_directory(decoder_staging, triton_decoder_dir.name, description.decoder,
                                        staging / description.decoder.file, config.triton())
        _publish(staging, out_dir)
        if triton_staging is not None and triton_model_dir is not None:  # all or none
            _publish(triton_staging, triton_model_dir)
        if decoder_staging is not None and triton_decoder_dir is not None:
            _publish(decoder_staging, triton_decoder_dir)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in (triton_staging, decoder_staging):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if isinstance(err, OSError):  # a full disk, a file size limit: the user's to fix, in one line
            target = out_dir if triton_staging is None else triton_model_dir  # the Triton copy comes last
            raise CapsNetError(f"cannot write the export to {target}: {err.strerror or err}") from None
        raise
    log.info("wrote %s", out_dir)
    if tensorrt_error:
        refused = f"; refused by the precision gate: {', '.join(description.refused)}" if description.refused else ""
        raise CapsNetError(f"no TensorRT engine: {tensorrt_error} (the other artifacts are in {out_dir}{refused})")
    return description


@dataclass(frozen=True)
class _Fp32Stage:
    """The FP32 graph written into the staging folder and checked: what every later stage measures against."""

    staging: Path
    config: ExportConfig
    checkpoint: Checkpoint  # the staged copy
    dataset: Dataset
    names: tuple[str, ...]  # the outputs, in order
    program: ExportedProgram  # the exported program the ONNX file and the AOTInductor packages come from
    exported: onnx.ModelProto  # the FP32 graph
    path: Path  # its file
    batches: list[Batch]  # the parity batches
    pytorch_outputs: list[Outputs]  # PyTorch's answers on them
    session: InferenceSession  # ONNX Runtime's session of the FP32 graph
    outputs: list[Outputs]  # its answers on the parity batches
    test_probabilities: np.ndarray  # its probabilities on the test split
    reference: _Reference
    parity: dict[str, Any]  # model.json's parity of the FP32 graph against PyTorch


@dataclass(frozen=True)
class _ReducedOnnxStage:
    """The INT8 and FP16 graphs asked for, each measured by the precision gate."""

    int8: dict[str, Any] | None  # model.json's `int8`: how the INT8 graph was made (also when refused)
    gates: dict[str, PrecisionGate]  # "onnx_<precision>" -> its gate entry
    written: dict[str, Path]  # precision -> the graph's file, of those the gate accepted
    parity: dict[str, Any]  # "onnxruntime_<precision>_vs_fp32" -> its parity on the parity batches, if accepted
    refused: dict[str, str]  # file name -> why the gate refused it


def _write_artifacts(staging: Path, checkpoint_path: Path, checkpoint: Checkpoint, dataset: Dataset,
                     config: ExportConfig, tensorrt_error: str | None) -> tuple[ModelDescription, str | None]:
    """Write every artifact into `staging`; returns the description and why no engine was built, if so."""
    fp32 = _write_fp32(staging, _staged_checkpoint(checkpoint_path, checkpoint, staging), dataset, config)
    decoder = _write_decoder(fp32) if config.reconstruction else None
    torch_gates = _gate_torch_variants(fp32)
    reduced = _write_reduced_onnx(fp32)
    variants = {"fp32": fp32.path, **reduced.written}
    aoti_refused: dict[str, str] = {}
    packages = _compile_aoti(staging, fp32.program, fp32.checkpoint, config, fp32.names, fp32.batches,
                             fp32.pytorch_outputs, fp32.reference, torch_gates, aoti_refused)
    for path in variants.values():
        problems = tensorrt_problems(onnx.load(str(path)))
        log.log(logging.WARNING if problems else logging.INFO, "TensorRT compatibility of %s: %s",
                path.name,
                "; ".join(problems) or "every operator supported, every dimension static or computed from the batch")
    tensorrt_parity, tensorrt_error = _write_plan(fp32, variants, tensorrt_error)
    parity = {**fp32.parity, **reduced.parity, **({"tensorrt": tensorrt_parity} if tensorrt_parity else {})}
    description = describe(fp32.checkpoint, graph_opset(fp32.exported), config.reconstruction,
                           artifacts=_artifact_files(reduced, tensorrt_parity is not None),
                           reference_set=fp32.reference.description, int8=reduced.int8, parity=parity,
                           precision_gate={**torch_gates, **reduced.gates}, aoti=packages,
                           refused={**reduced.refused, **aoti_refused}, decoder=decoder)
    return _write_description(staging, description, variants, decoder, packages), tensorrt_error


def _write_fp32(staging: Path, checkpoint: Checkpoint, dataset: Dataset, config: ExportConfig) -> _Fp32Stage:
    """The FP32 ONNX graph, checked against PyTorch (FP32_TOLERANCE), and the reference images with its answers."""
    model = checkpoint.build_model()
    # a CNN baseline's only output is its probabilities: no poses, as it has no capsules
    names = tuple(output_shapes(checkpoint.config, config.reconstruction))
    path = staging / ONNX_NAME
    # one exported program: the ONNX file and the AOTInductor packages are both made from it
    program = export_program(model, names, config.max_batch if config.aoti else None)
    exported = export_onnx(program, path, config.opset, names)
    counts = op_counts(exported)
    log.info("ONNX opset %d, %d nodes: %s", graph_opset(exported), sum(counts.values()),
             ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    batches = parity_batches(dataset.test.images)
    session = onnxruntime_session(str(path))
    outputs = onnxruntime_outputs(session, batches, names)
    pytorch_outputs = torch_outputs(model, batches, names)
    onnx_parity = compare(pytorch_outputs, outputs)
    log.info("ONNX Runtime vs PyTorch: %s", onnx_parity.describe())
    if not onnx_parity.passes(FP32_TOLERANCE):
        raise CapsNetError(f"ONNX Runtime disagrees with PyTorch beyond {FP32_TOLERANCE:g}: {onnx_parity.describe()}")
    parity: dict[str, Any] = {
        "reference": "pytorch",
        "batch_sizes": list(PARITY_BATCH_SIZES),
        "tolerance": FP32_TOLERANCE,
        "onnxruntime": onnx_parity.to_dict(),
    }
    if not checkpoint.config.input_sizes.fixed:
        parity["sizes"] = _size_parity(model, session, dataset, names)
    return _Fp32Stage(staging, config, checkpoint, dataset, names, program, exported, path, batches, pytorch_outputs,
                      session, outputs, onnxruntime_probabilities(session, dataset.test.images),
                      _write_reference(staging / REFERENCE_NAME, session, dataset, names), parity)


def _write_decoder(fp32: _Fp32Stage) -> DecoderDescription:
    """The decoder alone (export/decoder.py), checked against PyTorch's on the reference images' poses."""
    model = fp32.checkpoint.build_model()
    export_decoder(model, fp32.staging, fp32.config.opset)
    outputs = fp32.reference.outputs
    pose = measure_pose(model, fp32.dataset)
    log.info("%s", pose.describe())
    decoder = check_decoder(model, fp32.staging, outputs["poses"], outputs["probabilities"],
                            outputs["reconstruction"], pose)
    log.info("decoder ONNX Runtime vs PyTorch on %d poses: max |diff| %.2e", decoder.parity["rows"],
             decoder.parity["max_abs_diff"])
    return decoder


def _gate_torch_variants(fp32: _Fp32Stage) -> dict[str, PrecisionGate]:
    """The precision gate's entries of the checkpoint's own reduced precisions (the torch and fused backends'),
    measured by emulation on this CPU. Not refused here: a server refuses them if asked (see the gate)."""
    test, reference = fp32.dataset.test, fp32.reference
    gates = torch_gates(fp32.checkpoint.build_model, reference.images, reference.outputs, test.images, test.labels,
                        fp32.test_probabilities, fp32.config.max_accuracy_drop,
                        fused=fused_unsupported_reason(fp32.checkpoint.config) is None)
    for name, gate in gates.items():
        log.log(logging.INFO if gate.accepted else logging.WARNING, "%s %s%s", name, _describe_gate(gate),
                "" if gate.accepted else "; not accepted, so not served")
    return gates


def _write_reduced_onnx(fp32: _Fp32Stage) -> _ReducedOnnxStage:
    """The INT8 and FP16 graphs asked for, each kept only if the precision gate accepts it."""
    config, cpu = fp32.config, CpuKind.this_host()
    gates: dict[str, PrecisionGate] = {}
    written: dict[str, Path] = {}
    parity: dict[str, Any] = {}
    refused: dict[str, str] = {}

    def gate(precision: str, path: Path) -> None:
        """Kept in `written` if the gate accepts it, else deleted and named in `refused`; its gate entry either way."""
        measured, kept_parity = _gate_onnx_variant(fp32, precision, path, cpu)
        gates[f"onnx_{precision}"] = measured
        if kept_parity is None:
            refused[path.name] = f"{precision.upper()} model refused: {measured.refusal()}"
            log.warning("%s; not written", refused[path.name])
            path.unlink()
        else:
            parity[f"onnxruntime_{precision}_vs_fp32"] = kept_parity
            written[precision] = path

    int8 = None
    if config.wants_int8:
        calibration = fp32.dataset.train.images[: config.calibration_images]
        quantize_int8(fp32.path, fp32.staging / ONNX_INT8_NAME, calibration)
        int8 = {"dataset": fp32.dataset.name, "calibration_images": len(calibration), "cpu": cpu.to_dict(),
                "scheme": SCHEME}
        gate("int8", fp32.staging / ONNX_INT8_NAME)
    if config.wants_fp16:
        fp16_model = convert_fp16(fp32.exported)
        check_graph(fp16_model)
        onnx.save(fp16_model, str(fp32.staging / ONNX_FP16_NAME))
        gate("fp16", fp32.staging / ONNX_FP16_NAME)
    return _ReducedOnnxStage(int8, gates, written, parity, refused)


def _gate_onnx_variant(fp32: _Fp32Stage, precision: str, path: Path,
                       cpu: CpuKind) -> tuple[PrecisionGate, dict[str, Any] | None]:
    """The variant at `path` measured by the precision gate, and where the gate accepts it, its parity against the
    FP32 graph on the parity batches."""
    test, reference, names = fp32.dataset.test, fp32.reference, fp32.names
    session = onnxruntime_session(str(path))
    (outputs,) = onnxruntime_outputs(session, [reference.images], names)
    gate = measure_gate(precision, f"onnxruntime {path.name}", reference.outputs, outputs, test.labels,
                        fp32.test_probabilities, onnxruntime_probabilities(session, test.images),
                        fp32.config.max_accuracy_drop, cpu.describe())
    if not gate.accepted:
        return gate, None
    log.info("%s %s", precision.upper(), _describe_gate(gate))
    return gate, compare(fp32.outputs, onnxruntime_outputs(session, fp32.batches, names)).to_dict()


def _write_plan(fp32: _Fp32Stage, variants: dict[str, Path],
                tensorrt_error: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The TensorRT plan where asked and possible: (its parity where it was built, why not where it was asked for)."""
    if not fp32.config.tensorrt or tensorrt_error is not None:
        return None, tensorrt_error
    try:
        return _build_tensorrt(fp32.staging, variants, fp32.checkpoint.config, fp32.dataset, fp32.names,
                               fp32.config.engine()), None
    except Exception as err:  # TensorRT and CUDA raise their own types; none may cost the other artifacts
        log.debug("TensorRT build failed", exc_info=True)
        (fp32.staging / PLAN_NAME).unlink(missing_ok=True)
        (fp32.staging / PLAN_INFO_NAME).unlink(missing_ok=True)
        return None, str(err) if isinstance(err, CapsNetError) else f"{type(err).__name__}: {err}".splitlines()[0]


def _artifact_files(reduced: _ReducedOnnxStage, plan_built: bool) -> dict[str, str | None]:
    """model.json's `artifacts`: each file by its role, None where it was not written."""
    return {
        "onnx": ONNX_NAME,
        "onnx_int8": ONNX_INT8_NAME if "int8" in reduced.written else None,
        "onnx_fp16": ONNX_FP16_NAME if "fp16" in reduced.written else None,
        "tensorrt": PLAN_NAME if plan_built else None,
        "checkpoint": CHECKPOINT_NAME,
        "reference": REFERENCE_NAME,
    }


def _write_description(staging: Path, description: ModelDescription, variants: dict[str, Path],
                       decoder: DecoderDescription | None, packages: tuple[AotiPackage, ...]) -> ModelDescription:
    """model.json, embedded in every ONNX file too, with the digest of every file written."""
    decoder_files = [staging / decoder.file] if decoder else []
    for path in [*variants.values(), *decoder_files]:
        onnx_model = onnx.load(str(path))
        embed_metadata(onnx_model, description)
        onnx.save(onnx_model, str(path))
    plan_built = description.artifacts["tensorrt"] is not None
    hashed = ([name for name in description.artifacts.values() if name] + ([PLAN_INFO_NAME] if plan_built else [])
              + [package.file for package in packages] + [path.name for path in decoder_files])
    description = replace(description, sha256={name: file_sha256(staging / name) for name in hashed})
    description.write(staging)
    return description


def _staged_checkpoint(checkpoint_path: Path, checkpoint: Checkpoint, staging: Path) -> Checkpoint:
    """Copy the checkpoint into `staging` and export the copy: training may replace `checkpoint_path` meanwhile,
    and model.ckpt then held another model than model.onnx. A copy of another configuration is refused, as the
    data was chosen and checked for the checkpoint loaded first."""
    copy = staging / CHECKPOINT_NAME
    shutil.copyfile(checkpoint_path, copy)
    try:
        staged = load_checkpoint(copy)
    except CapsNetError:  # replaced by something that is no checkpoint
        staged = None
    if staged is None or (staged.config, staged.class_names, staged.dataset) != (
            checkpoint.config, checkpoint.class_names, checkpoint.dataset):
        raise CapsNetError(f"{checkpoint_path} changed while it was being exported; export it again")
    return staged


@dataclass(frozen=True)
class _Reference:
    images: np.ndarray  # (128, C, H, W) float32
    outputs: dict[str, np.ndarray]  # FP32 ONNX Runtime outputs on them
    description: dict[str, Any]  # model.json's reference_set


def _size_parity(model, session, dataset: Dataset, names: tuple[str, ...]) -> dict[str, Any]:
    """The graph of a model of any size against PyTorch at each of PARITY_SIZES it takes, on images of real digits
    (parity.tiled), and each image alone against the batch it came in: a graph whose shapes were mis-traced answers
    one size right and another wrong, or an image differently beside others."""
    results = {}
    sizes = model.config.input_sizes
    for height, width in PARITY_SIZES:
        if (sizes.channels, height, width) not in sizes:
            continue
        batch = tiled(dataset.test.images, SIZE_PARITY_IMAGES, height, width)  # (7, C, H, W)
        (batched,) = onnxruntime_outputs(session, [batch], names)
        size_parity = compare(torch_outputs(model, [batch], names), [batched])
        alone = onnxruntime_outputs(session, [batch[index:index + 1] for index in range(len(batch))], names)
        invariance = compare([{name: batched[name][index:index + 1] for name in names} for index in range(len(batch))],
                             alone)
        size = f"{height}x{width}"
        log.info("ONNX Runtime at %s: vs PyTorch %s; alone vs in a batch %s", size, size_parity.describe(),
                 invariance.describe())
        for what, result in (("disagrees with PyTorch", size_parity), ("answers an image alone differently from in "
                                                                       "a batch", invariance)):
            if not result.passes(FP32_TOLERANCE):
                raise CapsNetError(f"at {size}, ONNX Runtime {what} beyond {FP32_TOLERANCE:g}: {result.describe()}")
        results[size] = {"pytorch": size_parity.to_dict(), "batch_invariance": invariance.to_dict()}
    return results


def _write_reference(path: Path, fp32_session, dataset: Dataset, names: tuple[str, ...]) -> _Reference:
    """The images `capsnet serve` checks its backend with before it reports SERVING, and their FP32 outputs."""
    images = spread(dataset.test.images, REFERENCE_IMAGES)  # (128, C, H, W)
    (outputs,) = onnxruntime_outputs(fp32_session, [images], names)
    # numpy's stub lets **outputs fill allow_pickle; output names are the model's, never that
    np.savez_compressed(path, images=images, **outputs)  # type: ignore[arg-type]
    return _Reference(images, outputs, {"images": len(images), "dataset": dataset.name, "split": "test"})


def _describe_gate(gate: PrecisionGate) -> str:
    return (f"({gate.computed_by}): test accuracy {gate.accuracy_fp32:.2%} -> {gate.accuracy:.2%} "
            f"({gate.accuracy_change_points:+.2f} points); on the {gate.reference_images} reference images same class "
            f"for {gate.argmax_agreement:.1%}, max |diff| of probabilities {gate.max_abs_diff:.2e}")


def _check_aoti_possible(config: ExportConfig) -> None:
    """Refuse at once what would make the AOTInductor packages fail after minutes of other work."""
    if not config.aoti:
        return
    reason = aoti.compiler_unavailable_reason()
    if reason is None and "cuda" in config.aoti_devices:
        reason = cuda_unavailable_reason(config.engine().gpu)
        reason = reason and f"--aoti cuda: {reason}; export the CUDA packages on a GPU machine"
    if reason:
        raise CapsNetError(reason)


def _compile_aoti(staging: Path, program, checkpoint: Checkpoint, config: ExportConfig, names: tuple[str, ...],
                  batches: list[np.ndarray], pytorch_outputs: list, reference: _Reference,
                  gates: dict[str, PrecisionGate], refused: dict[str, str]) -> tuple[AotiPackage, ...]:
    """Compile the asked AOTInductor packages and check each with the runner that serves it: fp32 against eager
    PyTorch (FP32_TOLERANCE, every image the same class), fp16/bf16 by the precision gate on the reference images.
    An fp16/bf16 package whose precision the gate refused is not compiled but named in `refused`."""
    import torch

    from capsnet.runtime.torch_runner import TorchRunner, package_forward

    packages = []
    for device, precision in config.aoti_targets():
        gpu = config.engine().gpu
        target = f"cuda:{gpu}" if device == "cuda" else "cpu"
        path = aoti.package_path(staging, device, precision)
        if precision != "fp32" and not gates[f"torch_{precision}"].accepted:
            refused[path.name] = f"{precision.upper()} package refused: {gates[f'torch_{precision}'].refusal()}"
            log.warning("%s; not compiled", refused[path.name])
            continue
        if precision == "fp32":
            source = program
        else:  # the checkpoint with its convolutions in fp16/bf16, as the torch backend runs it
            model = checkpoint.build_model()
            convolutions_in(model, precision)
            source = export_program(model, names, config.max_batch)
        if device == "cuda":
            source = aoti.move_program(source, target)
        package = aoti.compile_package(source, path, device, precision, gpu, 1, config.max_batch)
        model_config = checkpoint.config
        row_shape = (model_config.in_channels, model_config.height, model_config.width)
        runner = TorchRunner(package_forward(path, torch.device(target)), torch.device(target), row_shape,
                             output_shapes(model_config, config.reconstruction), config.max_batch)
        if precision == "fp32":
            checked = [batch for batch in batches if len(batch) <= config.max_batch]
            expected = [outputs for batch, outputs in zip(batches, pytorch_outputs) if len(batch) <= config.max_batch]
            package_parity = compare(expected, [runner.run(batch) for batch in checked])
            log.info("AOTInductor %s fp32 vs PyTorch: %s", device, package_parity.describe())
            if not package_parity.passes(FP32_TOLERANCE):
                raise CapsNetError(f"the AOTInductor {device} package disagrees with PyTorch beyond "
                                   f"{FP32_TOLERANCE:g}: {package_parity.describe()}")
            result = {"reference": "pytorch", "batch_sizes": [len(batch) for batch in checked],
                      "tolerance": FP32_TOLERANCE, **package_parity.to_dict()}
        else:
            result = _gate_package(runner, reference, gates[f"torch_{precision}"], config.max_batch)
        packages.append(replace(package, parity=result))
    return tuple(packages)


def _gate_package(runner, reference: _Reference, gate: PrecisionGate, max_batch: int) -> dict[str, Any]:
    """A reduced-precision package on the reference images, held to the precision gate as a server would hold it."""
    outputs = outputs_in_batches(runner.run, reference.images, max_batch)
    compared = compare_outputs(reference.outputs, outputs, ("probabilities",))
    agreement, difference = compared.argmax_agreement, compared.max_abs_diff["probabilities"]
    summary = (f"same class for {agreement:.1%}, max |diff| of probabilities {difference:.2e} on "
               f"{compared.images} reference images")
    if not gate.reproduced_by(compared):
        raise CapsNetError(f"the AOTInductor {gate.precision} package fails the precision gate: {summary}; "
                           f"{gate.describe_bounds()}")
    return {"reference": "the precision gate", "argmax_agreement": agreement, "max_abs_diff": difference,
            "images": compared.images}


def _build_tensorrt(staging: Path, variants: dict[str, Path], model_config, dataset, names: tuple[str, ...],
                    engine_config: EngineConfig) -> dict[str, Any]:
    """Build model.plan and model.plan.json, and check the engine against ONNX Runtime on its source graph."""
    precision = engine_config.precision
    source_precision = source_variant(precision, tensorrt_major_version())
    if source_precision not in variants:
        refused_source = {"int8": ONNX_INT8_NAME, "fp16": ONNX_FP16_NAME}[source_precision]
        raise CapsNetError(f"its source {refused_source} was refused by the precision gate")
    source = variants[source_precision]
    problems = tensorrt_problems(onnx.load(str(source)))
    if problems:
        raise CapsNetError(f"{source.name} is not TensorRT-compatible: {problems[0]}")
    image_shape = (model_config.in_channels, model_config.height, model_config.width)
    plan_info = build_engine(source, staging / PLAN_NAME, image_shape, engine_config)
    # The profile's edges and optimum, rather than 1/7/64 that the profile may exclude.
    batch_sizes = sorted({engine_config.min_batch, engine_config.opt_batch, engine_config.max_batch})
    batches = parity_batches(dataset.test.images, batch_sizes)
    reference = onnxruntime_outputs(onnxruntime_session(str(source)), batches, names)
    engine_parity = compare(reference, engine_outputs(staging / PLAN_NAME, batches, names, engine_config))
    tolerance, min_agreement = PARITY_TOLERANCE[precision], MIN_ARGMAX_AGREEMENT[precision]
    log.info("TensorRT %s engine vs ONNX Runtime on %s: %s", precision, source.name, engine_parity.describe())
    if not engine_parity.passes(tolerance, min_agreement):
        raise CapsNetError(f"the TensorRT {precision} engine disagrees with ONNX Runtime beyond {tolerance:g}: "
                           f"{engine_parity.describe()}")
    (staging / PLAN_INFO_NAME).write_text(json.dumps(plan_info, indent=2) + "\n")
    return {"precision": precision, "reference": f"onnxruntime {source.name}", "batch_sizes": batch_sizes,
            "tolerance": tolerance, **engine_parity.to_dict()}


def _check_target(target: Path, marker: str) -> None:
    """`target` may be new, empty, or a previous export (holding `marker`), which is replaced."""
    if target.exists() and not target.is_dir():
        raise CapsNetError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (target / marker).is_file():
        raise CapsNetError(f"{target} is not empty and holds no previous export ({marker}); refusing to replace it")


def _check_apart(out_dir: Path, triton_repo: Path) -> None:
    """--out and the Triton repository must not hold one another: publishing one replaced the other, or the
    staging directory beside it, and the export failed after destroying the previous one. --out anywhere in the
    repository is refused too, as Triton would take it for a model."""
    out, repo = out_dir.resolve(), triton_repo.resolve()  # through symlinks and "..", as the renames will go
    if out == repo or out.is_relative_to(repo) or repo.is_relative_to(out):
        raise CapsNetError(f"--out {out_dir} and --triton {triton_repo} overlap; give them separate directories")


def _staging_dir(target: Path, beside: Path | None = None) -> Path:
    """An empty directory in `beside` (default: `target`'s folder), on `target`'s filesystem so that the final
    rename is atomic."""
    folder = beside or target.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=folder))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the export from a server running as another user
    except OSError as err:
        raise CapsNetError(f"cannot write to {folder}: {err.strerror or err}") from None
    return staging


def _outside_repository(repo: Path) -> Path | None:
    """The folder holding the Triton repository `repo`, if the model can be staged there: Triton takes every directory
    in its repository for a model, a staging one too (an export killed midway left one, which Triton cannot load:
    its config.pbtxt names another model). None when `repo` is a mount point or its folder takes no files: the
    staging goes into `repo` then."""
    try:
        repo.mkdir(parents=True, exist_ok=True)
        repo = repo.resolve()
        outside = repo.parent
        if outside != repo and os.access(outside, os.W_OK | os.X_OK) and outside.stat().st_dev == repo.stat().st_dev:
            return outside
    except OSError as err:
        raise CapsNetError(f"cannot write to {repo}: {err.strerror or err}") from None
    return None


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished `staging` to `target`, replacing a previous export only now."""
    previous = staging.with_suffix(".previous")
    try:
        if target.exists():
            os.rename(target, previous)
        os.rename(staging, target)
    except OSError as err:
        if previous.exists() and not target.exists():
            os.rename(previous, target)  # put the previous export back
        raise CapsNetError(f"cannot move the export into {target}: {err.strerror or err}") from None
    if previous.is_symlink():  # `target` was a link to an export: the link is replaced, what it points to kept
        previous.unlink()
    else:
        shutil.rmtree(previous, ignore_errors=True)
