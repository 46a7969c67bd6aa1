"""`capsnet export`: a checkpoint in, serving artifacts out (docs/artifacts.md is the contract).

Everything is written to a temporary directory beside the target and renamed into place once
complete, so a failed or interrupted export never leaves half an artifact set, and a previous
export in the target is only replaced by a complete new one. The ONNX graph must match PyTorch
on real images before anything is published.

A requested TensorRT engine that cannot be built (no GPU, no tensorrt package, a failed build or
parity check) does not hold back the other artifacts: they are published, then the export fails.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from capsnet.cpu import CpuKind
from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig, ExportConfig
from capsnet.export.fp16 import FP16_MIN_ARGMAX_AGREEMENT, FP16_TOLERANCE, convert_fp16
from capsnet.export.metadata import describe, embed_metadata
from capsnet.export.onnx_export import check_graph, export_onnx, graph_opset, op_counts
from capsnet.export.parity import (
    FP32_TOLERANCE,
    PARITY_BATCH_SIZES,
    compare,
    onnxruntime_outputs,
    onnxruntime_session,
    parity_batches,
    spread,
    torch_outputs,
)
from capsnet.export.quantize import SCHEME, accuracy, accuracy_change_points, quantize_int8
from capsnet.export.tensorrt_build import (
    MIN_ARGMAX_AGREEMENT,
    PARITY_TOLERANCE,
    build_engine,
    engine_outputs,
    source_variant,
    tensorrt_major_version,
)
from capsnet.export.tensorrt_ops import tensorrt_problems
from capsnet.export.triton import CONFIG_NAME, write_model_directory
from capsnet.model_description import (
    CHECKPOINT_NAME,
    MODEL_NAME,
    ONNX_FP16_NAME,
    ONNX_INT8_NAME,
    ONNX_NAME,
    PLAN_INFO_NAME,
    PLAN_NAME,
    REFERENCE_NAME,
    SIDECAR_NAME,
    ModelDescription,
    file_sha256,
    output_names,
)
from capsnet.tensorrt_runner import unavailable_reason
from capsnet.training.checkpoint import Checkpoint, load_checkpoint
from capsnet.training.config import CAPSULE_ARCHITECTURES
from capsnet.training.data import Dataset
from capsnet.training.evaluate import load_checkpoint_data

log = logging.getLogger(__name__)

REFERENCE_IMAGES = 128  # the self-check needs 99% agreement: one image of 128 may differ


def export_model(checkpoint_path: str | os.PathLike, out_dir: str | os.PathLike, **options: Any) -> ModelDescription:
    """Export `checkpoint_path` into `out_dir`; `options` are ExportConfig fields. Returns its description."""
    config = ExportConfig(**options)
    if not str(out_dir):  # Path("") is the working directory
        raise CapsNetError("--out needs a directory, got an empty path")
    checkpoint_path, out_dir = Path(checkpoint_path), Path(out_dir)
    checkpoint = load_checkpoint(checkpoint_path)
    if checkpoint.config.arch not in CAPSULE_ARCHITECTURES:
        # The artifacts promise capsule poses (EM's 4×4 poses flattened fill the same outputs); a baseline
        # without capsules has none to serve.
        raise CapsNetError(f"{checkpoint_path} is a {checkpoint.config.arch} checkpoint; export takes capsule "
                           f"networks ({' or '.join(CAPSULE_ARCHITECTURES)})")
    _check_target(out_dir, SIDECAR_NAME)
    triton_model_dir = Path(config.triton_repo) / MODEL_NAME if config.triton_repo else None
    if triton_model_dir is not None:
        if triton_model_dir.parent.exists() and not triton_model_dir.parent.is_dir():
            raise CapsNetError(f"Triton repository {triton_model_dir.parent} exists and is not a directory")
        _check_target(triton_model_dir, CONFIG_NAME)
        _check_apart(out_dir, triton_model_dir.parent)
    tensorrt_error = unavailable_reason(config.gpu) if config.tensorrt else None
    if tensorrt_error:
        log.warning("--tensorrt: %s; writing the other artifacts, then failing", tensorrt_error)
    # parity, INT8 calibration and its per-class gate need the model's own data, every class of it
    dataset = load_checkpoint_data(checkpoint, checkpoint_path, config.data, every_class=True)

    staging = _staging_dir(out_dir)
    triton_staging = None
    try:
        description, tensorrt_error = _write_artifacts(staging, checkpoint_path, checkpoint, dataset, config, tensorrt_error)
        if triton_model_dir is not None:
            triton_staging = _staging_dir(triton_model_dir, beside=_outside_repository(triton_model_dir.parent))
            model_format = "plan" if description.artifacts["tensorrt"] else "onnx"
            model_file = staging / (PLAN_NAME if model_format == "plan" else ONNX_NAME)
            write_model_directory(triton_staging, description.to_json(), model_file, model_format, config.triton())
        _publish(staging, out_dir)
        if triton_staging is not None:
            _publish(triton_staging, triton_model_dir)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if triton_staging is not None:
            shutil.rmtree(triton_staging, ignore_errors=True)
        if isinstance(err, OSError):  # a full disk, a file size limit: the user's to fix, in one line
            target = out_dir if triton_staging is None else triton_model_dir  # the Triton copy comes last
            raise CapsNetError(f"cannot write the export to {target}: {err.strerror or err}") from None
        raise
    log.info("wrote %s", out_dir)
    if tensorrt_error:
        raise CapsNetError(f"no TensorRT engine: {tensorrt_error} (the other artifacts are in {out_dir})")
    return description


def _write_artifacts(staging: Path, checkpoint_path: Path, checkpoint: Checkpoint, dataset: Dataset,
                     config: ExportConfig, tensorrt_error: str | None) -> tuple[ModelDescription, str | None]:
    """Write every artifact into `staging`; returns the description and why no engine was built, if so."""
    checkpoint = _staged_checkpoint(checkpoint_path, checkpoint, staging)
    model = checkpoint.build_model()
    names = output_names(config.reconstruction)
    variants = {"fp32": staging / ONNX_NAME}
    exported = export_onnx(model, variants["fp32"], config.opset, config.reconstruction)
    counts = op_counts(exported)
    log.info("ONNX opset %d, %d nodes: %s", graph_opset(exported), sum(counts.values()),
             ", ".join(f"{op} {n}" for op, n in counts.most_common()))

    batches = parity_batches(dataset.test.images)
    fp32_session = onnxruntime_session(str(variants["fp32"]))
    fp32_outputs = onnxruntime_outputs(fp32_session, batches, names)
    onnx_parity = compare(torch_outputs(model, batches, names), fp32_outputs)
    log.info("ONNX Runtime vs PyTorch: %s", onnx_parity.describe())
    if not onnx_parity.passes(FP32_TOLERANCE):
        raise CapsNetError(f"ONNX Runtime disagrees with PyTorch beyond {FP32_TOLERANCE:g}: {onnx_parity.describe()}")
    parity = {
        "reference": "pytorch",
        "batch_sizes": list(PARITY_BATCH_SIZES),
        "tolerance": FP32_TOLERANCE,
        "onnxruntime": onnx_parity.to_dict(),
    }
    reference_set = _write_reference(staging / REFERENCE_NAME, fp32_session, dataset, names)

    int8 = fp16 = None
    if config.wants_int8:
        variants["int8"] = staging / ONNX_INT8_NAME
        int8 = _quantize(variants["fp32"], variants["int8"], fp32_session, dataset, config)
        int8_parity = compare(fp32_outputs, onnxruntime_outputs(onnxruntime_session(str(variants["int8"])), batches, names))
        log.info("ONNX Runtime INT8 vs FP32: %s", int8_parity.describe())
        parity["onnxruntime_int8_vs_fp32"] = int8_parity.to_dict()
    if config.wants_fp16:
        variants["fp16"] = staging / ONNX_FP16_NAME
        fp16_model = convert_fp16(exported)
        check_graph(fp16_model)
        onnx.save(fp16_model, str(variants["fp16"]))
        fp16_parity = compare(fp32_outputs, onnxruntime_outputs(onnxruntime_session(str(variants["fp16"])), batches, names))
        log.info("ONNX Runtime (CPU) FP16 vs FP32: %s", fp16_parity.describe())
        parity["onnxruntime_fp16_vs_fp32"] = fp16_parity.to_dict()
        if not fp16_parity.passes(FP16_TOLERANCE, FP16_MIN_ARGMAX_AGREEMENT):
            raise CapsNetError(f"FP16 model refused: against FP32 {fp16_parity.describe()}; allowed: max |diff| "
                               f"{FP16_TOLERANCE:g}, same class for {FP16_MIN_ARGMAX_AGREEMENT:.0%}")
        fp16 = {"tolerance": FP16_TOLERANCE, "min_argmax_agreement": FP16_MIN_ARGMAX_AGREEMENT}
    for path in variants.values():
        problems = tensorrt_problems(onnx.load(str(path)))
        log.log(logging.WARNING if problems else logging.INFO, "TensorRT compatibility of %s: %s",
                path.name,
                "; ".join(problems) or "every operator supported, every dimension static or computed from the batch")

    plan_built = False
    if config.tensorrt and tensorrt_error is None:
        try:
            parity["tensorrt"] = _build_tensorrt(staging, variants, checkpoint.config, dataset, names, config.engine())
            plan_built = True
        except Exception as err:  # TensorRT and CUDA raise their own types; none may cost the other artifacts
            log.debug("TensorRT build failed", exc_info=True)
            tensorrt_error = str(err) if isinstance(err, CapsNetError) else f"{type(err).__name__}: {err}".splitlines()[0]
            (staging / PLAN_NAME).unlink(missing_ok=True)
            (staging / PLAN_INFO_NAME).unlink(missing_ok=True)

    artifacts = {
        "onnx": ONNX_NAME,
        "onnx_int8": ONNX_INT8_NAME if "int8" in variants else None,
        "onnx_fp16": ONNX_FP16_NAME if "fp16" in variants else None,
        "tensorrt": PLAN_NAME if plan_built else None,
        "checkpoint": CHECKPOINT_NAME,
        "reference": REFERENCE_NAME,
    }
    description = describe(checkpoint, graph_opset(exported), config.reconstruction, artifacts=artifacts,
                           reference_set=reference_set, int8=int8, fp16=fp16, parity=parity)
    for path in variants.values():
        onnx_model = onnx.load(str(path))
        embed_metadata(onnx_model, description)
        onnx.save(onnx_model, str(path))
    hashed = [name for name in artifacts.values() if name] + ([PLAN_INFO_NAME] if plan_built else [])
    description = replace(description, sha256={name: file_sha256(staging / name) for name in hashed})
    description.write(staging)
    return description, tensorrt_error


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


def _write_reference(path: Path, fp32_session, dataset: Dataset, names: tuple[str, ...]) -> dict[str, Any]:
    """The images `capsnet serve` checks its backend with before it reports SERVING, and their FP32 outputs."""
    images = spread(dataset.test.images, REFERENCE_IMAGES)  # (128, C, H, W)
    (outputs,) = onnxruntime_outputs(fp32_session, [images], names)
    np.savez_compressed(path, images=images, **outputs)
    return {"images": len(images), "dataset": dataset.name, "split": "test"}


def _quantize(fp32_path: Path, int8_path: Path, fp32_session, dataset: Dataset, config: ExportConfig) -> dict[str, Any]:
    """Write the INT8 model and measure its accuracy against FP32 on this CPU; refuse it past --int8-max-drop."""
    calibration = dataset.train.images[: config.calibration_images]
    quantize_int8(fp32_path, int8_path, calibration)
    test = dataset.test
    accuracy_fp32 = accuracy(fp32_session, test.images, test.labels)
    accuracy_int8 = accuracy(onnxruntime_session(str(int8_path)), test.images, test.labels)
    change = accuracy_change_points(accuracy_fp32, accuracy_int8)
    summary = (f"accuracy on {len(test)} {dataset.name} test images: fp32 {accuracy_fp32:.2%}, "
               f"int8 {accuracy_int8:.2%} ({change:+.2f} points)")
    cpu = CpuKind.this_host()
    log.info("INT8 %s (on %s)", summary, cpu.describe())
    if -change > config.int8_max_drop:
        raise CapsNetError(f"INT8 model refused: {summary}, more than --int8-max-drop {config.int8_max_drop:g}")
    return {
        "accuracy_fp32": accuracy_fp32,
        "accuracy_int8": accuracy_int8,
        "accuracy_change_points": change,
        "max_drop_points": config.int8_max_drop,
        "dataset": dataset.name,
        "calibration_images": len(calibration),
        "test_images": len(test),
        "cpu": cpu.to_dict(),
        "scheme": SCHEME,
    }


def _build_tensorrt(staging: Path, variants: dict[str, Path], model_config, dataset, names: tuple[str, ...],
                    engine_config: EngineConfig) -> dict[str, Any]:
    """Build model.plan and model.plan.json, and check the engine against ONNX Runtime on its source graph."""
    precision = engine_config.precision
    source = variants[source_variant(precision, tensorrt_major_version())]
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
