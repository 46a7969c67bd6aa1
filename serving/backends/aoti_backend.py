"""AOTInductor: serves a package compiled by `capsnet export --aoti` (model.<device>.<precision>.pt2) on the CPU or
on CUDA device --gpu N, through capsnet.runtime.torch_runner.AotiRunner, the runner export checked the package with.

A package runs only with the torch that compiled it, and a CUDA one only on a GPU of its compute capability; both
are checked against model.json before it is loaded, so a mismatch is one line at startup, not a crash.
"""

from __future__ import annotations

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.model_description.schema import AotiPackage
from capsnet.serving.artifacts import ModelArtifacts
from capsnet.serving.backends.base import DeviceBackend, DeviceFailure
from capsnet.serving.config import ServerConfig
from capsnet.serving.backends.torch_backend import torch_device
from capsnet.runtime.torch_runner import AotiRunner, gpu_facts, is_device_error


def find_package(artifacts: ModelArtifacts, device: str, precision: str) -> AotiPackage:
    """The export's package for `device` ("cpu" | "cuda") and `precision`; CapsNetError naming what there is."""
    for package in artifacts.aoti:
        if (package.device, package.precision) == (device, precision):
            return package
    have = ", ".join(f"{p.device} {p.precision}" for p in artifacts.aoti) or "none"
    how = "--aoti cuda --gpu N on a GPU machine" + (f" --aoti-precision {precision}" if precision != "fp32" else "")
    raise CapsNetError(f"{artifacts.directory} has no AOTInductor package for {device} {precision} (it has: {have}); "
                       f"export with {'--aoti' if device == 'cpu' else how}")


def package_problem(package: AotiPackage, gpu: int | None, max_batch_size: int) -> str | None:
    """Why `package` cannot serve here with batches of up to `max_batch_size`, or None."""
    if package.torch_version != torch.__version__:
        return (f"{package.file} was compiled by torch {package.torch_version}, this machine has torch "
                f"{torch.__version__}; re-export with --aoti here")
    if package.device == "cuda":
        name, capability = gpu_facts(gpu)
        if package.compute_capability != capability:
            return (f"{package.file} was compiled for {package.built_on} (compute capability "
                    f"{package.compute_capability}), GPU {gpu} is {name} ({capability}); re-export with --aoti cuda on "
                    "this GPU")
    if max_batch_size > package.max_batch:
        return (f"{package.file} takes batches of {package.min_batch} to {package.max_batch} images, --max-batch-size "
                f"is {max_batch_size}; lower it or re-export with a larger --max-batch")
    return None


class AotiBackend(DeviceBackend):
    name = "aoti"

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> AotiBackend:
        return cls(artifacts, "fp32" if precision == "auto" else precision, config.intra_op_threads, config.gpu,
                   config.max_batch_size)

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int, gpu: int | None, max_batch_size: int):
        self.device = torch_device(gpu)
        package = find_package(artifacts, self.device.type, precision)
        problem = package_problem(package, gpu, max_batch_size)
        if problem:
            raise CapsNetError(problem)
        path = artifacts.resolve(artifacts.directory, package.file, "an AOTInductor package")
        torch.set_num_threads(threads)
        self.precision = precision
        self.output_names = artifacts.output_names
        self.runner = AotiRunner(path, self.device, artifacts.input_shape, dict(artifacts.output_shapes),
                                 max_batch_size)
        self.on_gpu, self.gpu_timer = self.device.type == "cuda", self.runner.gpu_timer
        where = (f"GPU {gpu} {gpu_facts(gpu)[0]}" if self.device.type == "cuda" else f"CPU, {threads} threads")
        self.description = f"{package.file} ({precision}) on {where}, torch {torch.__version__}"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        if self.failed:
            raise DeviceFailure(f"{self.description}: {self.failed}")
        try:
            return self.runner.run(images)
        except Exception as err:
            if is_device_error(err):
                raise self.device_failure(err) from None
            raise
