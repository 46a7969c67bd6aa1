"""INT8: QDQ on the convolutions only, accuracy measured and stored in the precision gate, refused when it drops
too far (the export is then written without it, and names it)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.export.cli import EXIT_REFUSED
from capsnet.export.parity import onnxruntime_probabilities, onnxruntime_session
from capsnet.export.precision import accuracy_change_points
from capsnet.model_description.schema import ModelDescription
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import create_backend


def test_export_int8_quantises_only_the_convolutions_symmetrically(tiny_export):
    model = onnx.load(str(tiny_export.out / "model.int8.onnx"))
    producers = {output: node.op_type for node in model.graph.node for output in node.output}
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    dequantized = {node.output[0] for node in model.graph.node if node.op_type == "DequantizeLinear"}
    # int8 tensors: the convolutions' inputs, weights and outputs, read back by the Relu and Reshape after them
    assert {node.op_type for node in model.graph.node if dequantized & set(node.input)} == {"Conv", "Relu", "Reshape"}
    quantized = {producers.get(node.input[0], "graph input") for node in model.graph.node
                 if node.op_type == "QuantizeLinear"}
    assert quantized == {"graph input", "Conv", "Relu"}  # never squash, routing or the decoder
    for conv in (node for node in model.graph.node if node.op_type == "Conv"):
        assert producers[conv.input[0]] == producers[conv.input[1]] == "DequantizeLinear"
    weight_scales = [initializers[node.input[1]] for node in model.graph.node
                     if node.op_type == "DequantizeLinear" and node.input[0].endswith("weight_quantized")]
    assert [scale.shape for scale in weight_scales] == [(16,), (16,)]  # per output channel
    weights = [initializers[name] for name in initializers if name.endswith("weight_quantized")]
    # 7-bit weights (reduce_range): AVX2's VPMADDUBSW sums pairs of products in 16 bits, which full-range
    # weights saturate; 2 x 255 x 64 fits
    assert weights and all(w.dtype == np.int8 and np.abs(w.astype(int)).max() <= 64 for w in weights)
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            assert not initializers[node.input[2]].any()  # zero point 0: what TensorRT accepts
        if node.op_type == "QuantizeLinear":
            assert initializers[node.input[2]].dtype == np.int8


def test_export_int8_accuracy_is_measured_on_the_test_split(tiny_export, embedded):
    gate = tiny_export.sidecar["precision_gate"]["variants"]["onnx_int8"]
    test = embedded.test

    def accuracy(name: str) -> float:
        probabilities = onnxruntime_probabilities(onnxruntime_session(str(tiny_export.out / name)), test.images)
        return float((probabilities.argmax(1) == test.labels).mean())

    accuracy_fp32, accuracy_int8 = accuracy("model.onnx"), accuracy("model.int8.onnx")
    assert accuracy_fp32 > 0.5  # the trained model, so a drop would show
    assert gate["accuracy_fp32"] == accuracy_fp32 and gate["accuracy"] == accuracy_int8
    assert abs(gate["accuracy_change_points"] - 100 * (accuracy_int8 - accuracy_fp32)) < 1e-3
    assert gate["test_images"] == len(test) and gate["precision"] == "int8"
    assert tiny_export.sidecar["int8"]["calibration_images"] == 200


def test_a_refused_int8_variant_costs_nothing_of_the_fp32_export_and_is_named(trained_tiny_checkpoint, embedded,
                                                                               idx_dataset, tmp_path, capsys):
    # Calibrating on black images gives activation ranges far too narrow for real digits.
    data = idx_dataset(np.zeros((64, 28, 28)), np.arange(64) % 10, embedded.test.images[:, 0], embedded.test.labels,
                       name="black-calibration")
    out = tmp_path / "model"
    code = main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--int8", "--data", str(data)])
    captured = capsys.readouterr()
    assert code == EXIT_REFUSED and "Traceback" not in captured.err
    # stdout is export's summary alone: ONNX Runtime's percentile calibrator prints its progress there
    assert captured.out.startswith(f"wrote {out}: ") and "histogram" not in captured.out
    description = ModelDescription.read(out)
    gate = description.precision_gate["onnx_int8"]
    # the measured drop, beyond the default --max-accuracy-drop of 1
    assert not gate.accepted and gate.max_drop_points == 1 and gate.accuracy_change_points < -1
    assert description.refused == {"model.int8.onnx": f"INT8 model refused: {gate.refusal()}"}
    assert "--max-accuracy-drop 1" in description.refused["model.int8.onnx"]
    [line] = [line for line in captured.err.splitlines() if line.startswith("capsnet export:")]
    assert line == f"capsnet export: not written: model.int8.onnx: {description.refused['model.int8.onnx']}"
    # FP32 is written whole and served: the refused file is neither there nor listed
    assert description.artifacts["onnx_int8"] is None and not (out / "model.int8.onnx").exists()
    assert description.int8 is not None and description.int8["calibration_images"] == 64  # how the refused one was made
    artifacts = load_artifacts(out)  # as the server reads it
    assert list(artifacts.onnx) == ["fp32"] and artifacts.refused == description.refused
    # asked for INT8, the server says why there is none instead of advising an export with --int8
    refusal = r"the export did not write model\.int8\.onnx: INT8 model refused: "
    with pytest.raises(CapsNetError, match=refusal) as caught:
        create_backend("onnxruntime", "int8", artifacts, ServerConfig(model_dir=out, backend="onnxruntime",
                                                                      precision="int8"))
    assert "export it with" not in str(caught.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["black-calibration", "model"]  # no staging left


def test_export_int8_gate_takes_a_drop_of_exactly_the_limit():
    # 100 * (0.823 - 0.833) is -1.0000000000000009: --max-accuracy-drop 1 refused a drop of exactly 1 point
    for correct_fp32 in range(0, 1001, 7):  # accuracies over 1,000 test images, as export measures them
        for lost in range(min(correct_fp32, 50) + 1):
            assert accuracy_change_points(correct_fp32 / 1000, (correct_fp32 - lost) / 1000) == -lost / 10
