"""The exported graph: valid ONNX, the declared interface, routing unrolled, and a node budget."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from capsnet.export.onnx_export import CONTROL_FLOW_OPS, export_onnx, export_program, graph_opset, op_counts
from capsnet.export.parity import onnxruntime_session
from capsnet.models.config import preset
from capsnet.models.capsnet import CapsNet


@pytest.fixture(scope="module")
def graph(tiny_export) -> onnx.ModelProto:
    return onnx.load(str(tiny_export.out / "model.onnx"))


def _dims(value: onnx.ValueInfoProto) -> list:
    return [dim.dim_value or dim.dim_param for dim in value.type.tensor_type.shape.dim]


def test_export_graph_passes_full_check_and_shape_inference(graph):
    onnx.checker.check_model(graph, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(graph, check_type=True, strict_mode=True)
    assert {value.name for value in inferred.graph.value_info} >= {"conv2d", "softmax"}


def test_export_graph_interface(graph, tiny_export):
    opset = graph_opset(graph)
    assert opset >= 17 and opset == tiny_export.sidecar["opset"]
    (images,) = graph.graph.input
    assert images.name == "images" and images.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    batch = _dims(images)[0]
    assert isinstance(batch, str) and batch  # symbolic: any batch size
    assert _dims(images) == [batch, 1, 28, 28]
    outputs = {value.name: _dims(value) for value in graph.graph.output}
    assert outputs == {"probabilities": [batch, 10], "poses": [batch, 10, 16], "reconstruction": [batch, 784]}
    assert all(value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for value in graph.graph.output)


def test_export_graph_is_small_and_straight(graph):
    counts = op_counts(graph)
    assert not CONTROL_FLOW_OPS & set(counts)
    # û for every (i, j) pair in one batched MatMul, the uniform first iteration's sum in one GEMM of u by W,
    # s = c·û in each later iteration and the agreement û·v in each but the last: 1 + 1 + 2 + 2 for 3 iterations
    assert counts["MatMul"] == 6 and counts["Einsum"] == 0
    assert counts["ReduceSum"] == 0  # no sum over û is left as an elementwise pass
    assert counts["Conv"] == 2
    assert counts["Softmax"] == 2  # 3 iterations; the first coupling is uniform, no softmax
    assert counts["Transpose"] <= 3
    assert not {"Gather", "Slice", "Split", "Concat"} & set(counts)  # no per-capsule ops
    # 52 nodes for probabilities + poses, 13 more for the masked decoder (measured): a regression shows here.
    assert sum(counts.values()) <= 65


def test_export_graph_unrolls_the_checkpoints_iteration_count(tmp_path):
    torch.manual_seed(0)
    model = CapsNet(preset("tiny", routing_iterations=5)).eval()
    names = ("probabilities", "poses")
    exported = export_onnx(export_program(model, names), tmp_path / "model.onnx", opset=18, names=names)
    counts = op_counts(exported)
    assert not CONTROL_FLOW_OPS & set(counts)
    assert counts["Softmax"] == 4  # iterations - 1
    assert counts["ReduceL2"] == 7  # squash of PrimaryCaps and of each iteration, then the lengths
    images = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    probabilities, _ = onnxruntime_session(str(tmp_path / "model.onnx")).run(None, {"images": images})
    with torch.inference_mode():
        expected = model(torch.from_numpy(images)).probabilities.numpy()
    assert np.abs(probabilities - expected).max() <= 1e-5


ARITHMETIC = ("aten.add.", "aten.sub.", "aten.mul.", "aten.div.", "aten.rsub.")


@pytest.mark.parametrize("config", [preset("tiny"), preset("em-tiny"), preset("shared-tiny"), preset("gap-cnn-tiny"),
                                    preset("tiny", arch="cnn-baseline", reconstruction_weight=0.0)],
                         ids=["capsnet", "em", "shared-capsnet", "gap-cnn", "cnn-baseline"])
def test_no_architecture_mixes_an_int_scalar_into_float_arithmetic(config):
    """torch 2.11's ONNX exporter (inside the declared torch range) promotes an int scalar of a float op to a scalar
    tensor and re-dispatches the op, which failed for EM routing's `16 * beta_u` ("Expected same OpOverload packet,
    got prim.device != aten.mul"); torch 2.13's has no such pass. So no exported graph may hold one, on any torch."""
    from capsnet.export.metadata import output_shapes
    from capsnet.models.checkpoint import create_model

    program = export_program(create_model(config).eval(), tuple(output_shapes(config, False))).run_decompositions()
    mixed = [f"{node.target}{tuple(map(str, node.args))} at "
             f"{node.meta.get('stack_trace', '').strip().splitlines()[-2:]}"
             for node in program.graph.nodes
             if node.op == "call_function" and str(node.target).startswith(ARITHMETIC)
             and any(type(arg) is int for arg in node.args)
             and any(isinstance(arg, torch.fx.Node) and arg.meta["val"].is_floating_point() for arg in node.args)]
    assert mixed == []
