"""Reduced precision for the checkpoint's PyTorch model (the torch backend, the AOTInductor packages), and the
measurements of the precision gate (capsnet/model_description/precision_gate.py states the criterion).

The convolutions are 95-98% of CapsNet's FLOPs, so they are what runs in fp16 or bf16; routing, squash and the
decoder keep fp32, whose sums over 1,152 capsules an 8-bit (bf16) or 11-bit (fp16) mantissa would blur.

The gate's torch variants are measured at export on the CPU by emulation: fp32 convolutions of inputs, weights
and outputs rounded to fp16/bf16, which is what fp16/bf16 convolutions with fp32 accumulation compute (cuDNN,
oneDNN) up to the order of the sums. The server then checks that its real kernels reproduce those figures.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from capsnet.model_description.precision_gate import PrecisionGate
from capsnet.runtime.cpu import CpuKind
from capsnet.training.data import to_float

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ACCURACY_BATCH = 250


def convolutions_in(model: nn.Module, precision: str, emulate: bool = False) -> int:
    """Every Conv2d of `model` in `precision` ("fp16" | "bf16"): its weights stored so, its input cast on the way
    in, its output cast back to fp32. With `emulate`, the weights, inputs and outputs are only rounded to that
    precision and the convolution runs in fp32 (any CPU, at fp32 speed). Returns the number converted."""
    dtype = DTYPES[precision]
    convolutions = [module for module in model.modules() if isinstance(module, nn.Conv2d)]
    for conv in convolutions:
        if emulate:
            with torch.no_grad():
                for parameter in conv.parameters():
                    parameter.copy_(parameter.to(dtype).float())
            conv.register_forward_pre_hook(lambda _, inputs: tuple(x.to(dtype).float() for x in inputs))
            conv.register_forward_hook(lambda _, inputs, output: output.to(dtype).float())
        else:
            conv.to(dtype)
            conv.register_forward_pre_hook(lambda _, inputs: tuple(x.to(dtype) for x in inputs))
            conv.register_forward_hook(lambda _, inputs, output: output.float())
    return len(convolutions)


def routing_inputs_in(model: nn.Module, precision: str) -> None:
    """Emulates the fused routing kernels' rounding (capsnet/runtime/fused_routing.py) on top of
    `convolutions_in(..., emulate=True)`: DigitCaps' weights and input capsules rounded to `precision`, every
    product and sum in fp32, which is what their fp16/bf16 tensor-core products with fp32 accumulation compute."""
    dtype = DTYPES[precision]
    digit_caps = model.get_submodule("digit_caps")
    weight = digit_caps.get_parameter("weight")
    with torch.no_grad():
        weight.copy_(weight.to(dtype).float())
    digit_caps.register_forward_pre_hook(lambda _, inputs: tuple(x.to(dtype).float() for x in inputs))


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
    same_class = reference["probabilities"].argmax(axis=1) == candidate["probabilities"].argmax(axis=1)
    bounded = ("probabilities",) if precision == "int8" else tuple(candidate)  # int8 moves poses more (GATE_MAX_DIFF)
    gate = PrecisionGate(
        precision=precision, computed_by=computed_by, accuracy_fp32=accuracy_fp32, accuracy=accuracy,
        accuracy_change_points=change, max_drop_points=max_drop, test_images=len(labels),
        argmax_agreement=float(same_class.mean()),
        max_abs_diff=_max_abs_diff(reference["probabilities"], candidate["probabilities"]),
        bounded_diff=max(_max_abs_diff(reference[name], candidate[name]) for name in bounded),
        reference_images=len(same_class), measured_on=measured_on)
    return gate


def _max_abs_diff(reference: np.ndarray, candidate: np.ndarray) -> float:
    difference = np.abs(reference - candidate)
    return float(difference.max()) if np.isfinite(difference).all() else float("inf")


def torch_gates(model_factory, reference_images: np.ndarray, fp32_reference: dict[str, np.ndarray],
                test_images: np.ndarray, labels: np.ndarray, fp32_test: np.ndarray, max_drop: float,
                fused: bool = False) -> dict:
    """The torch_fp16 and torch_bf16 gate entries, and fused_fp16 and fused_bf16 where `fused` (the model's routing
    runs in the fused kernels), each measured by emulation on this CPU (`test_images` uint8). `model_factory()`
    gives a fresh FP32 model (the conversion changes the model it is given)."""
    gates = {}
    cpu = CpuKind.this_host().describe()
    engines = {"torch": "convolutions"}
    if fused:
        engines["fused"] = "convolutions and routing products' inputs"
    for engine, rounded in engines.items():
        for precision in DTYPES:
            model = model_factory()
            convolutions_in(model, precision, emulate=True)
            if engine == "fused":
                routing_inputs_in(model, precision)
            candidate = model_outputs(model, reference_images, tuple(fp32_reference))
            candidate_test = model_outputs(model, test_images, ("probabilities",))["probabilities"]
            gates[f"{engine}_{precision}"] = measure_gate(
                precision, f"the checkpoint, {rounded} in {precision} (emulated in fp32)", fp32_reference, candidate,
                labels, fp32_test, candidate_test, max_drop, cpu)
    return gates


def accuracy_change_points(accuracy_fp32: float, accuracy: float) -> float:
    """The accuracy change in percentage points, rounded as model.json records it, so that the gate judges that
    figure (unrounded, 100 * (0.823 - 0.833) is -1.0000000000000009, which a max drop of 1 refused)."""
    return round(100 * (accuracy - accuracy_fp32), 4)
