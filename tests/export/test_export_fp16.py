"""FP16: float16 inside, float32 at the edges and in squash/norms/softmax, held to the precision gate."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from capsnet.cli import main
from capsnet.export import reduced_stage
from capsnet.export.cli import EXIT_REFUSED
from capsnet.export.fp16 import FP32_OPS
from capsnet.export.onnx_export import check_graph
from capsnet.export.parity import onnxruntime_session
from capsnet.model_description.precision_gate import GATE_MAX_DIFF
from capsnet.model_description.schema import ModelDescription
from capsnet.training.data import to_float


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    types = {value.name: value.type.tensor_type.elem_type for value in values}
    types.update({init.name: init.data_type for init in model.graph.initializer})
    return types


def test_export_fp16_is_float16_inside_with_float32_edges_and_norms(tiny_export):
    model = onnx.load(str(tiny_export.out / "model.fp16.onnx"))
    check_graph(model)
    edges = [*model.graph.input, *model.graph.output]
    assert all(value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for value in edges)
    types = _element_types(model)
    kept = [node for node in model.graph.node if node.op_type in FP32_OPS]
    assert {node.op_type for node in kept} >= {"ReduceL2", "Div", "Softmax"}  # squash, lengths, routing softmax
    # float32 in and out (their other inputs are int64 axes)
    assert all(types[name] != onnx.TensorProto.FLOAT16 for node in kept for name in [*node.input, *node.output] if name)
    assert all(types[node.output[0]] == onnx.TensorProto.FLOAT for node in kept)
    convs = [node for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
    assert convs and all(types[node.output[0]] == onnx.TensorProto.FLOAT16 for node in convs)  # the heavy work


def test_export_fp16_runs_and_agrees_with_fp32(tiny_export, embedded):
    images = to_float(embedded.test.images[7::15][:64]).numpy()  # (64, 1, 28, 28): every class
    fp32 = onnxruntime_session(str(tiny_export.out / "model.onnx")).run(None, {"images": images})
    fp16 = onnxruntime_session(str(tiny_export.out / "model.fp16.onnx")).run(None, {"images": images})
    assert [output.dtype for output in fp16] == [np.float32] * 3
    # measured 2.8e-4 on probabilities for the trained tiny model
    assert np.abs(fp16[0] - fp32[0]).max() <= GATE_MAX_DIFF["fp16"]
    assert (fp16[0].argmax(1) == fp32[0].argmax(1)).mean() >= 0.98
    gate = tiny_export.sidecar["precision_gate"]["variants"]["onnx_fp16"]
    assert 0 < gate["max_abs_diff"] <= GATE_MAX_DIFF["fp16"] and gate["argmax_agreement"] >= 0.98
    assert "onnxruntime_fp16_vs_fp32" in tiny_export.sidecar["parity"]


def test_export_refuses_a_broken_fp16_model(trained_tiny_checkpoint, tmp_path, monkeypatch, capsys):
    convert = reduced_stage.convert_fp16

    def broken(model):  # a converter bug that halves the primary capsules' weights
        fp16 = convert(model)
        for index, init in enumerate(fp16.graph.initializer):
            if "primary_caps" in init.name and init.name.endswith("weight"):
                halved = numpy_helper.from_array(numpy_helper.to_array(init) / 2, init.name)
                fp16.graph.initializer[index].CopyFrom(halved)
        return fp16

    monkeypatch.setattr(reduced_stage, "convert_fp16", broken)
    code = main(["export", str(trained_tiny_checkpoint), "--out", str(tmp_path / "model"), "--fp16"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet export:")]
    assert code == EXIT_REFUSED and len(lines) == 1, lines
    assert lines[0].startswith("capsnet export: not written: model.fp16.onnx: FP16 model refused: onnxruntime "
                               "model.fp16.onnx: max |diff| of its outputs"), lines
    description = ModelDescription.read(tmp_path / "model")  # the FP32 export, whole
    assert description.artifacts["onnx_fp16"] is None and not description.precision_gate["onnx_fp16"].accepted
    assert list(description.refused) == ["model.fp16.onnx"] and not (tmp_path / "model" / "model.fp16.onnx").exists()
