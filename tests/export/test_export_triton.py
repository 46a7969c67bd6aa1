"""The Triton model repository, parsed with Triton's own model_config.proto schema (tritonclient's)."""

from __future__ import annotations

import json
from dataclasses import replace

import onnx
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from capsnet.export.config import TritonConfig
from capsnet.export.triton import config_pbtxt
from capsnet.model_description.schema import ModelDescription


def _parse_model_config(text: str) -> dict:
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def test_export_triton_repository_for_onnxruntime(tiny_export):
    model_dir = tiny_export.repo / "capsnet"
    config = _parse_model_config((model_dir / "config.pbtxt").read_text())
    assert config["name"] == "capsnet" and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 256
    assert config["input"] == [{"name": "images", "data_type": "TYPE_FP32", "dims": ["1", "28", "28"]}]
    assert config["output"] == [
        {"name": "probabilities", "data_type": "TYPE_FP32", "dims": ["10"]},
        {"name": "poses", "data_type": "TYPE_FP32", "dims": ["10", "16"]},
        {"name": "reconstruction", "data_type": "TYPE_FP32", "dims": ["784"]},
    ]
    assert config["dynamic_batching"] == {"preferred_batch_size": [32, 256], "max_queue_delay_microseconds": "100"}
    assert json.loads(config["parameters"]["class_names"]["string_value"]) == tiny_export.sidecar["class_names"]
    assert sorted(path.name for path in model_dir.iterdir()) == ["1", "config.pbtxt"]
    assert (model_dir / "1" / "model.onnx").read_bytes() == (tiny_export.out / "model.onnx").read_bytes()


def test_export_triton_config_for_a_tensorrt_plan(tiny_export):
    description = ModelDescription.from_json(tiny_export.sidecar, "model.json")
    text = config_pbtxt(description, "plan", TritonConfig(max_batch_size=64, preferred_batch_sizes=(8, 64, 128),
                                                          max_queue_delay_us=250))
    config = _parse_model_config(text)
    assert config["platform"] == "tensorrt_plan" and config["max_batch_size"] == 64
    assert config["dynamic_batching"] == {"preferred_batch_size": [8, 64], "max_queue_delay_microseconds": "250"}
    assert config["instance_group"] == [{"kind": "KIND_GPU", "count": 1}]


def test_export_triton_config_declares_the_onnx_graphs_interface(tiny_export):
    """Names, element types and dims (the batch axis left out) as the model file Triton loads declares them."""
    model_dir = tiny_export.repo / "capsnet"
    config = _parse_model_config((model_dir / "config.pbtxt").read_text())
    graph = onnx.load(str(model_dir / "1" / "model.onnx")).graph
    triton_types = {onnx.TensorProto.FLOAT: "TYPE_FP32"}

    def declared(values):
        return [{"name": value.name, "data_type": triton_types[value.type.tensor_type.elem_type],
                 "dims": [str(dim.dim_value) for dim in value.type.tensor_type.shape.dim[1:]]} for value in values]

    assert config["input"] == declared(graph.input)
    assert config["output"] == declared(graph.output)


def test_export_triton_config_keeps_class_names_with_quotes_and_accents(tiny_export):
    names = ['T-shirt/top', 'a "quoted" class', 'back\\slash', 'Sandale à talon']
    description = replace(ModelDescription.from_json(tiny_export.sidecar, "model.json"), class_names=tuple(names))
    config = _parse_model_config(config_pbtxt(description, "onnx", TritonConfig()))
    assert json.loads(config["parameters"]["class_names"]["string_value"]) == names
