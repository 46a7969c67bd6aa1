"""FP16: float16 inside, float32 at the edges. Without a GPU, ONNX Runtime's CPU kernels run it."""

from __future__ import annotations

import numpy as np
import onnx

from capsnet.export.onnx_export import check_graph
from capsnet.export.parity import onnxruntime_session
from capsnet.training.data import to_float


def test_export_fp16_is_float16_inside_with_float32_edges(tiny_export):
    model = onnx.load(str(tiny_export.out / "model.fp16.onnx"))
    check_graph(model)
    float_types = {init.data_type for init in model.graph.initializer} & {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    assert float_types == {onnx.TensorProto.FLOAT16}
    edges = [*model.graph.input, *model.graph.output]
    assert all(value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for value in edges)
    casts = [node for node in model.graph.node if node.op_type == "Cast"]
    assert {cast.attribute[0].i for cast in casts} == {onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT}
    assert len(casts) == 1 + 3 + 1  # input, three outputs, and the decoder mask's own cast to float16


def test_export_fp16_runs_and_agrees_with_fp32(tiny_export, embedded):
    images = to_float(embedded.test.images[7::15][:64]).numpy()  # (64, 1, 28, 28): every class
    fp32 = onnxruntime_session(str(tiny_export.out / "model.onnx")).run(None, {"images": images})
    fp16 = onnxruntime_session(str(tiny_export.out / "model.fp16.onnx")).run(None, {"images": images})
    assert [output.dtype for output in fp16] == [np.float32] * 3
    # measured 2.5e-4 on probabilities for the trained tiny model
    assert np.abs(fp16[0] - fp32[0]).max() <= 1e-2
    assert (fp16[0].argmax(1) == fp32[0].argmax(1)).mean() >= 0.98
