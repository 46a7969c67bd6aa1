"""PyTorch from the checkpoint copy, on the CPU or on CUDA device --gpu N.

On the CPU: the reference the exported backends are compared with (fp32), and the bf16 path for CPUs with native
bf16 (AVX512_BF16, AMX), where oneDNN runs the convolutions in bf16.
On a GPU: fp32 (no TF32), fp16 or bf16 convolutions, every padded batch bucket up to --max-batch-size a CUDA graph
captured at start-up (capsnet/runtime/torch_runner.py), so a batch is one graph launch between two pinned-memory copies.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from capsnet.runtime.cpu import bf16_on_this_cpu
from capsnet.errors import CapsNetError
from capsnet.runtime.reduced_precision import convolutions_in
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import DeviceBackend, DeviceFailure
from capsnet.serving.config import ServerConfig
from capsnet.runtime.torch_runner import BucketRunner, cuda_unavailable_reason, gpu_facts, is_device_error
from capsnet.models.checkpoint import load_checkpoint

PRECISIONS = ("fp32", "fp16", "bf16")


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


class TorchBackend(DeviceBackend):
    name = "torch"

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> TorchBackend:
        return cls(artifacts, "fp32" if precision == "auto" else precision, config.intra_op_threads, config.gpu,
                   config.max_batch_size)

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int, gpu: int | None = None,
                 max_batch_size: int = 32, buckets: bool | None = None, graphs: bool = True):
        """`buckets` (default: on a GPU) runs every batch padded to its bucket from static tensors; `graphs` makes
        each bucket a CUDA graph on a GPU (off: eager, for comparison)."""
        if precision not in PRECISIONS:
            raise CapsNetError(f"the torch backend runs the checkpoint in {', '.join(PRECISIONS)}; --precision "
                               f"{precision} needs onnxruntime or tensorrt")
        self.device = torch_device(gpu)
        self.on_gpu = on_gpu = self.device.type == "cuda"
        if precision == "fp16" and not on_gpu:
            raise CapsNetError("--precision fp16 on the torch backend runs on a GPU: add --gpu N (on the CPU: "
                               "--backend onnxruntime with an --fp16 export)")
        if precision == "bf16" and not on_gpu and (why := bf16_unavailable_reason()):
            raise CapsNetError(f"--precision bf16: {why}")
        torch.set_num_threads(threads)
        checkpoint = load_checkpoint(artifacts.checkpoint)
        model, config = checkpoint.build_model(), checkpoint.config
        if (config.in_channels, config.height, config.width) != artifacts.input_shape:
            raise CapsNetError(f"{artifacts.checkpoint} is for {config.in_channels}x{config.height}x{config.width} "
                               f"images, model.json says {'x'.join(map(str, artifacts.input_shape))}")
        self.precision = precision
        self.output_names = artifacts.output_names
        self.model, converted = self.prepare(model.to(self.device).eval(), precision)
        where = f"GPU {self.device.index} {gpu_facts(self.device.index)[0]}" if on_gpu else f"CPU, {threads} threads"
        self.runner = None
        if on_gpu if buckets is None else buckets:
            names = self.output_names
            self.runner = BucketRunner(lambda images: tuple(getattr(self.model(images), name) for name in names),
                                       self.device, artifacts.input_shape, dict(artifacts.output_shapes),
                                       max_batch_size, graphs, fp32=precision == "fp32")
            self.gpu_timer = self.runner.gpu_timer
            mode = "CUDA graphs" if self.runner.graphs else "eager"
            where += f", {mode} for batch buckets {'/'.join(map(str, self.runner.buckets))}"
            if on_gpu:  # what the largest bucket took: the backend's GPU memory, bounded by --max-batch-size
                where += f", {torch.cuda.memory_reserved(self.device) / 2**30:.2f} GiB of GPU memory reserved"
        self.description = f"{artifacts.checkpoint.name} on {where}{converted}"

    def prepare(self, model: nn.Module, precision: str) -> tuple[Callable, str]:
        """The forward pass to serve (images -> outputs by name), and what it runs in, for the description."""
        if precision == "fp32":
            return model, ""
        return model, f", {convolutions_in(model, precision)} convolutions in {precision}"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        if self.failed:
            raise DeviceFailure(f"{self.description}: {self.failed}")
        try:
            if self.runner is not None:
                return self.runner.run(images)
            with torch.inference_mode():
                output = self.model(torch.from_numpy(images))
            return {name: getattr(output, name).numpy() for name in self.output_names}
        except Exception as err:
            if is_device_error(err):
                raise self.device_failure(err) from None
            raise

    def run_device(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """serving/cuda_ipc.py's DeviceInput: a batch already on this GPU (from CUDA shared memory) run from its
        bucket's graph, answered on the GPU without a trip through host memory. The bucket's static outputs are
        copied out on the runner's stream, since the next batch overwrites them; the caller's stream waits for it."""
        if self.failed:
            raise DeviceFailure(f"{self.description}: {self.failed}")
        if self.runner is None or self.runner.io.stream is None:
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
