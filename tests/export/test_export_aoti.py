"""AOTInductor at export: the CPU package compiled from the program the ONNX file comes from, described in
model.json (device, dtype, torch version, batch range, hash), checked against PyTorch, and every refusal in one
line before minutes of work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from capsnet.cli import main
from capsnet.runtime.cpu import CpuKind
from capsnet.errors import CapsNetError
from capsnet.export.config import ExportConfig
from capsnet.model_description.files import file_sha256
from capsnet.model_description.schema import ModelDescription
from capsnet.runtime.torch_runner import TorchRunner, package_forward
from capsnet.models.checkpoint import load_checkpoint

AOTI_MAX_BATCH = 16  # the aoti_model_dir fixture's --max-batch


def _export_error(args: list[str], capsys) -> str:
    code = main(["export", *args])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("capsnet export: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def test_the_package_is_described_in_model_json(aoti_model_dir):
    sidecar = json.loads((aoti_model_dir / "model.json").read_text())
    (package,) = sidecar["aoti"]
    assert package["file"] == "model.cpu.fp32.pt2" and package["device"] == "cpu" and package["precision"] == "fp32"
    assert package["torch_version"] == torch.__version__ and package["compute_capability"] is None
    assert (package["min_batch"], package["max_batch"]) == (1, AOTI_MAX_BATCH)
    assert package["built_on"] == CpuKind.this_host().describe()
    assert sidecar["sha256"]["model.cpu.fp32.pt2"] == file_sha256(aoti_model_dir / "model.cpu.fp32.pt2")
    parity = package["parity"]
    assert parity["reference"] == "pytorch" and parity["batch_sizes"] == [1, 7]  # 64 is past the package's range
    assert parity["argmax_agreement"] == 1.0 and max(parity["max_abs_diff"].values()) <= 1e-4
    assert ModelDescription.read(aoti_model_dir).aoti[0].max_batch == AOTI_MAX_BATCH


def test_the_package_computes_what_pytorch_computes_at_every_batch_size(aoti_model_dir):
    model = load_checkpoint(aoti_model_dir / "model.ckpt").build_model().eval()
    cpu = torch.device("cpu")
    runner = TorchRunner(package_forward(aoti_model_dir / "model.cpu.fp32.pt2", cpu), cpu, (1, 28, 28),
                         {"probabilities": (10,), "poses": (10, 16), "reconstruction": (784,)}, AOTI_MAX_BATCH)
    rng = np.random.default_rng(3)
    for batch in (1, 2, 5, AOTI_MAX_BATCH):  # a dynamic batch axis, not one specialised size
        images = rng.random((batch, 1, 28, 28), dtype=np.float32)
        got = runner.run(images)
        with torch.inference_mode():
            expected = model(torch.from_numpy(images))
        for name in ("probabilities", "poses", "reconstruction"):
            assert got[name].shape[0] == batch and np.abs(got[name] - getattr(expected, name).numpy()).max() <= 1e-4
    with pytest.raises(CapsNetError, match=f"the package runs 1 to {AOTI_MAX_BATCH} images at a time, got 17"):
        runner.run(np.zeros((AOTI_MAX_BATCH + 1, 1, 28, 28), np.float32))  # the package itself would not check


def test_aoti_cuda_without_a_gpu_is_one_line_before_any_work(random_tiny_checkpoint, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    line = _export_error([str(random_tiny_checkpoint), "--out", str(tmp_path / "out"), "--aoti", "cuda"], capsys)
    assert line == (f"capsnet export: error: --aoti cuda: no CUDA GPU is visible to torch {torch.__version__} "
                    f"({'a CPU-only build' if torch.version.cuda is None else f'CUDA {torch.version.cuda}'}); export "
                    "the CUDA packages on a GPU machine")
    assert not (tmp_path / "out").exists()


def test_aoti_without_a_cpp_compiler_is_one_line(random_tiny_checkpoint, tmp_path):
    # inductor reads $CXX once, when it is imported: a process of its own, as a user's would be
    result = subprocess.run([sys.executable, "-m", "capsnet", "export", str(random_tiny_checkpoint), "--out",
                             str(tmp_path / "out"), "--aoti"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CXX": str(tmp_path / "no-such-compiler")}, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("capsnet export: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("capsnet export: error: no C++ compiler for AOTInductor")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--aoti", "tpu"], "--aoti takes cpu and/or cuda (e.g. cpu,cuda), got 'tpu'"),
    (["--aoti", ""], "--aoti takes cpu and/or cuda (e.g. cpu,cuda), got ''"),
    (["--aoti", "cuda", "--aoti-precision", "int8"],
     "--aoti-precision takes fp32, fp16, bf16 (e.g. fp32,bf16), got 'int8'"),
])
def test_aoti_options_are_checked(tmp_path, capsys, flags, message):
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), *flags], capsys)
    assert line == f"capsnet export: error: {message}"


def test_aoti_targets_are_cpu_fp32_and_cuda_in_each_precision():
    config = ExportConfig(aoti="cpu,cuda", aoti_precision="fp32,bf16,bf16")
    assert config.aoti_targets() == [("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")]
    assert ExportConfig().aoti_targets() == [] and ExportConfig(max_batch=8).optimal_batch == 8
