"""PyTorch from the checkpoint copy, eager, on the CPU or on CUDA device --gpu N.

On the CPU: the reference the exported backends are compared with (fp32), and the bf16 path for CPUs with native
bf16 (AVX512_BF16, AMX), where oneDNN runs the convolutions in bf16.
On a GPU: fp32 (no TF32), fp16 or bf16 convolutions, every padded batch bucket up to --max-batch-size a CUDA graph
captured at start-up (serving/engine/backends/runner_backend.py), so a batch is one graph launch between two
pinned-memory copies.
"""

from __future__ import annotations

import torch

from capsnet.runtime.reduced_precision import convolutions_in
from capsnet.runtime.torch_runner import module_forward
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.runner_backend import Loaded, RunnerBackend, checkpoint_model

# the benchmarks ask it before they load a backend
from capsnet.serving.engine.backends.runner_backend import bf16_unavailable_reason as bf16_unavailable_reason


class TorchBackend(RunnerBackend):
    name = "torch"

    @staticmethod
    def load(artifacts: ModelArtifacts, precision: str, device: torch.device, max_batch_size: int) -> Loaded:
        model = checkpoint_model(artifacts, device)
        converted = "" if precision == "fp32" else f", {convolutions_in(model, precision)} convolutions in {precision}"
        return Loaded(module_forward(model, artifacts.output_names), model, artifacts.checkpoint.name, converted,
                      strict_fp32=True)
