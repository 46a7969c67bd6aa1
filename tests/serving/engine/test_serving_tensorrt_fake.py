"""The tensorrt backend wired into the server, on FAKES of tensorrt and the CUDA runtime (tests/fake_tensorrt.py;
neither can be installed here): `auto` picks it on the configured GPU, requests go through the shared runner,
a plan built for another GPU is refused at startup, and stopping the server frees every device and pinned buffer.
What the fakes cannot show (a real engine, real kernels) is left to the GPU tests in test_serving_gpu.py."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from fake_tensorrt import FakeCudaRuntime, fake_tensorrt, kernel
from serving_helpers import ServerThread, server_config

from capsnet.cli import main
from capsnet.client.api import CapsNetClient
from capsnet.model_description.files import file_sha256
from capsnet.runtime import tensorrt_runner
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import choose_backend

PLAN_INFO = {"tensorrt_version": "10.0.0-fake", "gpu_name": "Fake GPU 1", "compute_capability": "9.1",
             "precision": "fp32", "min_batch": 1, "opt_batch": 8, "max_batch": 32}


@pytest.fixture(scope="module")
def plan_model_dir(random_tiny_checkpoint, tmp_path_factory):
    """The tiny model's export plus a (fake) model.plan, described as built on fake GPU 1.

    The self-check set's outputs are replaced by what the fake engine computes, so the server's startup
    self-check holds it to the same standard as a real engine against its model's FP32 outputs."""
    from capsnet.export.exporter import export_model

    out = tmp_path_factory.mktemp("fake-plan") / "model"
    export_model(random_tiny_checkpoint, out)
    sidecar = json.loads((out / "model.json").read_text())
    sidecar["artifacts"]["tensorrt"] = "model.plan"
    (out / "model.plan").write_bytes(b"engine")
    (out / "model.plan.json").write_text(json.dumps(PLAN_INFO))
    with np.load(out / "reference.npz") as archive:
        images = archive["images"]  # (128, C, H, W)
    shapes = {"images": tuple(sidecar["input"]["shape"]),
              **{output["name"]: tuple(output["shape"]) for output in sidecar["outputs"]}}
    np.savez_compressed(out / "reference.npz", images=images, **kernel(images, shapes))
    for name in ("model.plan", "model.plan.json", "reference.npz"):
        sidecar["sha256"][name] = file_sha256(out / name)
    (out / "model.json").write_text(json.dumps(sidecar))
    return out


@pytest.fixture
def fake_gpus(plan_model_dir, monkeypatch):
    """FAKE tensorrt (an engine with the model's tensors) and CUDA runtime with two GPUs, for this test only."""
    artifacts = load_artifacts(plan_model_dir)
    shapes = {artifacts.input_name: artifacts.input_shape, "probabilities": (len(artifacts.class_names),),
              "poses": (len(artifacts.class_names), artifacts.pose_dim)}
    runtime = FakeCudaRuntime(device_count=2)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(runtime, shapes))
    monkeypatch.setattr(tensorrt_runner, "cudart", lambda: runtime)
    return runtime, shapes


def test_auto_serves_the_plan_on_the_configured_gpu_and_frees_it_on_stop(plan_model_dir, fake_gpus):
    runtime, shapes = fake_gpus
    images = np.random.default_rng(8).random((3, *shapes["images"]), dtype=np.float32)  # (3, 1, 28, 28)
    running = ServerThread(server_config(plan_model_dir, backend="auto", gpu=1))
    try:
        spec = running.server.service.spec
        assert (spec.backend, spec.platform) == ("tensorrt", "tensorrt_plan")
        assert {device for _, device in runtime.device.values()} == {1}
        with CapsNetClient(running.target) as client:
            predictions = client.classify(list(images))
    finally:
        running.stop()
    expected = kernel(images, shapes)
    np.testing.assert_allclose(np.stack([p.probabilities for p in predictions]), expected["probabilities"], rtol=1e-6)
    np.testing.assert_allclose(np.stack([p.poses for p in predictions]), expected["poses"], rtol=1e-6)
    assert runtime.device == {} and runtime.host == {} and runtime.streams == set()  # the server closed the backend


def test_auto_without_the_configured_gpu_falls_back_to_onnxruntime(plan_model_dir, fake_gpus):
    backend, why = choose_backend(load_artifacts(plan_model_dir), server_config(plan_model_dir, gpu=2))
    assert backend == "onnxruntime" and "not tensorrt: no CUDA GPU 2: this machine has 2 (0 to 1)" in why


def test_plan_built_on_another_gpu_is_refused_at_startup(plan_model_dir, fake_gpus, capsys):
    runtime, _ = fake_gpus
    code = main(["serve", "--model", str(plan_model_dir), "--backend", "tensorrt", "--gpu", "0",
                 "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1
    assert "was built for Fake GPU 1 (compute capability 9.1), this GPU is Fake GPU 0 (9.0)" in errors[0]
    assert runtime.device == {} and runtime.host == {}  # refused before anything was allocated
