"""The self-check before SERVING: the export's reference images through the loaded backend, compared
with the FP32 outputs recorded at export (reference.npz).

INT8 kernels differ between x86 kinds (AVX2's 16-bit intermediate sums saturate where VNNI's do
not), so a model gated on one machine is checked again on the one that serves it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capsnet.cpu import CpuKind
from capsnet.errors import CapsNetError
from capsnet.serving.backends.base import Backend

# (max |diff| of every output against FP32, least share of images with the FP32 class), per precision.
# FP32 is the export's parity tolerance; INT8/FP16/BF16 bound the probabilities only: quantisation noise
# measured 5e-3 (INT8) and 3e-4 (FP16) on the trained tiny model, 1.2e-3 (bf16 convolutions, the trained
# paper model, 300 test digits), a broken file moves them by far more.
TOLERANCES = {"fp32": (1e-4, 1.0), "fp16": (1e-2, 0.99), "int8": (0.1, 0.99), "bf16": (1e-2, 0.99)}
COMPARED_OUTPUTS = {"fp32": None, "fp16": ("probabilities",), "int8": ("probabilities",),
                    "bf16": ("probabilities",)}  # None: every output


@dataclass(frozen=True)
class SelfCheck:
    precision: str
    images: int
    max_abs_diff: dict[str, float]  # per compared output
    argmax_agreement: float  # share of images with the FP32 reference's class
    cpu: str  # the CPU that ran it, e.g. "AMD EPYC [avx2 fma]"

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.precision][0]

    @property
    def min_agreement(self) -> float:
        return TOLERANCES[self.precision][1]

    @property
    def passed(self) -> bool:
        return max(self.max_abs_diff.values()) <= self.tolerance and self.argmax_agreement >= self.min_agreement

    def describe(self) -> str:
        diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in self.max_abs_diff.items())
        return (f"{self.precision} against the FP32 reference on {self.images} images: max |diff| {diffs} "
                f"(allowed {self.tolerance:g}), same class for {self.argmax_agreement:.1%} "
                f"(needed {self.min_agreement:.0%})")


def self_check(backend: Backend, reference_path: Path, max_batch_size: int) -> SelfCheck:
    """Run the reference images through `backend` in batches it accepts and compare with the stored outputs."""
    with np.load(reference_path) as archive:
        reference = {name: archive[name] for name in archive.files}
    images = reference.pop("images")  # (N, C, H, W) float32
    runs = [backend.run(images[start:start + max_batch_size]) for start in range(0, len(images), max_batch_size)]
    outputs = {name: np.concatenate([run[name] for run in runs]) for name in backend.output_names}
    names = COMPARED_OUTPUTS[backend.precision] or tuple(name for name in backend.output_names if name in reference)
    same_class = outputs["probabilities"].argmax(axis=1) == reference["probabilities"].argmax(axis=1)  # (N,)
    return SelfCheck(
        precision=backend.precision,
        images=len(images),
        max_abs_diff={name: float(np.abs(outputs[name] - reference[name]).max()) for name in names},
        argmax_agreement=float(same_class.mean()),
        cpu=CpuKind.this_host().describe(),
    )


def refusal(check: SelfCheck) -> CapsNetError:
    return CapsNetError(f"self-check failed: {check.describe()}; this CPU: {check.cpu}")


def best_time(backend: Backend, images: np.ndarray, rounds: int) -> float:
    """The fastest of `rounds` runs of `images`, in seconds (the least disturbed by other work)."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        backend.run(images)
        times.append(time.perf_counter() - started)
    return min(times)
