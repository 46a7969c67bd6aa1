"""The public-style baseline computes our model's outputs, with the public implementations' layout."""

from __future__ import annotations

import torch

from capsnet.bench.public_reference import PublicStyleCapsNet
from capsnet.training.config import preset
from capsnet.training.model import CapsNet


def test_bench_public_reference_matches_our_model_with_our_weights():
    torch.manual_seed(0)
    config = preset("tiny")
    ours = CapsNet(config).eval()
    public = PublicStyleCapsNet.from_capsnet(ours)
    images = torch.rand(5, config.in_channels, config.height, config.width)

    with torch.inference_mode():
        expected = ours(images)
        probabilities, poses = public(images)

    assert public.W.shape == (1, config.num_primary_caps, config.num_classes, config.digit_caps_dim,
                              config.primary_caps_dim)
    assert len(public.primary_caps) == config.primary_caps_dim
    torch.testing.assert_close(probabilities, expected.probabilities, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(poses, expected.poses, atol=1e-5, rtol=1e-4)


def test_bench_public_reference_does_not_share_our_parameters():
    """A copy, not a view: training or changing ours afterwards leaves the baseline as it was."""
    torch.manual_seed(1)
    ours = CapsNet(preset("tiny")).eval()
    public = PublicStyleCapsNet.from_capsnet(ours)
    before = public.W.detach().clone()
    with torch.no_grad():
        ours.digit_caps.weight.add_(1.0)
    assert torch.equal(public.W, before)
