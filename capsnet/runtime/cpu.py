"""What this CPU can do, for choices that differ between x86 kinds (AVX2 only; AVX-512 + VNNI; AMX).

Export records it beside the INT8 accuracy gate, serving beside its self-check, training decides from
it whether bf16 autocast pays. Every decision reads the CPU through `CpuKind.this_host()`, which takes its flags
from CAPSNET_CPU_FLAGS where that is set: the decisions of any kind (AVX2 only, AVX-512 without bf16, AVX-512 with
bf16, AMX) can then be run and tested on any x86 host. The flags decide only what the product chooses; the kernels
that run are still the host's. Dependency-free: torch is imported only when torch's own answer is asked for.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Features that decide which fp32/int8/bf16 kernels oneDNN and ONNX Runtime's MLAS can use.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still allow its bf16 kernels; lower caps (e.g. AVX2, AVX512_CORE,
# AVX512_CORE_VNNI) make bf16 run through slow emulation.
# https://oneapi-src.github.io/oneDNN/dev_guide_cpu_dispatcher_control.html
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                    "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL")

# Most compute threads a --threads flag takes (train, bench, ortprofile): far more than any CPU has cores. Beyond
# it, 100,000 hung ONNX Runtime's session start and crashed torch's thread pool (a segmentation fault after
# libgomp's "Thread creation failed").
MAX_THREADS = 1024

# ISA flags (as /proc/cpuinfo spells them, separated by spaces or commas) to decide by instead of this host's
CPU_FLAGS_ENV = "CAPSNET_CPU_FLAGS"


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@dataclass(frozen=True)
class CpuKind:
    model: str  # e.g. "AMD EPYC" (generic under some hypervisors)
    flags: frozenset[str]  # the ISA_FLAGS this CPU has
    substituted: bool = False  # the flags came from CAPSNET_CPU_FLAGS, not from this host

    @classmethod
    def this_host(cls, environ: Mapping[str, str] | None = None) -> "CpuKind":
        """This host's CPU, or the kind CAPSNET_CPU_FLAGS names: the one place every CPU-kind decision reads."""
        environ = os.environ if environ is None else environ
        info = read_cpuinfo()
        model = info.get("model name", platform.processor() or "unknown")
        substitute = environ.get(CPU_FLAGS_ENV)
        if substitute is not None:
            named = set(substitute.replace(",", " ").split())
            return cls(f"{model} as {CPU_FLAGS_ENV}", frozenset(f for f in ISA_FLAGS if f in named), substituted=True)
        flags = set(info.get("flags", "").split())
        return cls(model, frozenset(f for f in ISA_FLAGS if f in flags))

    @property
    def vnni(self) -> bool:
        """int8 dot products without the 16-bit intermediate sums that saturate on AVX2 (VPMADDUBSW)."""
        return bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8"})

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        """One line for logs, errors and model.json, e.g. "AMD EPYC [avx2 fma]"."""
        return f"{self.model} [{' '.join(f for f in ISA_FLAGS if f in self.flags) or 'no AVX2'}]"

    def to_dict(self) -> dict:
        return {"model": self.model, "flags": [f for f in ISA_FLAGS if f in self.flags]}

    def aten_capability(self, environ: Mapping[str, str] | None = None) -> str:
        """The vector ISA torch's CPU kernels dispatch to: torch's own answer on this host; for a substituted kind,
        the widest its flags allow, capped by ATEN_CPU_CAPABILITY as torch caps it."""
        if not self.substituted:
            import torch

            return torch.backends.cpu.get_cpu_capability()
        environ = os.environ if environ is None else environ
        order = ("DEFAULT", "AVX2", "AVX512")
        widest = "AVX512" if "avx512f" in self.flags else "AVX2" if "avx2" in self.flags else "DEFAULT"
        cap = environ.get("ATEN_CPU_CAPABILITY", "").upper()
        return cap if cap in order and order.index(cap) < order.index(widest) else widest


def bf16_autocast_pays(cpu: CpuKind, aten_capability: str,
                       environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(whether bf16 autocast on this CPU runs native bf16 kernels, why).

    Without native bf16 (AVX512_BF16 or AMX) torch emulates it, which measured ~17x slower than fp32 on an
    AVX2-only EPYC. `aten_capability` is what torch reports (torch.backends.cpu.get_cpu_capability(),
    capped by ATEN_CPU_CAPABILITY); oneDNN's own cap is ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA).
    """
    environ = os.environ if environ is None else environ
    if not cpu.native_bf16:
        return False, f"this CPU has no native bf16 (no avx512_bf16 or amx_bf16: {cpu.describe()})"
    if not aten_capability.upper().startswith("AVX512"):
        return False, f"torch's CPU kernels are capped at {aten_capability} (ATEN_CPU_CAPABILITY)"
    onednn_cap = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if onednn_cap not in ONEDNN_BF16_ISAS:
        return False, f"oneDNN is capped at {onednn_cap} (ONEDNN_MAX_CPU_ISA), below its bf16 kernels"
    return True, f"native bf16 ({cpu.describe()})"


def bf16_on_this_cpu() -> tuple[bool, str]:
    """bf16_autocast_pays for this host (or the kind CAPSNET_CPU_FLAGS names) and torch's capability on it."""
    cpu = CpuKind.this_host()
    return bf16_autocast_pays(cpu, cpu.aten_capability())
