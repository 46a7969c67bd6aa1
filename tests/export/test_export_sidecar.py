"""model.json and the ONNX metadata_props: the contract in docs/artifacts.md, nothing MNIST-specific."""

from __future__ import annotations

import numpy as np
import onnx

from capsnet.runtime.cpu import CpuKind
from capsnet.export.metadata import read_metadata
from capsnet.export.parity import onnxruntime_session
from capsnet.model_description.files import file_sha256
from capsnet.model_description.schema import ModelDescription
from capsnet.models.checkpoint import load_checkpoint

CONTRACT_KEYS = {
    "format", "format_version", "name", "version", "exporter_version", "created", "opset", "input", "outputs",
    "class_names", "routing", "training_metrics", "artifacts", "sha256", "reference_set", "int8", "parity",
    "precision_gate", "aoti", "refused", "decoder",
}
FILES = ["decoder.onnx", "model.ckpt", "model.fp16.onnx", "model.int8.onnx", "model.json", "model.onnx",
         "reference.npz"]


def test_export_sidecar_describes_the_checkpoint(tiny_export):
    sidecar = tiny_export.sidecar
    checkpoint = load_checkpoint(tiny_export.checkpoint)
    config = checkpoint.config
    assert set(sidecar) == CONTRACT_KEYS
    identity = (sidecar["format"], sidecar["format_version"], sidecar["name"], sidecar["version"])
    assert identity == ("capsnet-model", 3, "capsnet", "1")
    assert sidecar["input"] == {"name": "images", "datatype": "FP32", "layout": "NCHW",
                                "shape": [config.in_channels, config.height, config.width], "value_range": [0.0, 1.0],
                                "sizes": {"channels": config.in_channels, "min_height": config.height,
                                          "max_height": config.height, "min_width": config.width,
                                          "max_width": config.width, "multiple_of": 1}}
    assert sidecar["outputs"] == [
        {"name": "probabilities", "datatype": "FP32", "shape": [config.num_classes]},
        {"name": "poses", "datatype": "FP32", "shape": [config.num_classes, config.digit_caps_dim]},
        {"name": "reconstruction", "datatype": "FP32", "shape": [config.input_size]},
    ]
    assert sidecar["class_names"] == checkpoint.class_names
    assert sidecar["routing"] == {"variant": config.routing, "iterations": config.routing_iterations,
                                  "squash_constant": config.squash_constant, "gpu_engine": "fused"}
    assert sidecar["training_metrics"] == checkpoint.metrics and checkpoint.metrics
    assert (tiny_export.out / "model.ckpt").read_bytes() == tiny_export.checkpoint.read_bytes()
    assert sidecar["artifacts"] == {"onnx": "model.onnx", "onnx_int8": "model.int8.onnx",
                                    "onnx_fp16": "model.fp16.onnx", "tensorrt": None, "checkpoint": "model.ckpt",
                                    "reference": "reference.npz"}
    assert sorted(path.name for path in tiny_export.out.iterdir()) == FILES
    # every file but model.json itself, with its digest
    assert sidecar["sha256"] == {name: file_sha256(tiny_export.out / name) for name in FILES if name != "model.json"}
    assert sidecar["sha256"]["model.ckpt"] == file_sha256(tiny_export.checkpoint)
    assert ModelDescription.read(tiny_export.out).to_json() == sidecar  # the reader gives back what export wrote
    # the precision gate: the variants written, the checkpoint's fp16/bf16 convolutions always, and the fused
    # kernels' fp16/bf16 for a model whose routing they run
    assert set(sidecar["precision_gate"]["variants"]) == {"onnx_int8", "onnx_fp16", "torch_fp16", "torch_bf16",
                                                          "fused_fp16", "fused_bf16"}
    assert sidecar["precision_gate"]["criterion"]["agreement_slack_images"] == 2 and sidecar["aoti"] == []
    assert sidecar["refused"] == {}  # every variant asked for was written


def test_export_reference_set_holds_test_images_and_their_fp32_outputs(tiny_export, embedded):
    assert tiny_export.sidecar["reference_set"] == {"images": 128, "dataset": "embedded-mnist-5k", "split": "test"}
    with np.load(tiny_export.out / "reference.npz") as archive:
        reference = {name: archive[name] for name in archive.files}
    assert set(reference) == {"images", "probabilities", "poses", "reconstruction"}
    images = reference["images"]
    assert images.shape == (128, 1, 28, 28) and images.dtype == np.float32
    test_images = embedded.test.images.reshape(len(embedded.test), -1).astype(np.float32) / 255  # (N, 784)
    assert all((test_images == image.reshape(1, -1)).all(axis=1).any() for image in images)  # each a test image
    assert len(set(embedded.test.labels[np.arange(128) * len(embedded.test) // 128])) == 10  # every class
    outputs = onnxruntime_session(str(tiny_export.out / "model.onnx")).run(None, {"images": images})
    for name, output in zip(("probabilities", "poses", "reconstruction"), outputs):
        assert np.array_equal(reference[name], output), name


def test_export_int8_record_names_its_data_and_cpu(tiny_export):
    int8 = tiny_export.sidecar["int8"]
    gate = tiny_export.sidecar["precision_gate"]["variants"]["onnx_int8"]
    assert int8["dataset"] == "embedded-mnist-5k" and gate["test_images"] == 1000 and gate["max_drop_points"] == 100
    assert int8["cpu"] == CpuKind.this_host().to_dict() and gate["measured_on"] == CpuKind.this_host().describe()
    assert "reduce_range" in int8["scheme"]["weights"]


def test_export_sidecar_records_the_parity_check(tiny_export):
    parity = tiny_export.sidecar["parity"]
    assert parity["batch_sizes"] == [1, 7, 64] and parity["tolerance"] == 1e-4
    assert parity["onnxruntime"]["images"] == 72 and parity["onnxruntime"]["argmax_agreement"] == 1.0
    assert set(parity["onnxruntime"]["max_abs_diff"]) == {"probabilities", "poses", "reconstruction"}
    assert max(parity["onnxruntime"]["max_abs_diff"].values()) <= 1e-4


def test_export_every_onnx_file_carries_the_sidecar(tiny_export):
    for name in ("model.onnx", "model.int8.onnx", "model.fp16.onnx"):
        model = onnx.load(str(tiny_export.out / name))
        embedded = {key: value for key, value in tiny_export.sidecar.items() if key != "sha256"}
        assert read_metadata(model) == embedded, name  # all but the hashes: a file cannot hold its own
        assert model.producer_name == "capsnet-serve"
