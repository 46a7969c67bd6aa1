"""The self-check before SERVING, --precision auto, and model.json's file hashes and paths, on real
`capsnet serve` runs. An INT8 file whose weights went wrong at export (its hash rewritten to match, as an
exporter bug would) must be refused at startup, or with --precision auto be replaced by FP32."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import grpc
import pytest
from serving_helpers import ServerThread, copy_export, metric, rehash, scale_int8_weights, scrape, server_config

from capsnet.cli import main
from capsnet.model_description.files import file_sha256
from capsnet.runtime.cpu import CpuKind
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc


def _serve_errors(model_dir: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    code = main(["serve", "--model", str(model_dir), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                 *flags])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]


def test_a_corrupted_int8_model_is_refused_at_startup_with_one_line(int8_model_dir, tmp_path, capsys):
    copy = copy_export(int8_model_dir, tmp_path)
    scale_int8_weights(copy, 3.0)
    code, errors = _serve_errors(copy, capsys, "--precision", "int8")
    assert code == 2 and len(errors) == 1, errors
    assert "self-check failed: int8 against the FP32 reference on 128 images" in errors[0]
    assert f"this CPU: {CpuKind.this_host().describe()}" in errors[0]


def test_precision_auto_falls_back_to_fp32_when_the_int8_self_check_fails(int8_model_dir, tmp_path, caplog):
    copy = copy_export(int8_model_dir, tmp_path)
    scale_int8_weights(copy, 3.0)
    with caplog.at_level(logging.INFO, logger="capsnet.serving"):
        server = ServerThread(server_config(copy, precision="auto"))
    try:
        spec = server.server.service.spec
        assert spec.precision == "fp32" and spec.self_check.passed
        assert "refused: onnxruntime int8: self-check failed: int8 against the FP32 reference" in spec.choice
        assert any(r.levelno == logging.WARNING and r.message.startswith("precision auto: fp32 on ")
                   for r in caplog.records)
    finally:
        server.stop()


def test_the_self_check_is_exposed_in_model_info_and_metrics(int8_model_dir):
    server = ServerThread(server_config(int8_model_dir, precision="int8"))
    try:
        with grpc.insecure_channel(server.target) as channel:
            info = capsnet_pb2_grpc.CapsNetServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        check = info.self_check
        assert info.precision == check.precision == "int8" and check.passed and check.images == 128
        assert check.argmax_agreement >= 0.99 and 0 < check.max_abs_diff["probabilities"] <= 0.1
        assert check.cpu == CpuKind.this_host().describe() and info.choice.startswith("onnxruntime")
        samples = scrape(server.metrics_url)
        assert metric(samples, "capsnet_self_check_argmax_agreement_ratio") == pytest.approx(check.argmax_agreement)
        assert metric(samples, "capsnet_self_check_max_abs_diff", output="probabilities") == pytest.approx(
            check.max_abs_diff["probabilities"])
    finally:
        server.stop()


def test_precision_auto_serves_a_checked_precision_and_says_why(int8_model_dir):
    server = ServerThread(server_config(int8_model_dir))  # auto is the default
    try:
        spec = server.server.service.spec
        assert spec.self_check.passed and spec.self_check.precision == spec.precision
        # which one wins depends on this CPU's int8 kernels; the choice says what was measured
        backend = server.server.service.backend
        assert spec.precision in ("fp32", "int8")
        assert f"{spec.precision} on {backend.name}, at batch 1/8: " in spec.choice
        other = "fp32" if spec.precision == "int8" else "int8"
        assert f"x onnxruntime {other} (" in spec.choice and " ms, " in spec.choice
    finally:
        server.stop()


def test_fp32_must_match_the_reference_exactly_enough(int8_model_dir, tmp_path, capsys):
    import numpy as np

    copy = copy_export(int8_model_dir, tmp_path)
    with np.load(copy / "reference.npz") as archive:
        reference = {name: archive[name] for name in archive.files}
    reference["poses"] = reference["poses"] + 1e-3  # FP32 outputs that another model would give
    np.savez_compressed(copy / "reference.npz", **reference)
    rehash(copy, "reference.npz")
    code, errors = _serve_errors(copy, capsys, "--precision", "fp32")
    assert code == 2 and len(errors) == 1 and "self-check failed: fp32" in errors[0] and "allowed 0.0001" in errors[0]


def test_a_file_changed_after_export_is_refused(int8_model_dir, tmp_path, capsys):
    copy = copy_export(int8_model_dir, tmp_path)
    path = copy / "model.int8.onnx"
    path.write_bytes(path.read_bytes() + b"\0")
    code, errors = _serve_errors(copy, capsys)
    assert code == 2 and len(errors) == 1 and "model.int8.onnx does not match" in errors[0] and "re-export" in errors[0]


@pytest.mark.parametrize("name", ["../outside.onnx", "/etc/hostname", "sub/../../outside.onnx"])
def test_model_json_cannot_point_outside_the_model_directory(int8_model_dir, tmp_path, capsys, name):
    copy = copy_export(int8_model_dir, tmp_path)
    shutil.copy(copy / "model.onnx", tmp_path / "outside.onnx")
    sidecar = json.loads((copy / "model.json").read_text())
    sidecar["artifacts"]["onnx"] = name
    sidecar["sha256"][name] = file_sha256(copy / "model.onnx")
    (copy / "model.json").write_text(json.dumps(sidecar))
    code, errors = _serve_errors(copy, capsys)
    assert code == 2 and len(errors) == 1 and f"artifacts.onnx {name!r} is not a file inside" in errors[0], errors


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_nan_in_any_output_fails_the_self_check(int8_model_dir, precision):
    """A NaN in the poses of the last reference batch: not the first value max() sees for FP32, and an output
    INT8 is not compared on, so both passed before."""
    import numpy as np

    from capsnet.serving.engine.artifacts import load_artifacts
    from capsnet.serving.engine.backends import create_backend
    from capsnet.serving.engine.self_check import self_check

    artifacts = load_artifacts(int8_model_dir)
    config = server_config(int8_model_dir)
    backend = create_backend("onnxruntime", precision, artifacts, config)
    run = backend.run

    def run_with_a_nan(images):
        outputs = run(images)
        outputs["poses"][-1, 0, 0] = np.nan  # (N, 10, 16)
        return outputs

    assert self_check(backend, artifacts.reference, config.max_batch_size, artifacts).passed
    backend.run = run_with_a_nan
    check = self_check(backend, artifacts.reference, config.max_batch_size, artifacts)
    assert not check.passed and check.non_finite == ("poses",)
    assert check.describe().startswith("NaN or infinity in poses; ")


def test_precision_auto_times_fp32_and_int8_taking_turns():
    """A burst of other work on the machine (CI neighbours) then slows one round of both, not the one precision
    whose runs happened to fall in it, which could flip the choice."""
    import numpy as np

    from capsnet.serving.engine.self_check import best_times

    calls = []

    class Timed:
        def __init__(self, name: str):
            self.name = name

        def run(self, images):
            calls.append(self.name)
            return {}

    times = best_times([Timed("fp32"), Timed("int8")], np.zeros((2, 1, 28, 28), np.float32), 3)
    assert calls == ["fp32", "int8"] * 3 and len(times) == 2 and all(t >= 0 for t in times)
