"""The reduced-precision stage of an export: the INT8 and FP16 ONNX graphs asked for, and the precision gate's
entries of those and of the checkpoint's own reduced precisions, each measured against the FP32 stage."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from capsnet.export.fp16 import convert_fp16
from capsnet.export.fp32_stage import Fp32Stage
from capsnet.export.onnx_export import check_graph
from capsnet.export.parity import compare, onnxruntime_outputs, onnxruntime_probabilities, onnxruntime_session
from capsnet.export.precision import measure_gate, torch_gates
from capsnet.export.quantize import SCHEME, quantize_int8
from capsnet.model_description.files import ONNX_FP16_NAME, ONNX_INT8_NAME
from capsnet.model_description.precision_gate import PrecisionGate
from capsnet.runtime.cpu import CpuKind
from capsnet.runtime.fused_support import fused_unsupported_reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReducedOnnxStage:
    """The INT8 and FP16 graphs asked for, each measured by the precision gate."""

    int8: dict[str, Any] | None  # model.json's `int8`: how the INT8 graph was made (also when refused)
    gates: dict[str, PrecisionGate]  # "onnx_<precision>" -> its gate entry
    written: dict[str, Path]  # precision -> the graph's file, of those the gate accepted
    parity: dict[str, Any]  # "onnxruntime_<precision>_vs_fp32" -> its parity on the parity batches, if accepted
    refused: dict[str, str]  # file name -> why the gate refused it


def gate_torch_variants(fp32: Fp32Stage) -> dict[str, PrecisionGate]:
    """The precision gate's entries of the checkpoint's own reduced precisions (the torch and fused backends'),
    measured by emulation on this CPU. Not refused here: a server refuses them if asked (see the gate)."""
    test, reference = fp32.job.dataset.test, fp32.reference
    gates = torch_gates(fp32.job.checkpoint.build_model, reference.images, reference.outputs, test.images, test.labels,
                        fp32.test_probabilities, fp32.job.config.max_accuracy_drop,
                        fused=fused_unsupported_reason(fp32.job.checkpoint.config) is None)
    for name, gate in gates.items():
        log.log(logging.INFO if gate.accepted else logging.WARNING, "%s %s%s", name, _describe_gate(gate),
                "" if gate.accepted else "; not accepted, so not served")
    return gates


def write_reduced_onnx(fp32: Fp32Stage) -> ReducedOnnxStage:
    """The INT8 and FP16 graphs asked for, each kept only if the precision gate accepts it."""
    job, cpu = fp32.job, CpuKind.this_host()
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
    if job.config.wants_int8:
        calibration = job.dataset.train.images[: job.config.calibration_images]
        quantize_int8(fp32.graph.path, job.staging / ONNX_INT8_NAME, calibration)
        int8 = {"dataset": job.dataset.name, "calibration_images": len(calibration), "cpu": cpu.to_dict(),
                "scheme": SCHEME}
        gate("int8", job.staging / ONNX_INT8_NAME)
    if job.config.wants_fp16:
        fp16_model = convert_fp16(fp32.graph.model)
        check_graph(fp16_model)
        onnx.save(fp16_model, str(job.staging / ONNX_FP16_NAME))
        gate("fp16", job.staging / ONNX_FP16_NAME)
    return ReducedOnnxStage(int8, gates, written, parity, refused)


def _gate_onnx_variant(fp32: Fp32Stage, precision: str, path: Path,
                       cpu: CpuKind) -> tuple[PrecisionGate, dict[str, Any] | None]:
    """The variant at `path` measured by the precision gate, and where the gate accepts it, its parity against the
    FP32 graph on the parity batches."""
    test, reference, names = fp32.job.dataset.test, fp32.reference, fp32.job.names
    session = onnxruntime_session(str(path))
    (outputs,) = onnxruntime_outputs(session, [reference.images], names)
    gate = measure_gate(precision, f"onnxruntime {path.name}", reference.outputs, outputs, test.labels,
                        fp32.test_probabilities, onnxruntime_probabilities(session, test.images),
                        fp32.job.config.max_accuracy_drop, cpu.describe())
    if not gate.accepted:
        return gate, None
    log.info("%s %s", precision.upper(), _describe_gate(gate))
    return gate, compare(fp32.answers.onnxruntime, onnxruntime_outputs(session, fp32.answers.batches, names)).to_dict()


def _describe_gate(gate: PrecisionGate) -> str:
    return (f"({gate.computed_by}): test accuracy {gate.accuracy_fp32:.2%} -> {gate.accuracy:.2%} "
            f"({gate.accuracy_change_points:+.2f} points); on the {gate.reference_images} reference images same class "
            f"for {gate.argmax_agreement:.1%}, max |diff| of probabilities {gate.max_abs_diff:.2e}")
