"""The precision gate: ONE criterion for every reduced precision (INT8, FP16, BF16), used by export and by the
server's self-check. Export accepts a variant whose top-1 accuracy on the model's own test split is at most the
export's --max-accuracy-drop below FP32's, and records what the variant does on the 128 reference images: the
share with FP32's class and the largest |difference| of the probabilities. A server accepts that variant only
where it reproduces both on the same images within these margins. Near-ties that changed class at export change
again and pass; a kernel that saturates, a damaged file or a wrong conversion moves them by far more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

GATE_AGREEMENT_SLACK_IMAGES = 2  # reference images that may change class beyond those export saw change
GATE_DIFF_FACTOR = 2.0  # the max |diff| may be this multiple of export's ...
GATE_DIFF_SLACK = 1e-3  # ... plus this, so that a variant export saw almost exact is not held to rounding noise
# Export's bound on the max |diff| (fp16/bf16: of every output; int8: of the probabilities, as quantisation moves
# poses more), far above what sound variants measured (INT8 5e-3 and FP16 3e-4 on the trained tiny model, BF16
# convolutions 1.2e-3 on the trained paper model): a conversion bug that keeps the accuracy but moves the outputs is
# not recorded as the model's behaviour.
GATE_MAX_DIFF = {"int8": 0.1, "fp16": 1e-2, "bf16": 2e-2}
# The variants gated, by what computes them: ONNX Runtime's INT8/FP16 graphs (also what TensorRT builds from), and
# the checkpoint with its convolutions in fp16/bf16 (the torch backend and the AOTInductor packages).
GATE_VARIANTS = ("onnx_int8", "onnx_fp16", "torch_fp16", "torch_bf16", "fused_fp16", "fused_bf16")
GATE_KEYS = ("precision", "computed_by", "accuracy_fp32", "accuracy", "accuracy_change_points", "max_drop_points",
             "test_images", "argmax_agreement", "max_abs_diff", "bounded_diff", "reference_images", "measured_on")


@dataclass(frozen=True)
class PrecisionGate:
    """What export measured for one reduced-precision variant, and the bounds a server must then meet."""

    precision: str  # "int8" | "fp16" | "bf16"
    computed_by: str  # what ran it at export, e.g. "onnxruntime model.int8.onnx on AMD EPYC [avx2 fma]"
    accuracy_fp32: float  # top-1 on the test split
    accuracy: float
    accuracy_change_points: float
    max_drop_points: float
    test_images: int
    argmax_agreement: float  # on the reference images: share with FP32's class
    max_abs_diff: float  # on the reference images: probabilities against FP32
    bounded_diff: float  # what GATE_MAX_DIFF bounds: fp16/bf16 every output's max |diff|, int8 the probabilities'
    reference_images: int
    measured_on: str  # the CPU (or GPU) that measured it

    @property
    def accepted(self) -> bool:
        """The export half of the criterion: accuracy kept within max_drop_points, and finite outputs."""
        return (-self.accuracy_change_points <= self.max_drop_points
                and self.bounded_diff <= GATE_MAX_DIFF[self.precision])

    def refusal(self) -> str:
        """Why export did not accept this variant."""
        if not math.isfinite(self.bounded_diff):
            return f"NaN or infinity in its outputs ({self.computed_by})"
        if -self.accuracy_change_points <= self.max_drop_points:
            what = "probabilities" if self.precision == "int8" else "outputs"
            return (f"{self.computed_by}: max |diff| of its {what} {self.bounded_diff:.2e} against FP32 on "
                    f"{self.reference_images} reference images, more than {GATE_MAX_DIFF[self.precision]:g}")
        return (f"{self.computed_by} on {self.test_images} test images: accuracy {self.accuracy_fp32:.2%} -> "
                f"{self.accuracy:.2%} ({self.accuracy_change_points:+.2f} points), more than --max-accuracy-drop "
                f"{self.max_drop_points:g}")

    def reproduced_by(self, comparison: Comparison) -> bool:
        """The server half of the criterion: `comparison` (of the probabilities, on the same reference images) keeps
        export's agreement and difference within the margins."""
        return comparison.within(self.most_diff, self.least_agreement)

    @property
    def least_agreement(self) -> float:
        return max(0.0, self.argmax_agreement - GATE_AGREEMENT_SLACK_IMAGES / self.reference_images)

    @property
    def most_diff(self) -> float:
        return GATE_DIFF_FACTOR * self.max_abs_diff + GATE_DIFF_SLACK

    def describe_bounds(self) -> str:
        return (f"export measured {self.argmax_agreement:.1%} and {self.max_abs_diff:.2e} on {self.measured_on}; "
                f"allowed: {GATE_AGREEMENT_SLACK_IMAGES} more images of {self.reference_images} changing class, "
                f"{GATE_DIFF_FACTOR:g}x the difference + {GATE_DIFF_SLACK:g}")

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in GATE_KEYS}


def gate_criterion() -> dict[str, Any]:
    """model.json's statement of the criterion its gate entries were measured for."""
    return {"accuracy": "top-1 on the test split at most max_drop_points below FP32's (export)",
            "max_abs_diff": GATE_MAX_DIFF,
            "reproduced": "on the reference images: same-class share >= export's less agreement_slack_images, "
                          "max |diff| of probabilities <= diff_factor x export's + diff_slack (every load)",
            "agreement_slack_images": GATE_AGREEMENT_SLACK_IMAGES, "diff_factor": GATE_DIFF_FACTOR,
            "diff_slack": GATE_DIFF_SLACK}


@dataclass(frozen=True)
class Comparison:
    """Outputs on the reference images against FP32's: the share of images with FP32's class, and each compared
    output's largest |difference| (NaN where either holds a NaN, which no bound passes)."""

    images: int
    argmax_agreement: float
    max_abs_diff: dict[str, float]

    def within(self, most_diff: float, least_agreement: float) -> bool:
        # every output on its own: max() over the values drops a NaN that is not first
        return (all(diff <= most_diff for diff in self.max_abs_diff.values())
                and self.argmax_agreement >= least_agreement)


def compare_outputs(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
                    names: tuple[str, ...]) -> Comparison:
    """`candidate` against `reference` (FP32's) on the same images: the argmax of the probabilities, and the max
    |difference| of each output in `names`."""
    same_class = reference["probabilities"].argmax(axis=1) == candidate["probabilities"].argmax(axis=1)  # (N,)
    return Comparison(images=len(same_class), argmax_agreement=float(same_class.mean()),
                      max_abs_diff={name: float(np.abs(candidate[name] - reference[name]).max()) for name in names})


def outputs_in_batches(run: Callable[[np.ndarray], Mapping[str, np.ndarray]], images: np.ndarray,
                       max_batch: int) -> dict[str, np.ndarray]:
    """`run` (images -> outputs by name) over `images` in batches of at most `max_batch`, the outputs joined."""
    runs = [run(images[start:start + max_batch]) for start in range(0, len(images), max_batch)]
    return {name: np.concatenate([outputs[name] for outputs in runs]) for name in runs[0]}
