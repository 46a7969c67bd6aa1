"""The TensorRT stage of an export: the plan asked for (--tensorrt), built from the ONNX variant its precision takes
and checked against ONNX Runtime on that graph. A failure here costs no other artifact: it is reported after them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import onnx

from capsnet.errors import CapsNetError
from capsnet.export.fp32_stage import ExportJob, Fp32Stage
from capsnet.export.parity import compare, onnxruntime_outputs, onnxruntime_session, parity_batches
from capsnet.export.tensorrt_build import (MIN_ARGMAX_AGREEMENT, PARITY_TOLERANCE, build_engine, engine_outputs,
                                           source_variant, tensorrt_major_version)
from capsnet.export.tensorrt_ops import tensorrt_problems
from capsnet.model_description.files import ONNX_FP16_NAME, ONNX_INT8_NAME, PLAN_INFO_NAME, PLAN_NAME

log = logging.getLogger(__name__)


def log_compatibility(variants: dict[str, Path]) -> None:
    """Whether TensorRT could build each ONNX graph written, asked for an engine or not."""
    for path in variants.values():
        problems = tensorrt_problems(onnx.load(str(path)))
        log.log(logging.WARNING if problems else logging.INFO, "TensorRT compatibility of %s: %s",
                path.name,
                "; ".join(problems) or "every operator supported, every dimension static or computed from the batch")


def write_plan(fp32: Fp32Stage, variants: dict[str, Path],
                tensorrt_error: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The TensorRT plan where asked and possible: (its parity where it was built, why not where it was asked for)."""
    if not fp32.job.config.tensorrt or tensorrt_error is not None:
        return None, tensorrt_error
    try:
        return _build_tensorrt(fp32.job, variants), None
    except Exception as err:  # TensorRT and CUDA raise their own types; none may cost the other artifacts
        log.debug("TensorRT build failed", exc_info=True)
        (fp32.job.staging / PLAN_NAME).unlink(missing_ok=True)
        (fp32.job.staging / PLAN_INFO_NAME).unlink(missing_ok=True)
        return None, str(err) if isinstance(err, CapsNetError) else f"{type(err).__name__}: {err}".splitlines()[0]


def _build_tensorrt(job: ExportJob, variants: dict[str, Path]) -> dict[str, Any]:
    """Build model.plan and model.plan.json, and check the engine against ONNX Runtime on its source graph."""
    staging, model_config, names, engine_config = job.staging, job.checkpoint.config, job.names, job.config.engine()
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
    batches = parity_batches(job.dataset.test.images, batch_sizes)
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
