"""The torch, fused and aoti backends: one runner (capsnet/runtime/torch_runner.py: pinned staging, a CUDA graph per
padded batch bucket on a GPU, each batch at its own size on the CPU) around the forward their registry row's kind
loads — the checkpoint eager, its routing in the fused kernels, an AOTInductor package. What each kind serves where
(precisions on a GPU and on the CPU) is read from its row in serving/engine/backend_registry.py.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import load_checkpoint
from capsnet.runtime.cpu import bf16_on_this_cpu
from capsnet.runtime.torch_runner import (Forward, TorchRunner, cuda_unavailable_reason, gpu_facts, is_device_error,
                                          use_threads)
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backend_registry import BACKEND_KINDS
from capsnet.serving.engine.backends.base import DeviceBackend, DeviceFailure

# where a precision refused on the CPU runs there instead
CPU_ALTERNATIVE = {"fp16": "--backend onnxruntime with an --fp16 export",
                   "bf16": "--backend torch, on a CPU with native bf16"}


def bf16_unavailable_reason() -> str | None:
    """None where this CPU runs bf16 convolutions natively; else why not (emulated bf16 is many times slower)."""
    native, why = bf16_on_this_cpu()
    return None if native else f"{why}; emulated bf16 runs many times slower than fp32"


def torch_device(gpu: int | None) -> torch.device:
    """CUDA device `gpu` (None: the CPU); CapsNetError naming what is missing when there is no such GPU."""
    if gpu is None:
        return torch.device("cpu")
    reason = cuda_unavailable_reason(gpu)
    if reason:
        raise CapsNetError(f"--gpu {gpu}: {reason}")
    return torch.device("cuda", gpu)


def checkpoint_model(artifacts: ModelArtifacts, device: torch.device) -> torch.nn.Module:
    """The checkpoint's model on `device` for inference, refused when its images are not model.json's."""
    checkpoint = load_checkpoint(artifacts.checkpoint)
    config = checkpoint.config
    if (config.in_channels, config.height, config.width) != artifacts.input_shape:
        raise CapsNetError(f"{artifacts.checkpoint} is for {config.in_channels}x{config.height}x{config.width} "
                           f"images, model.json says {'x'.join(map(str, artifacts.input_shape))}")
    return checkpoint.build_model().to(device).eval()


@dataclass(frozen=True)
class Loaded:
    """What a kind's `load` gives the runner backend."""

    forward: Forward
    model: Any  # what the forward runs: the module, the fused engine, the package
    source: str  # the file it serves, as the description begins: "model.ckpt", "model.cuda.bf16.pt2 (bf16)"
    detail: str = ""  # how it runs, as the description ends: ", 12 convolutions in bf16"
    strict_fp32: bool = False  # its convolutions and products are chosen at run time: no TF32 in fp32


class RunnerBackend(DeviceBackend):
    """A kind of the torch family: its class names the kind (`name`) and how its forward loads (`load`); the
    runner, the checks of its row, the device failures and batches already on the GPU are this one class's."""

    @staticmethod
    @abstractmethod
    def load(artifacts: ModelArtifacts, precision: str, device: torch.device, max_batch_size: int) -> Loaded:
        """The kind's forward for `artifacts` in `precision` on `device`; CapsNetError why it cannot run here."""

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> RunnerBackend:
        return cls(artifacts, "fp32" if precision == "auto" else precision, config.intra_op_threads, config.gpu,
                   config.max_batch_size)

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int, gpu: int | None = None,
                 max_batch_size: int = 32, buckets: bool | None = None, graphs: bool = True):
        """`buckets` (default: on a GPU, for a forward that can be captured) runs every batch padded to its bucket
        from static tensors; `graphs` makes each bucket a CUDA graph on a GPU (off: eager, for comparison)."""
        kind = BACKEND_KINDS[self.name]
        if precision not in kind.precisions:
            raise CapsNetError(f"the {self.name} backend runs {', '.join(kind.precisions)}; --precision {precision} "
                               "needs onnxruntime or tensorrt")
        self.device = torch_device(gpu)
        self.on_gpu = on_gpu = self.device.type == "cuda"
        if not on_gpu and precision not in kind.cpu_precisions:
            instead = f" (on the CPU: {CPU_ALTERNATIVE[precision]})" if precision in CPU_ALTERNATIVE else ""
            raise CapsNetError(f"--precision {precision} on the {self.name} backend runs on a GPU: add --gpu N"
                               f"{instead}")
        if precision == "bf16" and not on_gpu and (why := bf16_unavailable_reason()):
            raise CapsNetError(f"--precision bf16: {why}")
        use_threads(threads)
        self.precision = precision
        self.output_names = artifacts.output_names
        loaded = self.load(artifacts, precision, self.device, max_batch_size)
        self.model = loaded.model
        self.runner = TorchRunner(loaded.forward, self.device, artifacts.input_shape, dict(artifacts.output_shapes),
                                  max_batch_size, buckets, graphs, fp32=loaded.strict_fp32 and precision == "fp32")
        self.gpu_timer = self.runner.gpu_timer
        where = f"GPU {self.device.index} {gpu_facts(self.device.index)[0]}" if on_gpu else f"CPU, {threads} threads"
        if self.runner.buckets:
            where += f", {self.runner.describe()}"
            if on_gpu:  # what the largest bucket took: the backend's GPU memory, bounded by --max-batch-size
                where += f", {torch.cuda.memory_reserved(self.device) / 2**30:.2f} GiB of GPU memory reserved"
        self.description = f"{loaded.source} on {where}{loaded.detail}"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        if self.failed:
            raise DeviceFailure(f"{self.description}: {self.failed}")
        try:
            return self.runner.run(images)
        except Exception as err:
            if is_device_error(err):
                raise self.device_failure(err) from None
            raise

    def run_device(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """serving/engine/cuda_ipc.py's DeviceInput: a batch already on this GPU (from CUDA shared memory) run by the
        runner (from its bucket's graph), answered on the GPU without a trip through host memory. The outputs are copied
        out on the runner's stream, since the next batch overwrites a bucket's; the caller's stream waits for it."""
        if self.failed:
            raise DeviceFailure(f"{self.description}: {self.failed}")
        if self.runner.io.stream is None:
            raise CapsNetError(f"{self.description}: takes batches already on a GPU only when it runs on one")
        stream, caller = self.runner.io.stream, torch.cuda.current_stream(self.device)
        try:
            stream.wait_stream(caller)  # the images were written on the caller's stream
            outputs = self.runner.run_on_device(images)
            with torch.cuda.stream(stream), torch.inference_mode():
                copies = {name: output.clone() for name, output in outputs.items()}
            for copy in copies.values():
                copy.record_stream(caller)  # its memory is not reused before the caller's stream is done with it
            caller.wait_stream(stream)
            return copies
        except Exception as err:
            if is_device_error(err):
                raise self.device_failure(err) from None
            raise
