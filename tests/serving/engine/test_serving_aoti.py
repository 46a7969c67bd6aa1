"""`--backend aoti` on the CPU: the export's AOTInductor package served over KServe v2 (gRPC and REST, with
tritonclient) answering as ONNX Runtime does, self-checked like every backend, and each refusal one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from capsnet.cli import main
from capsnet.model_description.files import file_sha256
from serving_helpers import ServerThread, onnxruntime_reference, server_config

OUTPUTS = ("probabilities", "poses", "reconstruction")


def _serve_error(model_dir, capsys, *flags: str) -> str:
    code = main(["serve", "--model", str(model_dir), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                 *flags])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0].removeprefix("capsnet serve: error: ")


def test_the_cpu_package_answers_over_kserve_as_onnxruntime_does(aoti_model_dir):
    images = np.random.default_rng(4).random((6, 1, 28, 28), dtype=np.float32)  # (6, 1, 28, 28)
    served = ServerThread(server_config(aoti_model_dir, backend="aoti"))
    try:
        spec = served.server.service.spec
        assert (spec.backend, spec.precision, spec.platform) == ("aoti", "fp32", "pytorch_aoti")
        assert spec.self_check.passed
        assert "model.cpu.fp32.pt2 (fp32) on CPU" in served.server.service.backend.description
        grpc_client = grpcclient.InferenceServerClient(served.target)
        inputs = [grpcclient.InferInput("images", list(images.shape), "FP32")]
        inputs[0].set_data_from_numpy(images)
        over_grpc = grpc_client.infer("capsnet", inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS])
        http_client = httpclient.InferenceServerClient(f"127.0.0.1:{served.server.http_port}")
        inputs = [httpclient.InferInput("images", list(images.shape), "FP32")]
        inputs[0].set_data_from_numpy(images, binary_data=True)
        over_rest = http_client.infer("capsnet", inputs, outputs=[httpclient.InferRequestedOutput(n, binary_data=True)
                                                                  for n in OUTPUTS])
        assert grpc_client.get_model_metadata("capsnet").platform == "pytorch_aoti"
    finally:
        served.stop()
    expected = onnxruntime_reference(aoti_model_dir, images)
    for name in OUTPUTS:
        assert np.abs(over_grpc.as_numpy(name) - expected[name]).max() <= 1e-4, name
        assert np.abs(over_rest.as_numpy(name) - expected[name]).max() <= 1e-4, name


def _copy(model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def test_a_package_of_another_torch_is_refused_in_one_line(aoti_model_dir, tmp_path, capsys):
    copy = _copy(aoti_model_dir, tmp_path)
    sidecar = json.loads((copy / "model.json").read_text())
    sidecar["aoti"][0]["torch_version"] = "2.11.0+cu130"
    (copy / "model.json").write_text(json.dumps(sidecar))
    assert _serve_error(copy, capsys, "--backend", "aoti", "--max-batch-size", "8") == (
        f"model.cpu.fp32.pt2 was compiled by torch 2.11.0+cu130, this machine has torch {torch.__version__}; "
        "re-export with --aoti here")


def test_a_package_for_cuda_only_is_refused_on_the_cpu(aoti_model_dir, tmp_path, capsys):
    copy = _copy(aoti_model_dir, tmp_path)
    sidecar = json.loads((copy / "model.json").read_text())
    sidecar["aoti"][0].update(device="cuda", file="model.cuda.fp32.pt2", compute_capability="9.0",
                              built_on="NVIDIA H100")
    (copy / "model.cpu.fp32.pt2").rename(copy / "model.cuda.fp32.pt2")
    sidecar["sha256"]["model.cuda.fp32.pt2"] = sidecar["sha256"].pop("model.cpu.fp32.pt2")
    (copy / "model.json").write_text(json.dumps(sidecar))
    assert _serve_error(copy, capsys, "--backend", "aoti") == (
        f"{copy} has no AOTInductor package for cpu fp32 (it has: cuda fp32); export with --aoti")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("backend", ["aoti", "torch"])
def test_a_gpu_without_one_is_refused_in_one_line(aoti_model_dir, capsys, backend):
    assert _serve_error(aoti_model_dir, capsys, "--backend", backend, "--gpu", "0") == (
        f"--gpu 0: no CUDA GPU is visible to torch {torch.__version__} "
        f"({'a CPU-only build' if torch.version.cuda is None else f'CUDA {torch.version.cuda}'})")


def test_a_batch_past_the_package_is_refused(aoti_model_dir, capsys):
    assert _serve_error(aoti_model_dir, capsys, "--backend", "aoti", "--max-batch-size", "32") == (
        "model.cpu.fp32.pt2 takes batches of 1 to 16 images, --max-batch-size is 32; lower it or re-export with a "
        "larger --max-batch")


def test_an_export_without_packages_is_refused(model_dir, capsys):
    assert _serve_error(model_dir, capsys, "--backend", "aoti") == (
        f"{model_dir} has no AOTInductor package for cpu fp32 (it has: none); export with --aoti")
    assert _serve_error(model_dir, capsys, "--backend", "aoti", "--precision", "int8") == (
        "--precision int8 is an ONNX model: the aoti backend runs fp32, fp16 or bf16 (int8: --backend onnxruntime, "
        "openvino or tensorrt)")


def test_a_changed_package_is_refused(aoti_model_dir, tmp_path, capsys):
    copy = _copy(aoti_model_dir, tmp_path)
    package = copy / "model.cpu.fp32.pt2"
    package.write_bytes(package.read_bytes() + b"\0")
    error = _serve_error(copy, capsys, "--backend", "aoti", "--max-batch-size", "8")
    assert "model.cpu.fp32.pt2 does not match" in error and "re-export" in error
    assert file_sha256(package) != json.loads((copy / "model.json").read_text())["sha256"]["model.cpu.fp32.pt2"]
