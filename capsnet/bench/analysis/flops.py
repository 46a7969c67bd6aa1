"""FLOPs per image, counted from an exported ONNX graph's shapes (nothing typed in).

The batch axis is fixed to 1 and ONNX shape inference gives every tensor's shape; then each
Conv, MatMul, Gemm and two-operand Einsum counts 2 FLOPs per multiply-accumulate.
Elementwise ops and reductions (squash, softmax, the routing sums) are not counted: for CapsNet
they are well under 1% of the total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper, shape_inference

from capsnet.errors import CapsNetError, first_line


@dataclass(frozen=True)
class NodeFlops:
    name: str
    op_type: str
    flops: int  # per image


@dataclass(frozen=True)
class FlopCount:
    nodes: tuple[NodeFlops, ...]  # counted nodes, in graph order

    @property
    def total(self) -> int:
        return sum(node.flops for node in self.nodes)

    def largest(self) -> NodeFlops:
        return max(self.nodes, key=lambda node: node.flops)

    def to_dict(self) -> dict:
        return {
            "flops_per_image": self.total,
            "nodes": [
                {"name": n.name, "op_type": n.op_type, "flops": n.flops, "share": n.flops / self.total}
                for n in self.nodes
            ],
        }


def count_flops(onnx_path: str | Path) -> FlopCount:
    model = onnx.load(str(onnx_path))
    for value in list(model.graph.input) + list(model.graph.output):
        batch_dim = value.type.tensor_type.shape.dim[0]
        batch_dim.Clear()
        batch_dim.dim_value = 1
    try:
        model = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as err:
        raise CapsNetError(f"{onnx_path}: ONNX shape inference failed: {first_line(err)}") from None
    shapes = _static_shapes(model.graph)
    nodes = []
    for node in model.graph.node:
        counter = _COUNTERS.get(node.op_type)
        if counter is None:
            continue
        try:
            flops = counter(node, shapes)
        except KeyError as err:
            raise CapsNetError(f"{onnx_path}: no static shape for {err.args[0]!r} (input of {node.op_type} "
                               f"{node.name!r})") from None
        nodes.append(NodeFlops(node.name or node.output[0], node.op_type, flops))
    if not nodes:
        raise CapsNetError(f"{onnx_path}: no Conv, MatMul, Gemm or Einsum node to count")
    return FlopCount(tuple(nodes))


def _static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    shapes = {init.name: tuple(init.dims) for init in graph.initializer}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    for node in graph.node:  # Constant nodes carry shapes in their value attribute
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = tuple(numpy_helper.to_array(node.attribute[0].t).shape)
    return shapes


def _attribute(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _conv(node: onnx.NodeProto, shapes) -> int:
    out_shape = shapes[node.output[0]]  # (N, M, *spatial)
    weight_shape = shapes[node.input[1]]  # (M, C/group, *kernel)
    return 2 * math.prod(out_shape) * math.prod(weight_shape[1:])


def _matmul(node: onnx.NodeProto, shapes) -> int:
    a = shapes[node.input[0]]
    inner = a[-1] if len(a) > 1 else a[0]
    return 2 * math.prod(shapes[node.output[0]]) * inner


def _gemm(node: onnx.NodeProto, shapes) -> int:
    a = shapes[node.input[0]]  # (M, K) or (K, M) with transA
    inner = a[0] if _attribute(node, "transA", 0) else a[1]
    return 2 * math.prod(shapes[node.output[0]]) * inner


def _einsum(node: onnx.NodeProto, shapes) -> int:
    equation = _attribute(node, "equation", b"").decode().replace(" ", "")
    operands = equation.split("->")[0].split(",")
    if len(operands) != 2 or "." in equation:
        raise CapsNetError(f"cannot count FLOPs of Einsum {equation!r}: only two operands without ellipsis")
    sizes: dict[str, int] = {}
    for letters, name in zip(operands, node.input):
        sizes.update(zip(letters, shapes[name]))
    return 2 * math.prod(sizes.values())


_COUNTERS = {"Conv": _conv, "MatMul": _matmul, "Gemm": _gemm, "Einsum": _einsum}
