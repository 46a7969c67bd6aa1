"""The one interface every inference backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from capsnet.serving.errors import BackendUnusable

if TYPE_CHECKING:  # torch (capsnet.gpu_timing), which a server of ONNX Runtime on the CPU never loads
    from capsnet.gpu_timing import GpuTimer
    from capsnet.serving.config import ServerConfig
    from capsnet.serving.engine.artifacts import ModelArtifacts


class Backend(ABC):
    name: str  # a name of serving/engine/backend_registry.py's BACKEND_KINDS
    precision: str  # "fp32" | "fp16" | "int8" | "bf16"
    description: str  # what it runs on, for the startup log, e.g. "CPUExecutionProvider, 2 threads"
    output_names: tuple[str, ...]  # the outputs run() returns, as in model.json
    on_gpu: bool = False  # runs on a CUDA GPU: the server then exports the GPUs' nv_gpu_* metrics
    # times each run's model work on the GPU (the torch and AOTInductor runners on CUDA); read after run() returns
    gpu_timer: GpuTimer | None = None

    @classmethod
    @abstractmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> Backend:
        """The backend for `config` in `precision` ("auto": the backend's own choice)."""

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """Why this backend cannot serve on `device` ("cpu" or "gpu") on this host, beyond its backend table row's
        `requires`, checked before one is made; None where it can."""
        return None

    @abstractmethod
    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """images float32 (N, C, H, W) in [0, 1] -> {output name: float32 (N, ...)}.

        Called from one worker thread at a time; the arrays returned are the caller's to keep.
        """

    def close(self) -> None:  # noqa: B027 (a no-op unless the backend holds memory outside Python)
        """Free what the backend holds outside Python's reach (device and pinned memory); after the last run."""

    def warmup(self, batch_sizes: Iterable[int], input_shape: tuple[int, int, int]) -> None:
        """Run each batch size once, so allocations, kernel choices and lazy inits happen before traffic."""
        for batch_size in batch_sizes:
            self.run(np.zeros((batch_size, *input_shape), dtype=np.float32))


class DeviceFailure(BackendUnusable):
    """The accelerator failed under a batch (CUDA out of memory, a lost device, an illegal address): the batch's
    requests fail with INTERNAL (HTTP 500), and the server stops reporting SERVING (the lifecycle's FAILED phase),
    since the batches after it may fail alike until it is restarted."""


class DeviceBackend(Backend):
    """A backend on a device that can fail at run time: its failures become DeviceFailure, and every later batch
    fails at once with the same reason instead of touching the broken device again."""

    failed: str | None = None  # why the device failed, once it has

    def device_failure(self, err: BaseException) -> DeviceFailure:
        if self.failed is None:
            self.failed = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
        return DeviceFailure(f"{self.description}: {self.failed}")
