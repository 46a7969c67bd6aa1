"""The no-GPU TensorRT check: parser-supported operators, static shapes but the batch, symmetric Q/DQ."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from capsnet.export.tensorrt_ops import TENSORRT_SUPPORTED_OPS, tensorrt_problems


def _model(nodes, inputs, outputs, initializers=(), opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _tensor(name, shape, elem_type=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem_type, shape)


@pytest.mark.parametrize("name", ["model.onnx", "model.int8.onnx", "model.fp16.onnx"])
def test_export_exported_graphs_pass_the_tensorrt_check(tiny_export, name):
    assert tensorrt_problems(onnx.load(str(tiny_export.out / name))) == []


def test_export_tensorrt_check_accepts_a_batch_only_dynamic_graph():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_tensor("x", ["batch", 3, 8])],
                   [_tensor("y", ["batch", 3, 8])])
    assert tensorrt_problems(model) == []


def test_export_tensorrt_check_reports_an_unsupported_operator():
    assert "Det" not in TENSORRT_SUPPORTED_OPS
    model = _model([helper.make_node("Det", ["x"], ["y"])], [_tensor("x", ["batch", 3, 3])], [_tensor("y", ["batch"])])
    (problem,) = tensorrt_problems(model)
    assert "does not support: Det" in problem


def test_export_tensorrt_check_reports_a_custom_domain_operator():
    node = helper.make_node("FusedCapsules", ["x"], ["y"], domain="com.example")
    model = _model([node], [_tensor("x", ["batch", 4])], [_tensor("y", ["batch", 4])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    assert any("com.example::FusedCapsules" in problem for problem in tensorrt_problems(model))


def test_export_tensorrt_check_reports_a_dynamic_dimension_besides_the_batch():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_tensor("x", ["batch", "height", 28])],
                   [_tensor("y", ["batch", "height", 28])])
    (problem,) = tensorrt_problems(model)
    assert "dynamic dimension not computed from the batch size alone" in problem and "height" in problem


def test_export_tensorrt_check_accepts_dims_computed_from_the_batch():
    # EM routing's vote MatMul folds the batch into its rows: (36, 144*batch, 4)
    model = _model([helper.make_node("Relu", ["votes"], ["y"])],
                   [_tensor("images", ["batch", 1, 28, 28]), _tensor("votes", [36, "144*batch", 4])],
                   [_tensor("y", [36, "144*batch", 4])])
    assert tensorrt_problems(model) == []
    model.graph.input[1].type.tensor_type.shape.dim[1].dim_param = "144*rows"
    assert len(tensorrt_problems(model)) == 1


def test_export_tensorrt_check_reports_asymmetric_quantisation():
    scale = numpy_helper.from_array(np.array(0.1, dtype=np.float32), "scale")
    zero_point = numpy_helper.from_array(np.array(128, dtype=np.uint8), "zero_point")
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero_point"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "scale", "zero_point"], ["y"])]
    model = _model(nodes, [_tensor("x", ["batch", 4])], [_tensor("y", ["batch", 4])], [scale, zero_point])
    problems = tensorrt_problems(model)
    assert len(problems) == 2 and all("zero point" in problem for problem in problems)


def test_export_tensorrt_check_reports_computed_reduction_axes_and_opset():
    nodes = [helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
             helper.make_node("ReduceSum", ["x", "shape"], ["y"])]
    model = _model(nodes, [_tensor("x", ["batch", 1, 4])], [_tensor("y", ["batch", 1, 4])], opset=25)
    problems = tensorrt_problems(model)
    assert any("axes from a computed tensor" in problem for problem in problems)
    assert any("opset 25" in problem for problem in problems)
