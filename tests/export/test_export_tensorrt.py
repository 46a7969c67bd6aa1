"""TensorRT: without a GPU or the package, --tensorrt fails in one line after writing everything else;
the one runner (capsnet.runtime.tensorrt_runner), which export's parity check and the server share, is checked against
labelled FAKES of tensorrt and the CUDA runtime (tests/fake_tensorrt.py: neither can be installed here);
with a GPU and TensorRT (GPU tests), engines of each precision are built, described and checked against ONNX Runtime."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from fake_tensorrt import INPUT, OUTPUTS, FakeCudaRuntime, fake_tensorrt, kernel

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig
from capsnet.export.tensorrt_build import PARITY_TOLERANCE, engine_outputs, source_variant
from capsnet.model_description.files import PLAN_INFO_KEYS
from capsnet.runtime import tensorrt_runner
from capsnet.runtime.tensorrt_runner import EngineRunner, unavailable_reason
from capsnet.serving.engine.backends.tensorrt_backend import check_plan_matches


@pytest.fixture
def fake_gpus(monkeypatch):
    """FAKE tensorrt and CUDA runtime with two GPUs, in place of the real ones for this test."""
    runtime = FakeCudaRuntime(device_count=2)
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", fake_tensorrt(runtime))
    monkeypatch.setattr(tensorrt_runner, "cudart", lambda: runtime)
    return runtime


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 1, 2, 2), dtype=np.float32)  # (N, 1, 2, 2)


def test_tensorrt_availability_is_one_check_with_the_reason(fake_gpus, monkeypatch):
    assert unavailable_reason(0) is None and unavailable_reason(1) is None
    assert unavailable_reason(2) == "no CUDA GPU 2: this machine has 2 (0 to 1)"
    fake_gpus.device_count = 0
    assert unavailable_reason(0) == "no CUDA GPU"
    monkeypatch.delitem(__import__("sys").modules, "tensorrt")
    assert unavailable_reason(0) == "the tensorrt package is not installed (pip install 'capsnet-serve[gpu]')"


def test_tensorrt_runner_runs_on_the_configured_gpu_from_any_thread(fake_gpus):
    with EngineRunner(b"engine", INPUT, OUTPUTS, max_batch=4, gpu=1) as runner:
        assert {device for _, device in fake_gpus.device.values()} == {1}  # every buffer on GPU 1, not device 0
        fake_gpus.cudaSetDevice(0)  # as a thread that last used GPU 0
        got = {}
        worker = threading.Thread(target=lambda: got.update(runner.run(images(3))))  # the batcher's own thread
        worker.start()
        worker.join(10)
        for name, expected in kernel(images(3)).items():
            np.testing.assert_allclose(got[name], expected, rtol=1e-6)
        once, twice = runner.run(images(1, seed=1)), runner.run(images(4, seed=2))  # buffers reused, results kept
        np.testing.assert_allclose(once["poses"], kernel(images(1, seed=1))["poses"], rtol=1e-6)
        assert twice["probabilities"].shape == (4, 3) and twice["probabilities"].dtype == np.float32
        with pytest.raises(CapsNetError, match="1 to 4 images"):
            runner.run(images(5))


def test_tensorrt_runner_frees_every_buffer_and_stream_on_close(fake_gpus):
    runner = EngineRunner(b"engine", INPUT, OUTPUTS, max_batch=8, gpu=1)
    assert len(fake_gpus.host) == len(fake_gpus.device) == 3 and len(fake_gpus.streams) == 1
    runner.close()
    runner.close()  # twice is harmless
    assert fake_gpus.host == {} and fake_gpus.device == {} and fake_gpus.streams == set()
    assert sorted(fake_gpus.freed) == [("device", 1)] * 3 + [("host", 1)] * 3


def test_tensorrt_runner_refuses_a_damaged_plan_or_missing_tensor_and_leaks_nothing(fake_gpus):
    with pytest.raises(CapsNetError, match="could not be deserialized"):
        EngineRunner(b"damaged", INPUT, OUTPUTS, max_batch=4)
    with pytest.raises(CapsNetError, match="no tensors reconstruction"):
        EngineRunner(b"engine", INPUT, (*OUTPUTS, "reconstruction"), max_batch=4)
    assert fake_gpus.host == {} and fake_gpus.device == {} and fake_gpus.streams == set()


def test_export_parity_runs_the_engine_with_the_serving_runner(fake_gpus, tmp_path):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    batches = [images(1), images(4, seed=3)]
    results = engine_outputs(plan, batches, OUTPUTS, EngineConfig(min_batch=1, opt_batch=2, max_batch=4, gpu=1))
    for batch, result in zip(batches, results):
        for name, expected in kernel(batch).items():
            np.testing.assert_allclose(result[name], expected, rtol=1e-6)
    assert fake_gpus.device == {} and fake_gpus.host == {}  # freed once the check is done


def test_tensorrt_plan_for_another_gpu_or_version_is_refused():
    info = {"tensorrt_version": "10.1.0", "gpu_name": "Fake GPU 0", "compute_capability": "9.0"}
    with pytest.raises(CapsNetError, match=r"built with TensorRT 10\.1\.0, this machine has 10\.2\.0"):
        check_plan_matches("model.plan", info, "10.2.0", "Fake GPU 0", "9.0")
    with pytest.raises(CapsNetError,
                       match=r"built for Fake GPU 0 \(compute capability 9\.0\), this GPU is Fake GPU 1 \(9\.1\)"):
        check_plan_matches("model.plan", info, "10.1.0", "Fake GPU 1", "9.1")
    check_plan_matches("model.plan", info, "10.1.0", "Fake GPU 0", "9.0")


def test_tensorrt_gpu_index_is_checked():
    with pytest.raises(CapsNetError, match="--gpu must be a CUDA device index >= 0, got -1"):
        EngineConfig(gpu=-1)


def test_export_tensorrt_source_graph_per_version():
    assert [source_variant(p, 11) for p in ("fp32", "fp16", "int8")] == ["fp32", "fp16", "int8"]  # strongly typed
    assert [source_variant(p, 10) for p in ("fp32", "fp16", "int8")] == ["fp32", "fp32", "int8"]  # builder flags


@pytest.mark.parametrize("options, message", [
    ({"min_batch": 8, "opt_batch": 4}, "--min-batch <= --opt-batch"),
    ({"opt_batch": 512}, "--opt-batch <= --max-batch"),
    ({"workspace_mib": 0}, "--workspace-mib"),
    ({"precision": "int4"}, "precision"),
])
def test_export_tensorrt_options_are_checked(options, message):
    with pytest.raises(CapsNetError, match=message):
        EngineConfig(**options)


@pytest.mark.skipif(unavailable_reason() is None, reason="TensorRT and a GPU are here: the GPU tests cover it")
def test_export_tensorrt_unavailable_fails_in_one_line_after_the_other_artifacts(random_tiny_checkpoint, tmp_path,
                                                                                 capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.json").write_text("{}")  # a previous export, which is replaced
    (out / "stale.onnx").write_text("old")
    code = main(["export", str(random_tiny_checkpoint), "--out", str(out), "--tensorrt"])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("capsnet export: error:")]
    assert code == 2 and "Traceback" not in stderr
    assert len(errors) == 1 and unavailable_reason() in errors[0]
    assert sorted(path.name for path in out.iterdir()) == ["model.ckpt", "model.json", "model.onnx", "reference.npz"]
    assert json.loads((out / "model.json").read_text())["artifacts"]["tensorrt"] is None
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no staging or previous copy left


@pytest.mark.gpu
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_export_tensorrt_engine(trained_tiny_checkpoint, tmp_path, precision):
    out, cache = tmp_path / "model", tmp_path / "timing.cache"
    code = main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--tensorrt",
                 "--tensorrt-precision", precision, "--min-batch", "1", "--opt-batch", "8", "--max-batch", "32",
                 "--timing-cache", str(cache), "--triton", str(tmp_path / "triton")])
    assert code == 0
    sidecar = json.loads((out / "model.json").read_text())
    assert sidecar["artifacts"]["tensorrt"] == "model.plan" and (out / "model.plan").stat().st_size > 0
    info = json.loads((out / "model.plan.json").read_text())
    assert set(info) == set(PLAN_INFO_KEYS)
    assert (info["precision"], info["min_batch"], info["opt_batch"], info["max_batch"]) == (precision, 1, 8, 32)
    engine = sidecar["parity"]["tensorrt"]
    assert engine["batch_sizes"] == [1, 8, 32] and engine["images"] == 41
    assert max(engine["max_abs_diff"].values()) <= PARITY_TOLERANCE[precision]
    assert cache.stat().st_size > 0  # written for the next build to reuse
    assert (tmp_path / "triton" / "capsnet" / "1" / "model.plan").read_bytes() == (out / "model.plan").read_bytes()
