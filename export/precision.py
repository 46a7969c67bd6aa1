"""The measurements of the precision gate (capsnet/model_description/precision_gate.py states the criterion) for
the checkpoint's PyTorch model in reduced precision (capsnet/runtime/reduced_precision.py converts it: the
convolutions in fp16 or bf16).

The gate's torch variants are measured at export on the CPU by emulation: fp32 convolutions of inputs, weights
and outputs rounded to fp16/bf16, which is what fp16/bf16 convolutions with fp32 accumulation compute (cuDNN,
oneDNN) up to the order of the sums. The server then checks that its real kernels reproduce those figures.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from capsnet.model_description.backend_table import GATE_FAMILIES
from capsnet.model_description.precision_gate import PrecisionGate, compare_outputs
from capsnet.runtime.cpu import CpuKind
from capsnet.runtime.reduced_precision import convolutions_in, routing_inputs_in
from capsnet.training.data import to_float

ACCURACY_BATCH = 250


def model_outputs(model: nn.Module, images: np.ndarray, names: tuple[str, ...], batch: int = ACCURACY_BATCH) -> dict:
    """{output name: float32 array} of `model` on images (N, C, H, W), float32 in [0, 1] or uint8, in batches."""
    runs = []
    with torch.inference_mode():
        for start in range(0, len(images), batch):
            chunk = images[start:start + batch]
            outputs = model(to_float(chunk) if chunk.dtype == np.uint8 else torch.from_numpy(chunk))
            runs.append({name: getattr(outputs, name).float().numpy() for name in names})
    return {name: np.concatenate([run[name] for run in runs]) for name in names}


def measure_gate(precision: str, computed_by: str, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray],
                 labels: np.ndarray, fp32_test: np.ndarray, candidate_test: np.ndarray, max_drop: float,
                 measured_on: str) -> PrecisionGate:
    """The gate entry of one variant: `reference`/`candidate` are FP32's and the variant's outputs on the reference
    images (every output of `candidate` is compared); `fp32_test`/`candidate_test` their probabilities on the test
    split (labels `labels`)."""
    accuracy_fp32 = float((fp32_test.argmax(axis=1) == labels).mean())
    accuracy = float((candidate_test.argmax(axis=1) == labels).mean())
    change = accuracy_change_points(accuracy_fp32, accuracy)
    compared = compare_outputs(reference, candidate, tuple(candidate))
    diffs = compared.max_abs_diff  # infinite where NaN or infinity: no bound passes it
    bounded = ("probabilities",) if precision == "int8" else tuple(candidate)  # int8 moves poses more (GATE_MAX_DIFF)
    gate = PrecisionGate(
        precision=precision, computed_by=computed_by, accuracy_fp32=accuracy_fp32, accuracy=accuracy,
        accuracy_change_points=change, max_drop_points=max_drop, test_images=len(labels),
        argmax_agreement=compared.argmax_agreement, max_abs_diff=diffs["probabilities"],
        bounded_diff=max(diffs[name] for name in bounded), reference_images=compared.images, measured_on=measured_on)
    return gate


def torch_gates(model_factory, reference_images: np.ndarray, fp32_reference: dict[str, np.ndarray],
                test_images: np.ndarray, labels: np.ndarray, fp32_test: np.ndarray, max_drop: float,
                fused: bool = False) -> dict:
    """The gate entries of the backend table's families computed from the checkpoint (torch_fp16 and torch_bf16;
    fused_fp16 and fused_bf16 where `fused`, the model's routing running in the fused kernels), each measured by
    emulation on this CPU (`test_images` uint8). `model_factory()` gives a fresh FP32 model (the conversion changes
    the model it is given)."""
    gates = {}
    cpu = CpuKind.this_host().describe()
    families = [family for family in GATE_FAMILIES.values()
                if family.computed_by == "checkpoint" and (fused or not family.routing_rounded)]
    for family in families:
        for precision in family.precisions:
            model = model_factory()
            convolutions_in(model, precision, emulate=True)
            if family.routing_rounded:
                routing_inputs_in(model, precision)
            candidate = model_outputs(model, reference_images, tuple(fp32_reference))
            candidate_test = model_outputs(model, test_images, ("probabilities",))["probabilities"]
            gates[f"{family.name}_{precision}"] = measure_gate(
                precision, f"the checkpoint, {family.rounded} in {precision} (emulated in fp32)", fp32_reference,
                candidate, labels, fp32_test, candidate_test, max_drop, cpu)
    return gates


def accuracy_change_points(accuracy_fp32: float, accuracy: float) -> float:
    """The accuracy change in percentage points, rounded as model.json records it, so that the gate judges that
    figure (unrounded, 100 * (0.823 - 0.833) is -1.0000000000000009, which a max drop of 1 refused)."""
    return round(100 * (accuracy - accuracy_fp32), 4)
