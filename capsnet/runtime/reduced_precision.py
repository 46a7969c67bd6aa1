"""Reduced precision for a PyTorch model: its convolutions in fp16 or bf16, for real (the torch backend, the
AOTInductor packages) or emulated in fp32 (the precision gate's measurements at export, on any CPU).

The convolutions are 95-98% of CapsNet's FLOPs, so they are what runs in fp16 or bf16; routing, squash and the
decoder keep fp32, whose sums over 1,152 capsules an 8-bit (bf16) or 11-bit (fp16) mantissa would blur.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
