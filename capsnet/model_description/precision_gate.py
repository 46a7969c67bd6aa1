"""How outputs are compared, and the precision gate. One comparison (`compare_outputs`, over `abs_diffs`, with its one
NaN rule) and one tolerance per purpose serve export's parity checks, the server's self-check and the gate: FP32 is
held to FP32_TOLERANCE; a reduced precision to the gate.

The gate is ONE criterion for every reduced precision (INT8, FP16, BF16), used by export and by the
server's self-check. Export accepts a variant whose top-1 accuracy on the model's own test split is at most the
export's --max-accuracy-drop below FP32's, and records what the variant does on the 128 reference images: the
share with FP32's class and the largest |difference| of the probabilities. A server accepts that variant only
where it reproduces both on the same images within these margins. Near-ties that changed class at export change
again and pass; a kernel that saturates, a damaged file or a wrong conversion moves them by far more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# FP32 against FP32 (an exported graph, a package or the decoder against PyTorch at export; a server's FP32 engine
# against export's reference outputs at every load): every output's max |diff|, every image in the same class
FP32_TOLERANCE = 1e-4
GATE_AGREEMENT_SLACK_IMAGES = 2  # reference images that may change class beyond those export saw change
GATE_DIFF_FACTOR = 2.0  # the max |diff| may be this multiple of export's ...
GATE_DIFF_SLACK = 1e-3  # ... plus this, so that a variant export saw almost exact is not held to rounding noise
# Export's bound on the max |diff| (fp16/bf16: of every output; int8: of the probabilities, as quantisation moves
# poses more), far above what sound variants measured (INT8 5e-3 and FP16 3e-4 on the trained tiny model, BF16
# convolutions 1.2e-3 on the trained paper model): a conversion bug that keeps the accuracy but moves the outputs is
# not recorded as the model's behaviour.
GATE_MAX_DIFF = {"int8": 0.1, "fp16": 1e-2, "bf16": 2e-2}
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
        return comparison.passes(self.most_diff, self.least_agreement)

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
    """Outputs against a reference's on the same images (FP32's, PyTorch's): the share of images with the
    reference's class, and each compared output's largest |difference| (infinite where either side holds a NaN or an
    infinity: `abs_diffs`)."""

    images: int
    argmax_agreement: float
    max_abs_diff: dict[str, float]

    def passes(self, tolerance: float, min_agreement: float = 1.0) -> bool:
        return all(diff <= tolerance for diff in self.max_abs_diff.values()) and self.argmax_agreement >= min_agreement

    def describe(self) -> str:
        diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in self.max_abs_diff.items())
        return f"max |diff| {diffs}; same class for {self.argmax_agreement:.2%} of {self.images} images"

    def to_dict(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "argmax_agreement": self.argmax_agreement, "images": self.images}

    @staticmethod
    def joined(parts: Sequence[Comparison]) -> Comparison:
        """Comparisons of several batches as one: every image's agreement, every output's largest difference."""
        images = sum(part.images for part in parts)
        return Comparison(images, sum(part.argmax_agreement * part.images for part in parts) / images,
                          {name: max(part.max_abs_diff[name] for part in parts) for name in parts[0].max_abs_diff})


def abs_diffs(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Each item's largest |reference - candidate| (N,), over its own values: THE difference of parity, self-check
    and gate. One NaN rule: an item where either side holds a NaN or an infinity differs by infinity, so that it
    fails every tolerance and every comparison and max() over items or outputs keeps it (a NaN compares False with
    everything, and Python's max() kept whichever finite value came first)."""
    items = (len(reference), int(np.prod(reference.shape[1:])))
    reference, candidate = reference.reshape(items), candidate.reshape(items)  # (N, F)
    finite = np.isfinite(reference).all(axis=1) & np.isfinite(candidate).all(axis=1)  # (N,)
    with np.errstate(invalid="ignore"):  # inf - inf: those items are infinite below
        diffs = np.abs(reference - candidate).max(axis=1, initial=0.0)  # (N,)
    return np.where(finite, diffs, np.inf)


def max_abs_diff(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The largest of `abs_diffs`: infinite where any item holds a NaN or an infinity, 0 for no items."""
    return float(abs_diffs(reference, candidate).max(initial=0.0))


def compare_outputs(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
                    names: tuple[str, ...]) -> Comparison:
    """`candidate` against `reference` on the same images: the argmax of the probabilities, and the max |difference|
    of each output in `names`."""
    same_class = reference["probabilities"].argmax(axis=1) == candidate["probabilities"].argmax(axis=1)  # (N,)
    return Comparison(images=len(same_class), argmax_agreement=float(same_class.mean()),
                      max_abs_diff={name: max_abs_diff(reference[name], candidate[name]) for name in names})


def outputs_in_batches(run: Callable[[np.ndarray], Mapping[str, np.ndarray]], images: np.ndarray,
                       max_batch: int) -> dict[str, np.ndarray]:
    """`run` (images -> outputs by name) over `images` in batches of at most `max_batch`, the outputs joined."""
    runs = [run(images[start:start + max_batch]) for start in range(0, len(images), max_batch)]
    return {name: np.concatenate([outputs[name] for outputs in runs]) for name in runs[0]}
