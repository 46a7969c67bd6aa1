"""AOTInductor: serves a package compiled by `capsnet export --aoti` (model.<device>.<precision>.pt2) on the CPU or
on CUDA device --gpu N, through capsnet.runtime.torch_runner.TorchRunner, the runner export checked the package with
(each batch at its own size: a package is not captured in CUDA graphs).

A package runs only with the torch that compiled it, and a CUDA one only on a GPU of its compute capability; both
are checked against model.json before it is loaded, so a mismatch is one line at startup, not a crash.
"""

from __future__ import annotations

import torch

from capsnet.errors import CapsNetError
from capsnet.model_description.schema import AotiPackage
from capsnet.runtime.torch_runner import gpu_facts, package_forward
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.runner_backend import Loaded, RunnerBackend


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


class AotiBackend(RunnerBackend):
    name = "aoti"

    @staticmethod
    def load(artifacts: ModelArtifacts, precision: str, device: torch.device, max_batch_size: int) -> Loaded:
        package = find_package(artifacts, device.type, precision)
        problem = package_problem(package, device.index, max_batch_size)
        if problem:
            raise CapsNetError(problem)
        path = artifacts.resolve(artifacts.directory, package.file, "an AOTInductor package")
        forward = package_forward(path, device)
        return Loaded(forward, forward.call, f"{package.file} ({precision})", f", torch {torch.__version__}")
