"""ONNX Runtime's profile of exported models, several interleaved, and its command line."""

from __future__ import annotations

import numpy as np
import pytest

from capsnet.bench.analysis.ortprofile import main, profile_interleaved


def test_bench_profile_interleaved_gives_each_model_its_own_op_types(tiny_export):
    images = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
    fp32, int8 = profile_interleaved([tiny_export / "model.onnx", tiny_export / "model.int8.onnx"], images,
                                     threads=1, runs=3)
    assert (fp32["onnx"], int8["onnx"]) == ("model.onnx", "model.int8.onnx")
    for profile in (fp32, int8):
        assert profile["batch_size"] == 4 and profile["runs"] == 3
        assert sum(op["share"] for op in profile["op_types"]) == pytest.approx(1.0)
        assert profile["ms_per_run"] == pytest.approx(sum(op["ms_per_run"] for op in profile["op_types"]))
        shares = [op["share"] for op in profile["op_types"]]
        assert shares == sorted(shares, reverse=True)
    assert "QLinearConv" in {op["op_type"] for op in int8["op_types"]}
    assert "QLinearConv" not in {op["op_type"] for op in fp32["op_types"]}


def test_bench_profile_command_line(tiny_export, capsys, tmp_path):
    assert main([str(tiny_export / "model.onnx"), "--batch", "2", "--runs", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model.onnx: batch 2, median of 2 runs") and "convolutions" in out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing.onnx")])
    assert exit_info.value.code == 2
    assert "missing.onnx does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--batch", "0"], "--batch and --threads must be from 1 to 1024, --runs at least 1"),  # profiled empty runs
    (["--runs", "0"], "--batch and --threads must be from 1 to 1024, --runs at least 1"),  # printed the warm-up
    (["--threads", "0"], "--batch and --threads must be from 1 to 1024, --runs at least 1"),
])
def test_bench_profile_command_line_refuses_empty_settings(tiny_export, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tiny_export / "model.onnx"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_profile_command_line_refuses_a_file_that_is_not_onnx(tmp_path, capsys):
    (tmp_path / "model.ckpt").write_bytes(b"not a model")
    with pytest.raises(SystemExit) as exit_info:  # was an onnxruntime InvalidProtobuf traceback
        main([str(tmp_path / "model.ckpt")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "model.ckpt is not an ONNX model ONNX Runtime can load: " in err.strip().splitlines()[-1]  # after the usage
