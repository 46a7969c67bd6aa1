"""FP16 variant of the ONNX graph for GPU execution providers and strongly typed TensorRT.

Every float32 weight, constant, cast and intermediate tensor becomes float16; the input and
outputs stay float32 behind Cast nodes at the graph's edges, so clients and the server's input
handling are the same for every variant. Our graph has no op whose float16 form needs care
(no Range/Resize/TopK-style shape inputs in float), which is what makes this short pass enough.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT16_MAX = float(np.finfo(np.float16).max)


def _to_float16(tensor: onnx.TensorProto) -> onnx.TensorProto:
    values = np.clip(numpy_helper.to_array(tensor), -FLOAT16_MAX, FLOAT16_MAX)  # inf would poison every sum
    return numpy_helper.from_array(values.astype(np.float16), tensor.name)


def _rename_inputs(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of `model` (float32 input and outputs)."""
    fp16 = onnx.ModelProto()
    fp16.CopyFrom(model)
    graph = fp16.graph

    for index, initializer in enumerate(graph.initializer):
        if initializer.data_type == TensorProto.FLOAT:
            graph.initializer[index].CopyFrom(_to_float16(initializer))
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.FLOAT16
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                attribute.t.CopyFrom(_to_float16(attribute.t))
    for value in graph.value_info:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16

    # Edges: the float32 input is cast once, each float16 result is cast back once.
    edge_casts = []
    for graph_input in graph.input:
        internal = f"{graph_input.name}_fp16"
        _rename_inputs(graph, graph_input.name, internal)
        edge_casts.append(helper.make_node("Cast", [graph_input.name], [internal], to=TensorProto.FLOAT16))
    for graph_output in graph.output:
        internal = f"{graph_output.name}_fp16"
        _rename_inputs(graph, graph_output.name, internal)  # e.g. probabilities are read from poses
        for node in graph.node:
            node.output[:] = [internal if name == graph_output.name else name for name in node.output]
        edge_casts.append(helper.make_node("Cast", [internal], [graph_output.name], to=TensorProto.FLOAT))
    inputs_cast = len(graph.input)
    nodes = [*edge_casts[:inputs_cast], *graph.node, *edge_casts[inputs_cast:]]  # keep topological order
    del graph.node[:]
    graph.node.extend(nodes)
    return fp16
