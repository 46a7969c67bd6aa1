"""Will TensorRT's ONNX parser take this graph? A check that needs no GPU and no TensorRT.

The operator list and restrictions are those of onnx-tensorrt's docs/operators.md for TensorRT
10.15 (parser opsets 9-24): the operators marked supported ("Y"). TensorRT 11 parses the same
operators. Besides the operators, the check wants every tensor's dims static or computed from the
batch size alone, such as 144*batch where a layer folds the batch into its rows (one engine profile
then covers every request), Q/DQ zero points of 0 (TensorRT's explicit
quantisation is symmetric) and constant `axes` for reductions.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import numpy_helper

from capsnet.export.onnx_export import graph_opset

TENSORRT_OPERATORS_SOURCE = "onnx-tensorrt docs/operators.md, TensorRT 10.15"
TENSORRT_OPSETS = range(9, 25)
TENSORRT_SUPPORTED_OPS = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool
    BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape
    Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum
    Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm
    GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
    GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If
    ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
    LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence
    RMSNormalization RNN RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements
    ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign
    SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter ThresholdedRelu Tile TopK
    Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})  # zero point: their third input


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """A tensor's dims: ints where static, the symbol's name where symbolic, None where unknown."""
    return [
        dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None)
        for dim in value.type.tensor_type.shape.dim
    ]


def _from_batch_only(dim: str, batch_symbol: int | str | None) -> bool:
    """A symbolic dim such as "batch" or "144*batch": every name in it is the batch axis's."""
    return all(name == batch_symbol for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim))


def tensorrt_problems(model: onnx.ModelProto) -> list[str]:
    """Everything in `model` that TensorRT's ONNX parser or a batch-only profile would reject."""
    problems = []
    opset = graph_opset(model)
    if opset not in TENSORRT_OPSETS:
        problems.append(f"opset {opset} is outside TensorRT's {TENSORRT_OPSETS.start}-{TENSORRT_OPSETS.stop - 1}")

    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    unsupported = sorted(
        {f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
         for node in graph.node
         if node.domain not in ("", "ai.onnx") or node.op_type not in TENSORRT_SUPPORTED_OPS}
    )
    if unsupported:
        problems.append(f"operators TensorRT's ONNX parser does not support: {', '.join(unsupported)} "
                        f"(per {TENSORRT_OPERATORS_SOURCE})")
    for node in graph.node:
        if node.op_type in QDQ_OPS and len(node.input) > 2 and node.input[2]:
            zero_point = constants.get(node.input[2])
            if zero_point is None or np.any(zero_point != 0):
                problems.append(f"{node.op_type} {node.name!r} has a zero point that is not a constant 0")
        if node.op_type.startswith("Reduce") and len(node.input) > 1 and node.input[1] not in constants:
            problems.append(f"{node.op_type} {node.name!r} takes its axes from a computed tensor")

    inferred = onnx.shape_inference.infer_shapes(model)
    batch_symbol = _dims(graph.input[0])[0] if graph.input else None
    dynamic = [
        f"{value.name} {_dims(value)}"
        for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        if value.type.HasField("tensor_type")
        and (
            not value.type.tensor_type.HasField("shape")
            or any(dim is None or (isinstance(dim, str) and not _from_batch_only(dim, batch_symbol))
                   for dim in _dims(value))
        )
    ]
    if dynamic:
        problems.append(f"{len(dynamic)} tensors have a dynamic dimension not computed from the batch size alone, "
                        f"e.g. {dynamic[0]}")
    return problems
