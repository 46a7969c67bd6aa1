"""The backend table at the bottom of the layers (capsnet/model_description/backend_table.py): what serving, export
and bench read of every engine, checked against the classes that implement each row."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from capsnet.model_description.backend_table import (BACKEND_TABLE, DECODER_BACKEND, DECODER_PRECISION, DEVICES,
                                                     GATE_FAMILIES, GATE_VARIANTS, auto_candidates, gate_variant)
from capsnet.serving.config import BACKENDS
from capsnet.serving.engine.backend_registry import backend_class


def test_the_table_imports_no_runtime():
    """Every layer reads it, so it loads nothing heavier than the standard library and the model files' names."""
    code = ("import sys, capsnet.model_description.backend_table; "
            "print(sorted({'numpy', 'torch', 'onnx', 'onnxruntime', 'openvino', 'grpc', 'tensorrt', 'triton'} "
            "& set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", BACKEND_TABLE)
def test_each_row_names_its_class_and_what_the_class_offers(name):
    """The row's name is its class's, and a row says it takes batches on its GPU exactly where the class can."""
    row = BACKEND_TABLE[name]
    if row.requires is not None and importlib.util.find_spec(row.requires) is None and name != "openvino":
        pytest.skip(f"{row.requires} is not installed: its class cannot be imported here")
    cls = backend_class(name)
    assert cls.__name__ == row.class_name
    assert getattr(cls, "name", name) == name
    assert hasattr(cls, "run_device") is row.device_input


@pytest.mark.parametrize("name", BACKEND_TABLE)
def test_auto_races_only_what_a_row_serves_and_its_gate_exists(name):
    row = BACKEND_TABLE[name]
    assert set(row.auto_gpu) <= set(row.gpu_precisions) and set(row.auto_cpu) <= set(row.cpu_precisions)
    assert row.gate_family in GATE_FAMILIES
    for precision in row.precisions:
        variant = gate_variant(name, precision)
        assert variant is None if precision == "fp32" else variant in GATE_VARIANTS
    assert name in BACKENDS


def test_auto_candidates_per_device_and_precision():
    for device in DEVICES:
        every = auto_candidates(device)
        assert every and len(set(every)) == len(every)
        for precision in ("fp32", "fp16", "bf16", "int8"):
            assert auto_candidates(device, precision) == [pair for pair in every if pair[1] == precision]
    assert ("onnxruntime", "fp32") in auto_candidates("cpu") and ("onnxruntime", "int8") in auto_candidates("cpu")
    assert not any(BACKEND_TABLE[name].gpu_precisions == () for name, _ in auto_candidates("gpu"))
    # not raced: TensorRT is chosen before any race where its plan and GPU are present; an AOTInductor package loaded
    # beside the torch backend's CUDA graphs crashed the process
    assert not {"tensorrt", "aoti"} & {name for name, _ in auto_candidates("gpu") + auto_candidates("cpu")}


def test_the_gate_families_give_model_json_its_entries():
    assert GATE_VARIANTS == ("onnx_int8", "onnx_fp16", "torch_fp16", "torch_bf16", "fused_fp16", "fused_bf16")
    assert gate_variant("tensorrt", "int8") == gate_variant("onnxruntime", "int8") == "onnx_int8"
    assert gate_variant("aoti", "bf16") == "torch_bf16" and gate_variant("torch", "fp32") is None


def test_the_decoder_runs_on_a_row_that_serves_it_on_the_cpu():
    from capsnet.serving.engine.decoder import DecoderBackend

    assert BACKEND_TABLE[DECODER_BACKEND].serves(DECODER_PRECISION, "cpu")
    assert (DecoderBackend.name, DecoderBackend.precision) == (DECODER_BACKEND, DECODER_PRECISION)
