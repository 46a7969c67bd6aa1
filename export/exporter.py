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

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import onnx

from capsnet.errors import CapsNetError
from capsnet.export.aoti_stage import check_aoti_possible, compile_aoti
from capsnet.export.config import ExportConfig
from capsnet.export.decoder import check_decoder, export_decoder
from capsnet.export.fp32_stage import ExportJob, Fp32Stage, write_fp32
from capsnet.export.metadata import describe, embed_metadata
from capsnet.export.onnx_export import graph_opset
from capsnet.export.reduced_stage import ReducedOnnxStage, gate_torch_variants, write_reduced_onnx
from capsnet.export.staging import (check_apart, check_target, outside_repository, publish, staged_checkpoint,
                                    staging_dir)
from capsnet.export.tensorrt_stage import log_compatibility, write_plan
from capsnet.export.triton import CONFIG_NAME, write_decoder_directory, write_model_directory
from capsnet.model_description.decoder import DecoderDescription, decoder_model_name
from capsnet.model_description.files import (CHECKPOINT_NAME, ONNX_FP16_NAME, ONNX_INT8_NAME, ONNX_NAME, PLAN_INFO_NAME,
                                             PLAN_NAME, REFERENCE_NAME, SIDECAR_NAME, file_sha256)
from capsnet.model_description.schema import MODEL_NAME, AotiPackage, ModelDescription
from capsnet.models.checkpoint import Checkpoint, load_checkpoint
from capsnet.models.config import CAPSULE_ARCHITECTURES
from capsnet.runtime.tensorrt_runner import unavailable_reason
from capsnet.training.evaluate import load_checkpoint_data
from capsnet.training.pose import measure_pose

log = logging.getLogger(__name__)


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
    check_target(out_dir, SIDECAR_NAME)
    triton_model_dir = Path(config.triton_repo) / MODEL_NAME if config.triton_repo else None
    # the decoder alone is a model of its own in the Triton repository, beside the classifier
    triton_decoder_dir = (triton_model_dir.parent / decoder_model_name(MODEL_NAME)
                          if triton_model_dir is not None and config.reconstruction else None)
    if triton_model_dir is not None:
        if triton_model_dir.parent.exists() and not triton_model_dir.parent.is_dir():
            raise CapsNetError(f"Triton repository {triton_model_dir.parent} exists and is not a directory")
        check_target(triton_model_dir, CONFIG_NAME)
        if triton_decoder_dir is not None:
            check_target(triton_decoder_dir, CONFIG_NAME)
        check_apart(out_dir, triton_model_dir.parent)
    check_aoti_possible(config)
    tensorrt_error = unavailable_reason(config.engine().gpu) if config.tensorrt else None
    if tensorrt_error:
        log.warning("--tensorrt: %s; writing the other artifacts, then failing", tensorrt_error)
    # parity, INT8 calibration and its per-class gate need the model's own data, every class of it
    dataset = load_checkpoint_data(checkpoint, checkpoint_path, config.data, every_class=True)

    staging = staging_dir(out_dir)
    triton_staging = decoder_staging = None
    try:
        job = ExportJob(staging, config, staged_checkpoint(checkpoint_path, checkpoint, staging), dataset)
        description, tensorrt_error = _write_artifacts(job, tensorrt_error)
        if triton_model_dir is not None:
            outside = outside_repository(triton_model_dir.parent)
            triton_staging = staging_dir(triton_model_dir, beside=outside)
            model_format = "plan" if description.artifacts["tensorrt"] else "onnx"
            model_file = staging / (PLAN_NAME if model_format == "plan" else ONNX_NAME)
            write_model_directory(triton_staging, description, model_file, model_format, config.triton())
            if triton_decoder_dir is not None and description.decoder is not None:
                decoder_staging = staging_dir(triton_decoder_dir, beside=outside)
                write_decoder_directory(decoder_staging, triton_decoder_dir.name, description.decoder,
                                        staging / description.decoder.file, config.triton())
        publish(staging, out_dir)
        if triton_staging is not None and triton_model_dir is not None:  # all or none
            publish(triton_staging, triton_model_dir)
        if decoder_staging is not None and triton_decoder_dir is not None:
            publish(decoder_staging, triton_decoder_dir)
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


def _write_artifacts(job: ExportJob, tensorrt_error: str | None) -> tuple[ModelDescription, str | None]:
    """Write every artifact into `job.staging`; returns the description and why no engine was built, if so."""
    config = job.config
    fp32 = write_fp32(job)
    decoder = _write_decoder(fp32) if config.reconstruction else None
    torch_gates = gate_torch_variants(fp32)
    reduced = write_reduced_onnx(fp32)
    variants = {"fp32": fp32.graph.path, **reduced.written}
    packages = compile_aoti(fp32, torch_gates)
    log_compatibility(variants)
    tensorrt_parity, tensorrt_error = write_plan(fp32, variants, tensorrt_error)
    parity = {**fp32.parity, **reduced.parity, **({"tensorrt": tensorrt_parity} if tensorrt_parity else {})}
    description = describe(job.checkpoint, graph_opset(fp32.graph.model), config.reconstruction,
                           artifacts=_artifact_files(reduced, tensorrt_parity is not None),
                           reference_set=fp32.reference.description, int8=reduced.int8, parity=parity,
                           precision_gate={**torch_gates, **reduced.gates}, aoti=packages.packages,
                           refused={**reduced.refused, **packages.refused}, decoder=decoder)
    return _write_description(job.staging, description, variants, decoder, packages.packages), tensorrt_error


def _write_decoder(fp32: Fp32Stage) -> DecoderDescription:
    """The decoder alone (export/decoder.py), checked against PyTorch's on the reference images' poses."""
    job = fp32.job
    model = job.checkpoint.build_model()
    export_decoder(model, job.staging, job.config.opset)
    outputs = fp32.reference.outputs
    pose = measure_pose(model, job.dataset)
    log.info("%s", pose.describe())
    decoder = check_decoder(model, job.staging, outputs["poses"], outputs["probabilities"],
                            outputs["reconstruction"], pose)
    log.info("decoder ONNX Runtime vs PyTorch on %d poses: max |diff| %.2e", decoder.parity["rows"],
             decoder.parity["max_abs_diff"])
    return decoder


def _artifact_files(reduced: ReducedOnnxStage, plan_built: bool) -> dict[str, str | None]:
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
