"""Margin loss and reconstruction term against hand-computed values; the decoder's masking."""

from __future__ import annotations

import pytest
import torch

from capsnet.models.checkpoint import load_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import load_embedded, to_float
from capsnet.training.loss import capsnet_loss, margin_loss, reconstruction_error
from capsnet.models.capsnet import CapsNetOutput, Decoder

# lengths, label, by hand with m+ = 0.9, m− = 0.1, λ = 0.5
HAND_COMPUTED = [
    ([0.95, 0.30, 0.05], 0, 0.5 * 0.2**2),  # present above m+: 0; one absent above m−
    ([0.20, 0.50, 0.00], 1, 0.5 * 0.1**2 + 0.4**2),  # present short of m+ by 0.4
    ([0.00, 0.10, 0.90], 2, 0.0),  # exactly at both margins
    ([1.00, 1.00, 0.00], 2, 0.9**2 + 2 * 0.5 * 0.9**2),  # worst case
]


@pytest.mark.parametrize("lengths, label, expected", HAND_COMPUTED)
def test_margin_loss_hand_computed(lengths, label, expected):
    loss = margin_loss(torch.tensor([lengths], dtype=torch.float64), torch.tensor([label]))
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_margin_loss_honours_its_constants():
    loss = margin_loss(torch.tensor([[0.5, 0.5]]), torch.tensor([0]), m_plus=0.8, m_minus=0.2, lambda_absent=1.0)
    assert loss.item() == pytest.approx(0.3**2 + 0.3**2)


def test_total_loss_is_batch_mean_of_margin_plus_weighted_reconstruction():
    config = preset("tiny")
    probabilities = torch.tensor([HAND_COMPUTED[0][0], HAND_COMPUTED[1][0]])  # (2, 3)
    labels = torch.tensor([0, 1])
    images = torch.tensor([[[[0.0, 1.0], [1.0, 0.0]]], [[[1.0, 1.0], [1.0, 1.0]]]])  # (2, 1, 2, 2)
    reconstruction = torch.full((2, 4), 0.5)  # squared errors: 4 · 0.25 = 1.0 each
    output = CapsNetOutput(probabilities, poses=None, reconstruction=reconstruction, coupling=None)
    parts = capsnet_loss(output, images, labels, config)
    torch.testing.assert_close(parts.reconstruction, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(reconstruction_error(reconstruction, images), torch.tensor([1.0, 1.0]))
    expected = ((HAND_COMPUTED[0][2] + 0.0005) + (HAND_COMPUTED[1][2] + 0.0005)) / 2
    assert parts.total.item() == pytest.approx(expected, rel=1e-6)


def test_decoder_sees_only_the_masked_capsule():
    torch.manual_seed(0)
    config = preset("tiny")
    decoder = Decoder(config).eval()
    poses = torch.randn(4, 10, 16)  # (B, J, D)
    target = torch.tensor([3, 0, 9, 3])
    others_changed = torch.randn(4, 10, 16)
    rows = torch.arange(4)
    others_changed[rows, target] = poses[rows, target]
    torch.testing.assert_close(decoder(poses, target), decoder(others_changed, target), rtol=0, atol=0)
    target_changed = poses.clone()
    target_changed[rows, target] += 1.0
    assert not torch.allclose(decoder(poses, target), decoder(target_changed, target))


def test_inference_masks_by_the_predicted_class(trained_tiny_checkpoint):
    model = load_checkpoint(trained_tiny_checkpoint).build_model()
    images = to_float(load_embedded().test.images[:8])  # (8, 1, 28, 28)
    with torch.no_grad():
        output = model(images)
        predicted = output.probabilities.argmax(dim=1)
        torch.testing.assert_close(output.reconstruction, model.decoder(output.poses, predicted), rtol=0, atol=0)
        assert not torch.allclose(output.reconstruction, model.decoder(output.poses, (predicted + 1) % 10))
