"""FP16 variant of the ONNX graph for GPU execution providers and strongly typed TensorRT.

ONNX Runtime's float16 converter (onnxruntime.transformers.float16) turns weights and activations
into float16, keeps the input and outputs float32 (`keep_io_types`, so clients and the server's
input handling are the same for every variant), and leaves the ops in FP32_OPS in float32 behind
Cast nodes: squash and the capsule lengths (sums of squares, square roots, divisions) and the
routing softmax, which the model computes in float32 for the same reason it guards its norms.
The export keeps the result only where the precision gate accepts it (capsnet/model_description/precision_gate.py:
the test split's accuracy, and every output's max |diff| against FP32 within GATE_MAX_DIFF["fp16"]).
"""

from __future__ import annotations

import onnx

from capsnet.export.logs import quiet

# squash: ReduceL2 or ReduceSum(s²) -> Sqrt -> Div; capsule lengths: ReduceL2; routing: Softmax
FP32_OPS = ("ReduceSum", "ReduceL2", "Sqrt", "Div", "Pow", "Softmax")


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of `model` (float32 input and outputs, FP32_OPS in float32)."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the converter changes the model it is given
    with quiet("onnxruntime.transformers"):
        fp16 = OnnxModel(convert_float_to_float16(copy, keep_io_types=True,
                                                  op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS]))
        fp16.topological_sort()  # the converter appends its edge casts after their consumers
    _retype_value_info(fp16.model)
    return fp16.model


def _retype_value_info(model: onnx.ModelProto) -> None:
    """Correct the element types the converter leaves stale on intermediate tensors, keeping their shapes
    (the exporter's symbolic batch expressions such as 144*batch, which shape inference cannot redo)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.graph.value_info[:]
    types = {value.name: value.type.tensor_type.elem_type
             for value in onnx.shape_inference.infer_shapes(bare).graph.value_info}
    types.update({initializer.name: initializer.data_type for initializer in model.graph.initializer})
    for value in model.graph.value_info:
        if value.name in types:
            value.type.tensor_type.elem_type = types[value.name]
