"""The fused backend through the real server: on the CPU its kernels run in Triton's interpreter (where there is no
GPU), so the whole path — export's gate entries, the self-check, KServe and our API — is checked in CI at the tiny
model's size; models outside the kernels and a CPU without the interpreter are refused in one line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from cpu_kinds import CPU_KINDS
from serving_helpers import assert_served_as_onnxruntime, server_config

from capsnet.errors import CapsNetError
from capsnet.runtime.cpu import CPU_FLAGS_ENV
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import create_backend

ON_GPU = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (pip install triton, in the dev extra)")


@pytest.fixture(scope="module")
def tiny_model_dir(full_tiny_export):
    """The trained tiny model through `capsnet export --reconstruction` (and the other CPU options), which the export
    tests share: its gate entries for the fused kernels are export's defaults."""
    return full_tiny_export / "model"


def test_export_names_the_fused_engine_and_gates_its_precisions(tiny_model_dir):
    artifacts = load_artifacts(tiny_model_dir)
    assert artifacts.routing["gpu_engine"] == "fused"
    for precision in ("fp16", "bf16"):
        gate = artifacts.precision_gate[f"fused_{precision}"]
        assert gate.accepted and "routing products' inputs in " + precision in gate.computed_by


@pytest.mark.slow  # the self-check's 128 images and the test's own in the interpreter
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_backend_serves_as_onnxruntime_does(tiny_model_dir, precision, monkeypatch):
    # The CPU kind decides only whether bf16 convolutions are offered on the CPU (the tests below). Served as a
    # kind with native bf16, a host without it runs torch's emulation of the same arithmetic.
    monkeypatch.setenv(CPU_FLAGS_ENV, CPU_KINDS["avx512-bf16"])
    # In the interpreter a run costs about 2 s however few images it holds: the self-check's 128 reference images go
    # in one batch, and there is no warm-up (batch sizes 1 to 16 before the test's own 11 images, on the same path).
    # On a GPU, batches of up to 16, a CUDA graph each, warmed up as served.
    settings = {"max_batch_size": 16, "gpu": 0} if ON_GPU else {"max_batch_size": 128, "warmup": False}
    images = np.random.default_rng(3).random((11, 1, 28, 28), dtype=np.float32)
    assert_served_as_onnxruntime(tiny_model_dir, "fused", precision, images, described="routing in the fused kernels",
                                 **settings)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the convolutions run in bf16 on the GPU, whatever the CPU")
@pytest.mark.parametrize("cpu_kind", ["avx2", "avx512"], indirect=True)
def test_bf16_on_a_cpu_without_native_bf16_is_refused_in_one_line(tiny_model_dir, cpu_kind):
    with pytest.raises(CapsNetError) as refused:
        create_backend("fused", "bf16", load_artifacts(tiny_model_dir),
                       server_config(tiny_model_dir, backend="fused", precision="bf16"))
    assert str(refused.value) == (f"--precision bf16: this CPU has no native bf16 (no avx512_bf16 or amx_bf16: "
                                  f"{cpu_kind.describe()}); emulated bf16 runs many times slower than fp32")


@pytest.mark.parametrize("cpu_kind", ["avx512-bf16", "amx"], indirect=True)
def test_bf16_on_a_cpu_with_native_bf16_is_offered(tiny_model_dir, cpu_kind):
    backend = create_backend("fused", "bf16", load_artifacts(tiny_model_dir),
                             server_config(tiny_model_dir, backend="fused", precision="bf16"))
    assert backend.precision == "bf16"


def test_models_outside_the_kernels_are_refused_with_the_reason(em_tiny_export):
    artifacts = load_artifacts(em_tiny_export)
    assert artifacts.routing["gpu_engine"].startswith("unfused: arch em ")
    config = server_config(em_tiny_export, backend="fused", gpu=0 if ON_GPU else None)
    with pytest.raises(CapsNetError, match=r"the fused backend cannot run this model: arch em .*--backend torch"):
        create_backend("fused", "fp32", artifacts, config)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the fused backend runs compiled kernels")
def test_on_the_cpu_it_runs_only_in_the_interpreter(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(CapsNetError, match="the fused backend runs on a CUDA GPU: add --gpu N"):
        create_backend("fused", "fp32", load_artifacts(tiny_model_dir), server_config(tiny_model_dir, backend="fused"))
