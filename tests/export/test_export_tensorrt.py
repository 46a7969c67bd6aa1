"""TensorRT: without a GPU or the package, --tensorrt fails in one line after writing everything else;
with them (GPU tests), engines of each precision are built, described and checked against ONNX Runtime."""

from __future__ import annotations

import json

import pytest

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.export.config import EngineConfig
from capsnet.export.tensorrt_build import PARITY_TOLERANCE, source_variant, tensorrt_unavailable

PLAN_INFO_KEYS = {"tensorrt_version", "gpu_name", "compute_capability", "precision", "min_batch", "opt_batch", "max_batch"}


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


@pytest.mark.skipif(tensorrt_unavailable() is None, reason="TensorRT and a GPU are here: the GPU tests cover it")
def test_export_tensorrt_unavailable_fails_in_one_line_after_the_other_artifacts(random_tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.json").write_text("{}")  # a previous export, which is replaced
    (out / "stale.onnx").write_text("old")
    code = main(["export", str(random_tiny_checkpoint), "--out", str(out), "--tensorrt"])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("capsnet export: error:")]
    assert code == 2 and "Traceback" not in stderr
    assert len(errors) == 1 and tensorrt_unavailable() in errors[0]
    assert sorted(path.name for path in out.iterdir()) == ["model.ckpt", "model.json", "model.onnx", "reference.npz"]
    assert json.loads((out / "model.json").read_text())["artifacts"]["tensorrt"] is None
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no staging or previous copy left


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_unavailable() is not None, reason=f"{tensorrt_unavailable()}")
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_export_tensorrt_engine(trained_tiny_checkpoint, tmp_path, precision):
    out, cache = tmp_path / "model", tmp_path / "timing.cache"
    code = main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--tensorrt", "--tensorrt-precision", precision,
                 "--min-batch", "1", "--opt-batch", "8", "--max-batch", "32", "--timing-cache", str(cache),
                 "--triton", str(tmp_path / "triton")])
    assert code == 0
    sidecar = json.loads((out / "model.json").read_text())
    assert sidecar["artifacts"]["tensorrt"] == "model.plan" and (out / "model.plan").stat().st_size > 0
    info = json.loads((out / "model.plan.json").read_text())
    assert set(info) == PLAN_INFO_KEYS
    assert (info["precision"], info["min_batch"], info["opt_batch"], info["max_batch"]) == (precision, 1, 8, 32)
    engine = sidecar["parity"]["tensorrt"]
    assert engine["batch_sizes"] == [1, 8, 32] and engine["images"] == 41
    assert max(engine["max_abs_diff"].values()) <= PARITY_TOLERANCE[precision]
    assert cache.stat().st_size > 0  # written for the next build to reuse
    assert (tmp_path / "triton" / "capsnet" / "1" / "model.plan").read_bytes() == (out / "model.plan").read_bytes()
