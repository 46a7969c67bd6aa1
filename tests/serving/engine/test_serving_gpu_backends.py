"""The GPU backends on a real CUDA GPU (skipped without one): the torch backend with CUDA graphs in fp32, fp16 and
bf16, the fused routing kernels in the same three, the CUDA AOTInductor packages compiled by `capsnet export --aoti
cuda`, each self-checked, served and answering as ONNX Runtime does (fp32 within 1e-4, the reduced precisions within
their gate), and `--backend auto` choosing among them and saying why. scripts/gpu_check.sh runs these."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serving_helpers import ServerThread, assert_served_as_onnxruntime, server_config

from capsnet.cli import main
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import create_backend
from capsnet.serving.engine.backends.torch_backend import TorchBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")]

MAX_BATCH = 64


@pytest.fixture(scope="module")
def cuda_model_dir(trained_tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda") / "model"
    assert main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--reconstruction"]) == 0
    return out


@pytest.fixture(scope="module")
def aoti_cuda_model_dir(trained_tiny_checkpoint, tmp_path_factory):
    """The CUDA packages (a minute or more of compiling): the tests that need them come last."""
    out = tmp_path_factory.mktemp("cuda-aoti") / "model"
    assert main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--reconstruction", "--aoti", "cuda",
                 "--aoti-precision", "fp32,bf16", "--gpu", "0", "--max-batch", str(MAX_BATCH)]) == 0
    return out


def _served_as_onnxruntime(model_dir, backend: str, precision: str) -> None:
    images = np.random.default_rng(7).random((MAX_BATCH // 2 + 3, 1, 28, 28), dtype=np.float32)
    assert_served_as_onnxruntime(model_dir, backend, precision, images, described="GPU 0", gpu=0,
                                 max_batch_size=MAX_BATCH)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_torch_backend_serves_as_onnxruntime_does(cuda_model_dir, precision):
    _served_as_onnxruntime(cuda_model_dir, "torch", precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_fused_backend_serves_as_onnxruntime_does(cuda_model_dir, precision):
    _served_as_onnxruntime(cuda_model_dir, "fused", precision)


def test_an_fp32_engine_leaves_the_process_tf32_switches_as_they_were(cuda_model_dir):
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for name in ("torch", "fused"):
        backend = create_backend(name, "fp32", load_artifacts(cuda_model_dir),
                                 server_config(cuda_model_dir, backend=name, gpu=0, max_batch_size=MAX_BATCH))
        backend.run(np.zeros((3, 1, 28, 28), dtype=np.float32))
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before, name


def test_cuda_graph_buckets_match_eager_on_the_gpu(cuda_model_dir):
    artifacts = load_artifacts(cuda_model_dir)
    graphs = TorchBackend(artifacts, "fp32", 1, 0, MAX_BATCH)
    eager = TorchBackend(artifacts, "fp32", 1, 0, MAX_BATCH, graphs=False)
    assert "CUDA graphs for batch buckets 1/2/4/8/16/32/64" in graphs.description
    rng = np.random.default_rng(8)
    for batch in (MAX_BATCH, 3, 1, 40, 2):
        images = rng.random((batch, 1, 28, 28), dtype=np.float32)
        got, expected = graphs.run(images), eager.run(images)
        for name in got:
            assert np.abs(got[name] - expected[name]).max() <= 1e-6, (batch, name)


def test_auto_serves_the_fastest_gpu_backend_and_says_why(cuda_model_dir):
    served = ServerThread(server_config(cuda_model_dir, backend="auto", max_batch_size=MAX_BATCH))
    try:
        spec = served.server.service.spec
        assert spec.backend in ("fused", "torch") and spec.self_check.passed
        assert f"{spec.precision} on {spec.backend}, at batch 1/16/{MAX_BATCH}: " in spec.choice
        assert " on GPU 0" in spec.choice and "not tensorrt" in spec.choice
        rivals = {"fused fp32", "torch fp32"} - {f"{spec.backend} {spec.precision}"}
        assert all(f"x {rival} (" in spec.choice for rival in rivals)  # both timed
    finally:
        served.stop()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_cuda_packages_serve_as_onnxruntime_does(aoti_cuda_model_dir, precision):
    _served_as_onnxruntime(aoti_cuda_model_dir, "aoti", precision)
