"""The AOTInductor stage of an export: the packages asked for (--aoti), each checked with the runner that serves it
against the FP32 stage: fp32 against eager PyTorch, fp16/bf16 by the precision gate on the reference images."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from capsnet.errors import CapsNetError
from capsnet.export import aoti
from capsnet.export.config import ExportConfig
from capsnet.export.fp32_stage import Fp32Stage, Reference
from capsnet.export.metadata import output_shapes
from capsnet.export.onnx_export import export_program
from capsnet.export.parity import compare
from capsnet.model_description.precision_gate import (
    FP32_TOLERANCE, PrecisionGate, compare_outputs, outputs_in_batches)
from capsnet.model_description.schema import AotiPackage
from capsnet.runtime.reduced_precision import convolutions_in
from capsnet.runtime.torch_runner import TorchRunner, cuda_unavailable_reason, package_forward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AotiStage:
    """The packages compiled and checked, and those the precision gate refused."""

    packages: tuple[AotiPackage, ...]
    refused: dict[str, str]  # file name -> why the gate refused its precision


def check_aoti_possible(config: ExportConfig) -> None:
    """Refuse at once what would make the AOTInductor packages fail after minutes of other work."""
    if not config.aoti:
        return
    reason = aoti.compiler_unavailable_reason()
    if reason is None and "cuda" in config.aoti_devices:
        reason = cuda_unavailable_reason(config.engine().gpu)
        reason = reason and f"--aoti cuda: {reason}; export the CUDA packages on a GPU machine"
    if reason:
        raise CapsNetError(reason)


def compile_aoti(fp32: Fp32Stage, gates: dict[str, PrecisionGate]) -> AotiStage:
    """Compile the asked AOTInductor packages and check each with the runner that serves it: fp32 against eager
    PyTorch (FP32_TOLERANCE, every image the same class), fp16/bf16 by the precision gate (`gates`) on the reference
    images. An fp16/bf16 package whose precision the gate refused is not compiled but named in `refused`."""
    job = fp32.job
    config, checkpoint = job.config, job.checkpoint
    packages = []
    refused: dict[str, str] = {}
    for device, precision in config.aoti_targets():
        target = torch.device(f"cuda:{config.engine().gpu}" if device == "cuda" else "cpu")
        path = aoti.package_path(job.staging, device, precision)
        if precision != "fp32" and not gates[f"torch_{precision}"].accepted:
            refused[path.name] = f"{precision.upper()} package refused: {gates[f'torch_{precision}'].refusal()}"
            log.warning("%s; not compiled", refused[path.name])
            continue
        if precision == "fp32":
            source = fp32.graph.program
        else:  # the checkpoint with its convolutions in fp16/bf16, as the torch backend runs it
            model = checkpoint.build_model()
            convolutions_in(model, precision)
            source = export_program(model, job.names, config.max_batch)
        if device == "cuda":
            source = aoti.move_program(source, str(target))
        package = aoti.compile_package(source, path, target, precision, config.max_batch)
        model_config = checkpoint.config
        row_shape = (model_config.in_channels, model_config.height, model_config.width)
        runner = TorchRunner(package_forward(path, target), target, row_shape,
                             output_shapes(model_config, config.reconstruction), config.max_batch)
        if precision == "fp32":
            result = _check_fp32_package(fp32, runner, device)
        else:
            result = _gate_package(runner, fp32.reference, gates[f"torch_{precision}"], config.max_batch)
        packages.append(replace(package, parity=result))
    return AotiStage(tuple(packages), refused)


def _check_fp32_package(fp32: Fp32Stage, runner: TorchRunner, device: str) -> dict[str, Any]:
    """An fp32 package on the parity batches it takes, against eager PyTorch (FP32_TOLERANCE)."""
    max_batch, answers = fp32.job.config.max_batch, fp32.answers
    checked = [batch for batch in answers.batches if len(batch) <= max_batch]
    expected = [outputs for batch, outputs in zip(answers.batches, answers.pytorch) if len(batch) <= max_batch]
    package_parity = compare(expected, [runner.run(batch) for batch in checked])
    log.info("AOTInductor %s fp32 vs PyTorch: %s", device, package_parity.describe())
    if not package_parity.passes(FP32_TOLERANCE):
        raise CapsNetError(f"the AOTInductor {device} package disagrees with PyTorch beyond "
                           f"{FP32_TOLERANCE:g}: {package_parity.describe()}")
    return {"reference": "pytorch", "batch_sizes": [len(batch) for batch in checked],
            "tolerance": FP32_TOLERANCE, **package_parity.to_dict()}


def _gate_package(runner: TorchRunner, reference: Reference, gate: PrecisionGate, max_batch: int) -> dict[str, Any]:
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
