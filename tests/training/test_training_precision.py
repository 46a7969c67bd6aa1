"""--amp on CPU: bf16 autocast only where the CPU runs bf16 natively; fp32 with one line elsewhere.

The decision is tested with faked CPU flags, and end to end under ONEDNN_MAX_CPU_ISA=AVX2, which makes
any host's oneDNN behave as an AVX2-only CPU's."""

from __future__ import annotations

import pytest

from capsnet.cli import main
from capsnet.models.checkpoint import load_checkpoint
from capsnet.runtime.cpu import CPU_FLAGS_ENV, CpuKind, bf16_autocast_pays, bf16_on_this_cpu

AVX2 = CpuKind("AMD EPYC", frozenset({"avx2", "fma"}))
ZEN4 = CpuKind("AMD EPYC 9R14", frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}))
SAPPHIRE_RAPIDS = CpuKind("Intel Xeon",
                          frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}))
SKYLAKE = CpuKind("Intel Xeon Skylake", frozenset({"avx2", "fma", "avx512f"}))  # AVX-512 without bf16


@pytest.mark.parametrize("cpu, capability, environ, native, reason", [
    (AVX2, "AVX2", {}, False, "no native bf16"),
    (SKYLAKE, "AVX512", {}, False, "no native bf16"),
    (ZEN4, "AVX512", {}, True, "native bf16"),
    (SAPPHIRE_RAPIDS, "AVX512", {}, True, "native bf16"),
    (SAPPHIRE_RAPIDS, "AVX2", {}, False, "capped at AVX2 (ATEN_CPU_CAPABILITY)"),
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, "oneDNN is capped at AVX2"),
    (ZEN4, "AVX512", {"DNNL_MAX_CPU_ISA": "avx512_core_vnni"}, False, "capped at AVX512_CORE_VNNI"),
    (SAPPHIRE_RAPIDS, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True, "native bf16"),
])
def test_bf16_autocast_only_with_native_bf16(cpu, capability, environ, native, reason):
    pays, why = bf16_autocast_pays(cpu, capability, environ)
    assert pays is native and reason in why


def test_cpu_kind_reads_this_host():
    cpu = CpuKind.this_host()
    assert cpu.describe().startswith(cpu.model) and set(cpu.to_dict()["flags"]) == set(cpu.flags)
    assert cpu.vnni == bool(cpu.flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def test_this_hosts_bf16_decision_follows_the_cpu_kind(cpu_kind):
    native, why = bf16_on_this_cpu()
    assert cpu_kind.substituted and native is cpu_kind.native_bf16 and cpu_kind.describe() in why


@pytest.mark.parametrize("substitute, flags, capability", [
    ("avx2,fma", {"avx2", "fma"}, "AVX2"),
    ("fpu avx2 avx512f avx512_bf16 sse4_2", {"avx2", "avx512f", "avx512_bf16"}, "AVX512"),
    ("", set(), "DEFAULT"),
])
def test_cpu_flags_from_the_environment_stand_for_the_hosts(monkeypatch, substitute, flags, capability):
    monkeypatch.setenv(CPU_FLAGS_ENV, substitute)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cpu = CpuKind.this_host()
    assert cpu.flags == flags and cpu.aten_capability() == capability
    assert cpu.describe().startswith(f"{CpuKind.this_host({}).model} as {CPU_FLAGS_ENV} [")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch's own cap applies to a substituted kind too
    assert cpu.aten_capability() == ("AVX2" if capability == "AVX512" else capability)


def test_amp_on_a_cpu_without_native_bf16_trains_in_fp32_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN as on an AVX2-only CPU, whatever this host is
    out = tmp_path / "model.ckpt"
    code = main(["train", "--data", "embedded", "--preset", "tiny", "--epochs", "1", "--batch-size", "256", "--amp",
                 "--out", str(out), "--no-progress"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line for line in lines if line.startswith("--amp: training in fp32:")], lines
    assert load_checkpoint(out).metrics["amp"] is False  # what the run really did
