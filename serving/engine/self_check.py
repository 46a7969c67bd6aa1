"""The self-check before SERVING: the export's reference images through the loaded backend, compared
with the FP32 outputs recorded at export (reference.npz).

FP32 must match them within the export's parity tolerance, every image in the same class. A reduced precision (INT8,
FP16, BF16) answers to the precision gate (capsnet/model_description/precision_gate.py): it must reproduce what
export measured for that model on the same images, within the gate's margins. INT8 kernels differ between x86 kinds
(AVX2's 16-bit intermediate sums saturate where VNNI's do not), GPU kernels between GPUs, so a variant gated on one
machine is checked again on the one that serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.backend_table import gate_variant
from capsnet.model_description.precision_gate import (FP32_TOLERANCE, Comparison, PrecisionGate, compare_outputs,
                                                      outputs_in_batches)
from capsnet.model_description.schema import ModelDescription
from capsnet.runtime.cpu import CpuKind

if TYPE_CHECKING:  # the backends package imports this module: a type is all it needs from there
    from capsnet.serving.engine.backends.base import Backend

K = TypeVar("K")


@dataclass(frozen=True)
class SelfCheck:
    precision: str
    images: int
    max_abs_diff: dict[str, float]  # per compared output
    argmax_agreement: float  # share of images with the FP32 reference's class
    cpu: str  # the CPU that ran it, e.g. "AMD EPYC [avx2 fma]"
    tolerance: float  # the largest max |diff| allowed
    min_agreement: float  # the least agreement allowed
    gate: str = ""  # a reduced precision: what export measured, and the margins
    non_finite: tuple[str, ...] = ()  # outputs with a NaN or an infinity, compared or not

    @property
    def passed(self) -> bool:
        compared = Comparison(self.images, self.argmax_agreement, self.max_abs_diff)
        return not self.non_finite and compared.passes(self.tolerance, self.min_agreement)

    def describe(self) -> str:
        diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in self.max_abs_diff.items())
        nan = f"NaN or infinity in {', '.join(self.non_finite)}; " if self.non_finite else ""
        gate = f"; the precision gate: {self.gate}" if self.gate else ""
        return (f"{nan}{self.precision} against the FP32 reference on {self.images} images: max |diff| {diffs} "
                f"(allowed {self.tolerance:.3g}), same class for {self.argmax_agreement:.1%} "
                f"(needed {self.min_agreement:.1%}){gate}")


def precision_gate(model: ModelDescription, backend: str, precision: str) -> PrecisionGate | None:
    """The gate entry a backend serving `precision` answers to (None for fp32); CapsNetError when model.json has
    none, or export did not accept that variant."""
    variant = gate_variant(backend, precision)
    if variant is None:
        return None
    gate = model.precision_gate.get(variant)
    if gate is None:
        raise CapsNetError(f"model.json has no precision gate for {variant}: {precision} was not exported for the "
                           f"{backend} backend; re-export with it")
    if not gate.accepted:
        raise CapsNetError(f"--precision {precision} on the {backend} backend: export did not accept it for this "
                           f"model: {gate.refusal()}")
    return gate


def self_check(backend: Backend, reference_path: Path, max_batch_size: int, model: ModelDescription) -> SelfCheck:
    """Run the reference images through `backend` in batches it accepts and compare with the stored outputs.

    `model` (model.json's description) is what the reference set and the backend's outputs must agree with; a
    disagreement is a CapsNetError, as is any failure of the backend here, its first run of the model."""
    gate = precision_gate(model, backend.name, backend.precision)
    reference = read_reference(reference_path, model)
    images = reference.pop("images")  # (N, C, H, W) float32
    try:
        joined = outputs_in_batches(backend.run, images, max_batch_size)
        outputs = {name: joined[name] for name in backend.output_names}
    except CapsNetError:
        raise
    except Exception as err:  # onnxruntime, torch, TensorRT each raise their own types
        raise CapsNetError(f"self-check: the {backend.name} backend ({backend.description}) failed on the reference "
                           f"images: {type(err).__name__}: {first_line(err)}") from None
    for name, output in outputs.items():
        expected = model.output_shapes[name]
        if output.shape != (len(images), *expected):
            raise CapsNetError(f"self-check: the {backend.name} backend ({backend.description}) gives {name} of shape "
                               f"{list(output.shape[1:])} per image, model.json says {list(expected)}: the file is not "
                               "this export's; re-export it")
    # a reduced precision is held to the probabilities (what its gate measured); FP32 to every output
    names = ("probabilities",) if gate else tuple(name for name in backend.output_names if name in reference)
    compared = compare_outputs(reference, outputs, names)
    return SelfCheck(
        precision=backend.precision,
        images=compared.images,
        max_abs_diff=compared.max_abs_diff,
        argmax_agreement=compared.argmax_agreement,
        cpu=CpuKind.this_host().describe(),
        tolerance=gate.most_diff if gate else FP32_TOLERANCE,
        min_agreement=gate.least_agreement if gate else 1.0,
        gate=gate.describe_bounds() if gate else "",
        non_finite=non_finite(outputs),
    )


def non_finite(outputs: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The outputs holding a NaN or an infinity: a self-check fails on one, compared or not (a reduced precision is
    compared on its probabilities only)."""
    return tuple(name for name, output in outputs.items() if not np.isfinite(output).all())


def read_reference(path: Path, model: ModelDescription) -> dict[str, np.ndarray]:
    """reference.npz's arrays, checked: float32 images [N, C, H, W] (N >= 1) and N FP32 outputs per output."""
    try:
        with np.load(path) as archive:
            reference = {name: archive[name] for name in archive.files}
    except Exception as err:  # numpy raises many types for a damaged archive (ValueError, EOFError, BadZipFile, ...)
        raise CapsNetError(f"{path} is damaged: not a self-check set ({type(err).__name__}: {first_line(err)}); "
                           "re-export it") from None
    images = reference.get("images")
    problem = None
    if images is None or "probabilities" not in reference:
        problem = "no 'images' or no 'probabilities' array"
    elif images.dtype != np.float32 or images.ndim != 4 or len(images) == 0:
        problem = f"'images' is {images.dtype} {list(images.shape)}, expected float32 [N >= 1, C, H, W]"
    elif images.shape[1:] != model.input_shape:
        problem = f"'images' are {list(images.shape[1:])}, model.json says {list(model.input_shape)}"
    else:
        for name, array in reference.items():
            expected = model.output_shapes.get(name)  # None: an array model.json does not list
            if name != "images" and (array.dtype.kind != "f" or array.shape[:1] != (len(images),)
                                     or (expected is not None and array.shape[1:] != expected)):
                problem = (f"{name!r} is {array.dtype} {list(array.shape)}, expected float32 [{len(images)}"
                           f"{''.join(f', {d}' for d in expected or ())}{'' if expected else ', ...'}]")
                break
    if problem:
        raise CapsNetError(f"{path} is damaged or not this export's: {problem}; re-export it")
    return reference


def refusal(check: SelfCheck) -> CapsNetError:
    return CapsNetError(f"self-check failed: {check.describe()}; this CPU: {check.cpu}")


def times_in_turns(runs: Mapping[K, Callable[[np.ndarray], object]], images: np.ndarray,
                   rounds: int) -> dict[K, list[float]]:
    """Seconds of each of `rounds` calls of every run on `images`, by key. The runs take turns in every round, so a
    burst of other work on the machine slows them alike instead of one of them. The auto race's loop (best_times); here,
    not in capsnet.bench.timing, because the benchmarks may import serving and serving may not import them."""
    times: dict[K, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            started = time.perf_counter()
            run(images)
            times[key].append(time.perf_counter() - started)
    return times


def best_times(backends: list[Backend], images: np.ndarray, rounds: int) -> list[float]:
    """The fastest of `rounds` runs of `images` by each backend, in seconds (the least disturbed by other work),
    the backends taking turns (times_in_turns)."""
    times = times_in_turns(dict(enumerate(backend.run for backend in backends)), images, rounds)
    return [min(taken) for taken in times.values()]
