"""model.json and the ONNX metadata_props: the contract in docs/artifacts.md, nothing MNIST-specific."""

from __future__ import annotations

import onnx

from capsnet.export.metadata import read_metadata
from capsnet.training.checkpoint import file_sha256, load_checkpoint

CONTRACT_KEYS = {
    "format", "format_version", "name", "version", "exporter_version", "created", "opset", "input", "outputs",
    "class_names", "routing", "checkpoint", "training_metrics", "artifacts", "int8", "parity",
}


def test_export_sidecar_describes_the_checkpoint(tiny_export):
    sidecar = tiny_export.sidecar
    checkpoint = load_checkpoint(tiny_export.checkpoint)
    config = checkpoint.config
    assert set(sidecar) == CONTRACT_KEYS
    identity = (sidecar["format"], sidecar["format_version"], sidecar["name"], sidecar["version"])
    assert identity == ("capsnet-model", 1, "capsnet", "1")
    assert sidecar["input"] == {"name": "images", "datatype": "FP32", "layout": "NCHW",
                                "shape": [config.in_channels, config.height, config.width], "value_range": [0.0, 1.0]}
    assert sidecar["outputs"] == [
        {"name": "probabilities", "datatype": "FP32", "shape": [config.num_classes]},
        {"name": "poses", "datatype": "FP32", "shape": [config.num_classes, config.digit_caps_dim]},
        {"name": "reconstruction", "datatype": "FP32", "shape": [config.input_size]},
    ]
    assert sidecar["class_names"] == checkpoint.class_names
    assert sidecar["routing"] == {"variant": config.routing, "iterations": config.routing_iterations,
                                  "squash_constant": config.squash_constant}
    assert sidecar["training_metrics"] == checkpoint.metrics and checkpoint.metrics
    assert sidecar["checkpoint"] == {"file": "model.ckpt", "sha256": file_sha256(tiny_export.checkpoint)}
    assert (tiny_export.out / "model.ckpt").read_bytes() == tiny_export.checkpoint.read_bytes()
    assert sidecar["artifacts"] == {"onnx": "model.onnx", "onnx_int8": "model.int8.onnx",
                                    "onnx_fp16": "model.fp16.onnx", "tensorrt": None}
    assert sorted(path.name for path in tiny_export.out.iterdir()) == [
        "model.ckpt", "model.fp16.onnx", "model.int8.onnx", "model.json", "model.onnx"]


def test_export_sidecar_records_the_parity_check(tiny_export):
    parity = tiny_export.sidecar["parity"]
    assert parity["batch_sizes"] == [1, 7, 64] and parity["tolerance"] == 1e-4
    assert parity["onnxruntime"]["images"] == 72 and parity["onnxruntime"]["argmax_agreement"] == 1.0
    assert set(parity["onnxruntime"]["max_abs_diff"]) == {"probabilities", "poses", "reconstruction"}
    assert max(parity["onnxruntime"]["max_abs_diff"].values()) <= 1e-4


def test_export_every_onnx_file_carries_the_sidecar(tiny_export):
    for name in ("model.onnx", "model.int8.onnx", "model.fp16.onnx"):
        model = onnx.load(str(tiny_export.out / name))
        assert read_metadata(model) == tiny_export.sidecar, name
        assert model.producer_name == "capsnet-serve"
