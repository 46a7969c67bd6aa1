"""AOTInductor: the exported program compiled ahead of time into a package (model.<device>.<precision>.pt2) that
`torch._inductor.aoti_load_package` runs without Python tracing, on the CPU (C++/OpenMP kernels) or on a CUDA GPU
(Triton kernels). The fp32 packages are compiled from the very program the ONNX file is written from.

A package runs only with the torch that compiled it, and a CUDA one only on a GPU of the compute capability it was
compiled for: model.json records both, and the server refuses a mismatch in one line.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from capsnet.runtime.cpu import CpuKind
from capsnet.errors import CapsNetError, first_line
from capsnet.export.logs import quiet
from capsnet.model_description.files import AOTI_PRECISIONS, aoti_name
from capsnet.model_description.schema import AotiPackage
from capsnet.runtime.torch_runner import gpu_facts

log = logging.getLogger(__name__)


def compiler_unavailable_reason() -> str | None:
    """AOTInductor compiles C++ (the CPU kernels and every package's wrapper): why it cannot here, or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()  # runs `$CXX --version` (default g++)
    except Exception as err:  # inductor's InvalidCxxCompiler, naming what it tried
        return f"no C++ compiler for AOTInductor ({type(err).__name__}: {first_line(err)[:200]})"
    return None


def move_program(program: torch.export.ExportedProgram, device: str) -> torch.export.ExportedProgram:
    """The same program, its weights and device arguments on `device` ("cuda:N")."""
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(program, device)


def compile_package(program: torch.export.ExportedProgram, path: Path, target: torch.device, precision: str,
                    max_batch: int) -> AotiPackage:
    """Compile `program` (already on `target`, the CPU or a CUDA device) for batches of 1 to `max_batch` into the
    package `path`; returns its description (no parity yet)."""
    device = target.type
    if precision not in AOTI_PRECISIONS[device]:
        raise CapsNetError(f"AOTInductor {device} packages are {', '.join(AOTI_PRECISIONS[device])}, not {precision}")
    started = time.monotonic()
    # inductor narrates its passes and warns about its own deprecations
    with quiet("torch._inductor", "torch._dynamo", "torch.export"):
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        except Exception as err:  # a failed C++ or Triton compile: one line, the log has the rest
            log.debug("AOTInductor compile failed", exc_info=True)
            raise CapsNetError(f"AOTInductor could not compile the {device} {precision} package: "
                               f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}") from None
    log.info("AOTInductor %s %s package compiled in %.1f s (%.1f MB)", device, precision, time.monotonic() - started,
             path.stat().st_size / 1e6)
    if device == "cuda":
        built_on, capability = gpu_facts(target.index)
    else:
        built_on, capability = CpuKind.this_host().describe(), None
    return AotiPackage(file=path.name, device=device, precision=precision, torch_version=torch.__version__,
                       min_batch=1, max_batch=max_batch, built_on=built_on, compute_capability=capability,
                       parity={})


def package_path(directory: Path, device: str, precision: str) -> Path:
    return directory / aoti_name(device, precision)
