"""An EM-routing model (`--arch em`) through `capsnet export`: the EM iterations unrolled into a plain graph,
ONNX Runtime against PyTorch on real images at batch 1 and past the export example's batch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from capsnet.export.onnx_export import CONTROL_FLOW_OPS, op_counts
from capsnet.export.parity import onnxruntime_session
from capsnet.export.tensorrt_ops import tensorrt_problems
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import to_float


def test_em_export_sidecar_describes_em_routing(em_tiny_export, trained_em_tiny_checkpoint):
    sidecar = json.loads((em_tiny_export / "model.json").read_text())
    assert sidecar["routing"] == {"variant": "em", "iterations": 2, "inverse_temperature": 0.01,  # em-tiny
                                  "gpu_engine": "unfused: arch em has no dynamic routing over a fixed grid of primary "
                                                "capsules"}
    assert [(o["name"], o["shape"]) for o in sidecar["outputs"]] == [
        ("probabilities", [10]), ("poses", [10, 16]), ("reconstruction", [784])]
    assert sidecar["parity"]["onnxruntime"]["argmax_agreement"] == 1.0


def test_em_export_is_unrolled_and_tensorrt_compatible(em_tiny_export):
    graph = onnx.load(str(em_tiny_export / "model.onnx"))
    counts = op_counts(graph)
    assert not CONTROL_FLOW_OPS & set(counts)
    # em-tiny's 2 EM iterations in each of 3 capsule layers: a logistic per M-step, a softmax per E-step but the last
    assert counts["Softmax"] == 3 * (2 - 1)
    assert tensorrt_problems(graph) == []


@pytest.mark.parametrize("batch_size", [1, 65])
def test_em_export_onnxruntime_matches_pytorch_on_real_images(em_tiny_export, trained_em_tiny_checkpoint, embedded,
                                                             batch_size):
    model = load_checkpoint(trained_em_tiny_checkpoint).build_model()
    session = onnxruntime_session(str(em_tiny_export / "model.onnx"))
    # images from every class (the split is sorted by class)
    stride = len(embedded.test) // batch_size
    images = to_float(embedded.test.images[stride * np.arange(batch_size)]).numpy()  # (N, 1, 28, 28)
    with torch.inference_mode():
        expected = model(torch.from_numpy(images))
    probabilities, poses, reconstruction = session.run(None, {"images": images})
    np.testing.assert_allclose(probabilities, expected.probabilities.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(poses, expected.poses.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(reconstruction, expected.reconstruction.numpy(), rtol=0, atol=1e-4)
    assert (probabilities.argmax(axis=1) == expected.probabilities.argmax(dim=1).numpy()).all()
    if batch_size > 1:
        # the reconstruction is masked by each image's own prediction, not one baked in at export
        assert len(set(probabilities.argmax(axis=1).tolist())) > 1

