"""FLOPs counted from ONNX graphs: the exported CapsNet against its config, and hand-made Gemm/Einsum graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from capsnet.bench.analysis.flops import count_flops
from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import load_checkpoint


def test_bench_flops_of_exported_capsnet_match_its_config(tiny_export):
    config = load_checkpoint(tiny_export / "model.ckpt").config
    after_conv1 = config.height - config.conv1_kernel + 1
    grid_h, grid_w = config.primary_grid
    conv1 = 2 * config.conv1_channels * after_conv1 * after_conv1 * config.in_channels * config.conv1_kernel**2
    primary = (2 * config.primary_caps_channels * config.primary_caps_dim * grid_h * grid_w
               * config.conv1_channels * config.primary_caps_kernel**2)
    predictions = 2 * config.num_primary_caps * config.primary_caps_dim * config.num_classes * config.digit_caps_dim
    uniform_sum = predictions  # Σ_i û as one GEMM of u (B, I*P) by W (I*P, J*D)
    # s = c·û in each iteration after the first, the agreement û·v in each but the last
    routing = ([2 * config.num_classes * config.num_primary_caps * config.digit_caps_dim] * 2
               * (config.routing_iterations - 1))

    count = count_flops(tiny_export / "model.onnx")

    assert sorted(node.flops for node in count.nodes) == sorted([conv1, primary, predictions, uniform_sum, *routing])
    assert count.total == conv1 + primary + predictions + uniform_sum + sum(routing)
    assert count.largest().flops == max(conv1, primary)
    assert sum(node["share"] for node in count.to_dict()["nodes"]) == pytest.approx(1.0)


def _save(tmp_path, nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    return path


def test_bench_flops_gemm_and_einsum_with_a_dynamic_batch(tmp_path):
    weight = numpy_helper.from_array(np.zeros((5, 7), dtype=np.float32), "w")  # Gemm with transB: (M=?, K=7) x (7, 5)
    einsum_weight = numpy_helper.from_array(np.zeros((1, 5, 4), dtype=np.float32), "e")
    path = _save(
        tmp_path,
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1),
         helper.make_node("Reshape", ["y", "shape"], ["y3"]),
         helper.make_node("Einsum", ["y3", "e"], ["z"], equation="bik,ikj->bij")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 7])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 1, 4])],
        [weight, einsum_weight, numpy_helper.from_array(np.array([-1, 1, 5], dtype=np.int64), "shape")],
    )
    count = count_flops(path)
    # per image (batch fixed to 1): Gemm (1, 7) @ (7, 5); Einsum over b=1, i=1, k=5, j=4
    assert [(n.op_type, n.flops) for n in count.nodes] == [("Gemm", 2 * 7 * 5), ("Einsum", 2 * 5 * 4)]


def test_bench_flops_of_a_graph_without_compute_is_an_error(tmp_path):
    path = _save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])])
    with pytest.raises(CapsNetError, match="no Conv, MatMul"):
        count_flops(path)
