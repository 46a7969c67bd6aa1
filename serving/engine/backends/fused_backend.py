"""The checkpoint on a CUDA GPU with its routing in the fused Triton kernels (capsnet/runtime/fused_routing.py):
Conv1 and PrimaryCaps through cuDNN in the precision served, then the PrimaryCaps squash, û and every routing
iteration without û ever reaching GPU memory; every padded batch bucket a CUDA graph, as the torch backend's (the
runner of serving/engine/backends/runner_backend.py).

fp16 and bf16 give the routing products fp16/bf16 inputs with fp32 sums, so they answer to their own gate entries
(fused_fp16, fused_bf16), which export measures by emulating exactly that rounding. Models whose routing the kernels
do not run (EM, any-size models, the CNN baselines) are refused here with the reason; `--backend torch` serves them.
On the CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1), for tests: far too slow to serve.
"""

from __future__ import annotations

import torch

from capsnet.errors import CapsNetError
from capsnet.models.capsnet import CapsNet
from capsnet.models.config import CapsNetConfig
from capsnet.runtime.torch_runner import module_forward
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.runner_backend import Loaded, RunnerBackend, checkpoint_model


class FusedBackend(RunnerBackend):
    name = "fused"

    @staticmethod
    def load(artifacts: ModelArtifacts, precision: str, device: torch.device, max_batch_size: int) -> Loaded:
        model = checkpoint_model(artifacts, device)
        try:
            from capsnet.runtime.fused_routing import (DTYPES, FusedCapsNet, default_programs, fused_unsupported_reason,
                                                       interpreted)
        except ImportError as err:  # triton is not installed
            raise CapsNetError(f"the fused backend needs triton ({err})") from None
        if device.type != "cuda" and not interpreted():
            raise CapsNetError("the fused backend runs on a CUDA GPU: add --gpu N (on the CPU the kernels run only "
                               "in Triton's interpreter, TRITON_INTERPRET=1, for tests)")
        config = model.config
        assert isinstance(config, CapsNetConfig)  # every architecture's model holds its config
        reason = fused_unsupported_reason(config)
        if reason:
            raise CapsNetError(f"the fused backend cannot run this model: {reason}; serve it with --backend torch")
        assert isinstance(model, CapsNet)  # arch capsnet, which the kernels run, is built as a CapsNet
        engine = FusedCapsNet(model, DTYPES[precision], "reconstruction" in artifacts.output_names,
                              default_programs(device))
        return Loaded(module_forward(engine, artifacts.output_names), engine, artifacts.checkpoint.name,
                      f", convolutions in {precision} on channels-last tensors, routing in the fused kernels",
                      strict_fp32=True)
