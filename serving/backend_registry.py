"""Every backend the server can run, in one table: the name `--backend` takes, where its class lives, the platform
Triton's model configuration names it by, the precisions it serves on a GPU and on the CPU, the precision-gate
entries those answer to, and whether it takes Triton's CUDA shared memory when it serves on a GPU.

The classes are imported only when a backend is made, so a CPU server never imports torch or TensorRT.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from capsnet.model_description.files import AOTI_PRECISIONS

if TYPE_CHECKING:
    from capsnet.serving.backends.base import Backend


@dataclass(frozen=True)
class BackendKind:
    name: str
    module: str
    class_name: str
    platform: str  # Triton's model configuration `platform`
    precisions: tuple[str, ...]  # every precision it serves, all of them on a GPU
    cpu_precisions: tuple[str, ...]  # on the CPU; none: it serves on a GPU only
    gate_family: str  # its fp16/bf16/int8 answer to the gate entry "<gate_family>_<precision>" of model.json
    # Serving on a GPU (Backend.on_gpu), it takes images from CUDA regions: the server then offers Triton's
    # cuda_shared_memory extension. Not ONNX Runtime's GPU providers: a server of them need not hold torch's CUDA,
    # which opens the regions (serving/cuda_ipc.py).
    cuda_shared_memory: bool = True

    def backend_class(self) -> type[Backend]:
        return getattr(importlib.import_module(self.module), self.class_name)


BACKEND_KINDS: dict[str, BackendKind] = {kind.name: kind for kind in (
    BackendKind("onnxruntime", "capsnet.serving.backends.onnxruntime_backend", "OnnxRuntimeBackend",
                "onnxruntime_onnx", ("fp32", "fp16", "int8"), ("fp32", "fp16", "int8"), "onnx",
                cuda_shared_memory=False),
    BackendKind("tensorrt", "capsnet.serving.backends.tensorrt_backend", "TensorRTBackend", "tensorrt_plan",
                ("fp32", "fp16", "int8"), (), "onnx"),
    # eager PyTorch with a CUDA graph per batch bucket: "pytorch", not TorchScript ("pytorch_libtorch"); bf16 on a
    # CPU with native bf16 only (serving/backends/runner_backend.py)
    BackendKind("torch", "capsnet.serving.backends.torch_backend", "TorchBackend", "pytorch",
                ("fp32", "fp16", "bf16"), ("fp32", "bf16"), "torch"),
    # the packages export compiles for each device
    BackendKind("aoti", "capsnet.serving.backends.aoti_backend", "AotiBackend", "pytorch_aoti",
                AOTI_PRECISIONS["cuda"], AOTI_PRECISIONS["cpu"], "torch"),
    # cuDNN convolutions and the fused routing kernels (capsnet/runtime/fused_routing.py), CUDA graphs per bucket;
    # on the CPU its kernels run only in Triton's interpreter (TRITON_INTERPRET=1), for tests
    BackendKind("fused", "capsnet.serving.backends.fused_backend", "FusedBackend", "pytorch",
                ("fp32", "fp16", "bf16"), ("fp32", "bf16"), "fused"),
)}
BACKENDS = ("auto", *BACKEND_KINDS)


def takes_cuda_shared_memory(backend: Backend) -> bool:
    """Whether `backend` serves on a GPU and takes images from CUDA shared-memory regions there."""
    return backend.on_gpu and BACKEND_KINDS[backend.name].cuda_shared_memory


def gate_variant(backend: str, precision: str) -> str | None:
    """The gate entry that a backend serving `precision` answers to (None: fp32, held to the FP32 parity)."""
    if precision == "fp32":
        return None
    return f"{BACKEND_KINDS[backend].gate_family}_{precision}"
