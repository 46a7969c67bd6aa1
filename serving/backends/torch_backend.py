"""PyTorch on the CPU from the checkpoint copy: the reference the exported backends are compared with, and
the bf16 path for CPUs with native bf16 (AVX512_BF16, AMX), where oneDNN runs the convolutions in bf16."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from capsnet.cpu import CpuKind, bf16_autocast_pays
from capsnet.errors import CapsNetError
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import Backend
from capsnet.training.checkpoint import load_checkpoint

PRECISIONS = ("fp32", "bf16")


def bf16_unavailable_reason() -> str | None:
    """None where this CPU runs bf16 convolutions natively; else why not (emulated bf16 is many times slower)."""
    native, why = bf16_autocast_pays(CpuKind.this_host(), torch.backends.cpu.get_cpu_capability())
    return None if native else f"{why}; emulated bf16 runs many times slower than fp32"


def convolutions_in_bf16(model: nn.Module) -> int:
    """Every Conv2d of `model` in bf16 (its weights stored so, its input cast on the way in, its output cast
    back to fp32): the convolutions are 98% of the paper CapsNet's FLOPs, while routing, squash and the decoder keep
    fp32, whose sums over 1,152 capsules bf16's 8-bit mantissa would blur. Returns the number converted."""
    convolutions = [module for module in model.modules() if isinstance(module, nn.Conv2d)]
    for conv in convolutions:
        conv.to(torch.bfloat16)
        conv.register_forward_pre_hook(lambda _, inputs: tuple(x.to(torch.bfloat16) for x in inputs))
        conv.register_forward_hook(lambda _, inputs, output: output.float())
    return len(convolutions)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int):
        if precision not in PRECISIONS:
            raise CapsNetError(f"the torch backend runs the checkpoint in fp32 or bf16; --precision {precision} "
                               "needs onnxruntime or tensorrt")
        if precision == "bf16" and (why := bf16_unavailable_reason()):
            raise CapsNetError(f"--precision bf16: {why}")
        torch.set_num_threads(threads)
        self.model = load_checkpoint(artifacts.checkpoint).build_model()
        config = self.model.config
        if (config.in_channels, config.height, config.width) != artifacts.input_shape:
            raise CapsNetError(f"{artifacts.checkpoint} is for {config.in_channels}x{config.height}x{config.width} "
                               f"images, model.json says {'x'.join(map(str, artifacts.input_shape))}")
        self.precision = precision
        converted = f", {convolutions_in_bf16(self.model)} convolutions in bf16" if precision == "bf16" else ""
        self.output_names = artifacts.output_names
        self.description = f"{artifacts.checkpoint.name} on CPU, {threads} threads{converted}"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            output = self.model(torch.from_numpy(images))
        return {name: getattr(output, name).numpy() for name in self.output_names}
