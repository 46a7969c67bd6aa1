"""Facts about the machine a benchmark ran on: CPU, cores, load, vector ISA, GPU, software versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

from capsnet.runtime.cpu import CpuKind, bf16_autocast_pays, read_cpuinfo

PACKAGES = ("capsnet-serve", "torch", "onnxruntime", "onnx", "numpy", "grpcio", "tensorrt")


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def load_average() -> list[float]:
    return [round(load, 2) for load in os.getloadavg()]


def cpu_times() -> dict[str, int]:
    """The machine's CPU time so far by state (/proc/stat, in clock ticks): user, system, idle, steal, ..."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]  # "cpu user nice system idle iowait ..."
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return dict(zip(names, map(int, fields)))


def cpu_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Share of the CPU time between two cpu_times() readings spent busy, idle, and stolen by the
    hypervisor for other virtual machines (time this machine's cores were not running at all)."""
    delta = {name: after[name] - before[name] for name in before}
    total = sum(delta.values()) or 1
    return {"busy": (total - delta["idle"] - delta["iowait"] - delta["steal"]) / total,
            "idle": (delta["idle"] + delta["iowait"]) / total, "steal": delta["steal"] / total}


def machine_facts() -> dict:
    cpuinfo = read_cpuinfo()
    cpu = CpuKind.this_host()
    return {
        "cpu_model": cpu.model,
        # The model name can be generic under a hypervisor; family/model/stepping still tell the generation.
        "cpu_id": f"family {cpuinfo.get('cpu family', '?')} model {cpuinfo.get('model', '?')} "
                  f"stepping {cpuinfo.get('stepping', '?')}",
        "cores": cores(),
        "isa": cpu.to_dict()["flags"],
        "cpu_flags": sorted(cpuinfo.get("flags", "").split()),
        "torch_cpu": _torch_cpu(cpu),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": _gpu_name(),
        "platform": platform.platform(),
        "versions": {"python": platform.python_version(), **_versions()},
        "load_before": load_average(),
    }


def _torch_cpu(cpu: CpuKind) -> dict:
    """What torch's CPU kernels use here: their vector ISA, and whether bf16 would run natively (oneDNN's own
    answer, and the CPU flags' with the ISA caps) or be emulated."""
    import torch

    capability = cpu.aten_capability()
    native, why = bf16_autocast_pays(cpu, capability)
    return {"capability": capability, "onednn_native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "native_bf16": native, "bf16_why": why}


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _versions() -> dict[str, str]:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
