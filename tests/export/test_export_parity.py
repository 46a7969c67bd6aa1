"""ONNX Runtime against PyTorch on real images, as a user would run the exported model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsnet.export.parity import onnxruntime_session
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import to_float

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_export):
    return load_checkpoint(tiny_export.checkpoint).build_model()


@pytest.fixture(scope="module")
def session(tiny_export):
    return onnxruntime_session(str(tiny_export.out / "model.onnx"))


def _spread(images_uint8: np.ndarray, count: int, offset: int) -> np.ndarray:
    """`count` images from all over the split (it is sorted by class), as model input."""
    stride = len(images_uint8) // count
    return to_float(images_uint8[offset + stride * np.arange(count)]).numpy()  # (count, C, H, W)


def _run_both(model, session, images: np.ndarray):
    with torch.inference_mode():
        expected = model(torch.from_numpy(images))
    got = dict(zip(["probabilities", "poses", "reconstruction"], session.run(None, {"images": images})))
    return expected, got


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_export_onnxruntime_matches_pytorch_on_real_images(model, session, embedded, batch_size):
    images = _spread(embedded.test.images, batch_size, offset=3)
    expected, got = _run_both(model, session, images)
    for name in ("probabilities", "poses", "reconstruction"):
        assert got[name].shape == getattr(expected, name).shape
        assert np.abs(got[name] - getattr(expected, name).numpy()).max() <= TOLERANCE, name
    assert (got["probabilities"].argmax(1) == expected.probabilities.argmax(1).numpy()).all()


def test_export_reconstruction_is_masked_by_each_images_own_prediction(model, session, embedded):
    """The decoder mask is computed in the graph, not baked in from the export's example input."""
    images = _spread(embedded.test.images, 64, offset=5)
    expected, got = _run_both(model, session, images)
    predicted = got["probabilities"].argmax(1)
    assert len(set(predicted.tolist())) >= 3  # several classes, or the test would prove nothing
    assert np.abs(got["reconstruction"] - expected.reconstruction.numpy()).max() <= TOLERANCE
    # Alone (batch 1), two images of different predicted classes each get their own mask.
    first = 0
    second = int(np.flatnonzero(predicted != predicted[first])[0])
    for index in (first, second):
        _, alone = _run_both(model, session, images[index : index + 1])
        with torch.inference_mode():
            poses = torch.from_numpy(alone["poses"])
            own_class = model.decoder(poses, torch.tensor([predicted[index]])).numpy()
            other_class = model.decoder(poses, torch.tensor([predicted[first + second - index]])).numpy()
        assert np.abs(alone["reconstruction"] - own_class).max() <= TOLERANCE
        assert np.abs(alone["reconstruction"] - other_class).max() > 100 * TOLERANCE
