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
from capsnet.errors import CapsNetError, first_line
from capsnet.model_description import ModelDescription
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
    non_finite: tuple[str, ...] = ()  # outputs with a NaN or an infinity, compared or not

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.precision][0]

    @property
    def min_agreement(self) -> float:
        return TOLERANCES[self.precision][1]

    @property
    def passed(self) -> bool:
        # every output on its own: max() over the values drops a NaN that is not first
        return (not self.non_finite and all(diff <= self.tolerance for diff in self.max_abs_diff.values())
                and self.argmax_agreement >= self.min_agreement)

    def describe(self) -> str:
        diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in self.max_abs_diff.items())
        nan = f"NaN or infinity in {', '.join(self.non_finite)}; " if self.non_finite else ""
        return (f"{nan}{self.precision} against the FP32 reference on {self.images} images: max |diff| {diffs} "
                f"(allowed {self.tolerance:g}), same class for {self.argmax_agreement:.1%} "
                f"(needed {self.min_agreement:.0%})")


def self_check(backend: Backend, reference_path: Path, max_batch_size: int, model: ModelDescription) -> SelfCheck:
    """Run the reference images through `backend` in batches it accepts and compare with the stored outputs.

    `model` (model.json's description) is what the reference set and the backend's outputs must agree with; a
    disagreement is a CapsNetError, as is any failure of the backend here, its first run of the model."""
    reference = read_reference(reference_path, model)
    images = reference.pop("images")  # (N, C, H, W) float32
    try:
        runs = [backend.run(images[start:start + max_batch_size]) for start in range(0, len(images), max_batch_size)]
        outputs = {name: np.concatenate([run[name] for run in runs]) for name in backend.output_names}
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
    names = COMPARED_OUTPUTS[backend.precision] or tuple(name for name in backend.output_names if name in reference)
    same_class = outputs["probabilities"].argmax(axis=1) == reference["probabilities"].argmax(axis=1)  # (N,)
    return SelfCheck(
        precision=backend.precision,
        images=len(images),
        max_abs_diff={name: float(np.abs(outputs[name] - reference[name]).max()) for name in names},
        argmax_agreement=float(same_class.mean()),
        cpu=CpuKind.this_host().describe(),
        non_finite=tuple(name for name, output in outputs.items() if not np.isfinite(output).all()),
    )


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


def best_times(backends: list[Backend], images: np.ndarray, rounds: int) -> list[float]:
    """The fastest of `rounds` runs of `images` by each backend, in seconds (the least disturbed by other work);
    the backends take turns, so a burst of other work on the machine slows them alike instead of one of them."""
    times = [[] for _ in backends]
    for _ in range(rounds):
        for backend, taken in zip(backends, times):
            started = time.perf_counter()
            backend.run(images)
            taken.append(time.perf_counter() - started)
    return [min(taken) for taken in times]
