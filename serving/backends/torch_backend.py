"""PyTorch on the CPU from the checkpoint copy: the reference the exported backends are compared with."""

from __future__ import annotations

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import Backend
from capsnet.training.checkpoint import load_checkpoint


class TorchBackend(Backend):
    name = "torch"
    precision = "fp32"

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int):
        if precision != "fp32":
            raise CapsNetError(f"the torch backend runs the fp32 checkpoint; --precision {precision} needs onnxruntime or tensorrt")
        torch.set_num_threads(threads)
        self.model = load_checkpoint(artifacts.checkpoint).build_model()
        config = self.model.config
        if (config.in_channels, config.height, config.width) != artifacts.input_shape:
            raise CapsNetError(f"{artifacts.checkpoint} is for {config.in_channels}x{config.height}x{config.width} "
                               f"images, model.json says {'x'.join(map(str, artifacts.input_shape))}")
        self.output_names = artifacts.output_names
        self.description = f"{artifacts.checkpoint.name} on CPU, {threads} threads"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            output = self.model(torch.from_numpy(images))
        return {name: getattr(output, name).numpy() for name in self.output_names}
