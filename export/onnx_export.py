"""PyTorch → ONNX: the CapsNet as one straight-line graph with a dynamic batch axis, and for a model of any
size (capsnet/models/any_size.py) a free height and width over the sizes it takes.

The model's routing is already a fixed number of plain tensor ops, so the exported graph has no
Loop/If/Scan; `check_graph` proves that, and that every other dimension is static.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import onnx

from capsnet.errors import CapsNetError, first_line
from capsnet.export.config import check_opset
from capsnet.export.logs import quiet
from capsnet.model_description.schema import INPUT_NAME

BATCH_DIM = "batch"
HEIGHT_DIM, WIDTH_DIM = "height", "width"  # free in the graph of a model of any size
CONTROL_FLOW_OPS = frozenset({"Loop", "If", "Scan"})


def graph_opset(model: onnx.ModelProto) -> int:
    """The opset of the default ONNX domain that the model really declares."""
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def export_program(model, names: tuple[str, ...], max_batch: int | None = None):
    """`model` (a CapsNet in eval mode) as a torch.export program of the outputs `names` (those the graph declares,
    metadata.output_shapes), its batch axis dynamic from 1 to `max_batch` (None: no bound). The ONNX file and the
    AOTInductor packages are made from it."""
    import torch

    config = model.config

    class InferenceOutputs(torch.nn.Module):
        """Only the outputs the graph declares; the decoder is masked by the predicted class."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, images):
            outputs = self.model(images)
            return tuple(getattr(outputs, name) for name in names)

    # Batch 2, not 1: the exporter would specialise a size-1 axis to a constant.
    example = torch.rand(2, config.in_channels, config.height, config.width)  # (2, C, H, W)
    dims = {0: torch.export.Dim(BATCH_DIM, min=1, **({} if max_batch is None else {"max": max_batch}))}
    sizes = config.input_sizes
    if not sizes.fixed:  # a model of any size: height and width stay symbolic over the sizes it takes
        dims[2] = torch.export.Dim(HEIGHT_DIM, min=sizes.min_height, max=sizes.max_height)
        dims[3] = torch.export.Dim(WIDTH_DIM, min=sizes.min_width, max=sizes.max_width)
    # A model of any size is traced size-obliviously, as torch.onnx.export traces a module: a reshape's choice
    # between a view and a copy otherwise guards that the backbone grid is not one position, which the smallest
    # valid image gives. What torch still cannot prove of a symbolic size becomes an assertion in the program rather
    # than a guard on the traced example: torch 2.11 cannot prove that an average pool's floor division needs no
    # rounding, and refused every odd height and width (the ONNX graph drops such assertions; export's parity checks
    # an odd size). The fixed-size models are traced as they always were (there it adds a batch guard).
    with quiet("torch.export", "torch._dynamo"), torch.fx.experimental._config.patch(  # type: ignore[attr-defined]
            backed_size_oblivious=not sizes.fixed):  # (torch adds patch() to its config modules at import time)
        return torch.export.export(InferenceOutputs().eval(), (example,), dynamic_shapes={INPUT_NAME: dims},
                                   prefer_deferred_runtime_asserts_over_guards=not sizes.fixed)


def export_onnx(program, path: Path, opset: int, names: tuple[str, ...]) -> onnx.ModelProto:
    """Write the exported program (export_program) of the outputs `names` to `path` and return the checked ONNX
    model."""
    import torch

    check_opset(opset)
    # torch warns about optional torchvision ops; onnxscript and onnx_ir narrate their passes
    with quiet("torch.onnx", "onnxscript", "onnx_ir"):
        torch.onnx.export(
            program,
            (),
            str(path),
            input_names=[INPUT_NAME],
            output_names=list(names),
            opset_version=opset,
            dynamo=True,
            external_data=False,  # one self-contained file; the paper model is 33 MB
            verbose=False,
        )
    exported = onnx.load(str(path))
    if _name_input_axes(exported):
        onnx.save(exported, str(path))
    written = graph_opset(exported)
    if written != opset:
        raise CapsNetError(f"asked for ONNX opset {opset} but the PyTorch exporter wrote opset {written}")
    check_graph(exported)
    return exported


def _name_input_axes(model: onnx.ModelProto) -> bool:
    """Name the batch axis BATCH_DIM, and a free height and width HEIGHT_DIM and WIDTH_DIM, wherever they appear
    (inputs, outputs, intermediate shapes such as 144*s34): the exported program calls them by generated symbols.
    Returns whether anything was renamed."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    names = {dims[index].dim_param: name for index, name in ((0, BATCH_DIM), (2, HEIGHT_DIM), (3, WIDTH_DIM))
             if dims[index].dim_param and dims[index].dim_param != name}
    if not names:
        return False
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda match: names[match.group(1)], dim.dim_param)
    return True


def check_graph(model: onnx.ModelProto) -> None:
    """ONNX's full check and shape inference, no control flow, and static shapes but the batch."""
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise CapsNetError(f"the exported ONNX graph is invalid: {first_line(err)}") from None
    control_flow = sorted(CONTROL_FLOW_OPS & set(op_counts(model)))
    if control_flow:
        raise CapsNetError(f"the exported ONNX graph has control flow ({', '.join(control_flow)}); routing must be "
                           "unrolled")
    # a model of any size takes a free height and width; every output's shape follows from the batch alone
    takes_free = {2: HEIGHT_DIM, 3: WIDTH_DIM}
    for value, free in [*((value, takes_free) for value in model.graph.input),
                        *((value, {}) for value in model.graph.output)]:
        dims = value.type.tensor_type.shape.dim
        if not dims or any(not dim.HasField("dim_value") and dim.dim_param != free.get(index)
                           for index, dim in enumerate(dims[1:], start=1)):
            raise CapsNetError(f"the exported ONNX graph's {value.name!r} has a dynamic dimension besides the batch"
                               f"{' and a free height and width' if free else ''}")
