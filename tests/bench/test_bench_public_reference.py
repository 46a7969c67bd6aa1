"""The public CapsNet baseline: XifengGuo/CapsNet-Pytorch's formulation, computing our model's outputs."""

from __future__ import annotations

import pytest
import torch

from capsnet.bench.analysis.public_reference import PublicCapsNet
from capsnet.errors import CapsNetError
from capsnet.models.config import preset
from capsnet.models.capsnet import CapsNet


def test_bench_public_reference_matches_our_model_with_our_weights():
    torch.manual_seed(0)
    config = preset("tiny")
    ours = CapsNet(config).eval()
    with torch.no_grad():  # routing far from uniform, so a wrong softmax axis or W layout shows
        ours.primary_caps.conv.weight.mul_(20)
        ours.digit_caps.weight.normal_()
    public = PublicCapsNet(ours)
    images = torch.rand(5, config.in_channels, config.height, config.width)

    with torch.inference_mode():
        expected = ours(images)
        probabilities, poses, reconstruction = public(images)

    # the public layout: one convolution for all capsules, W as (J, I, D, P)
    assert isinstance(public.primary_caps, torch.nn.Conv2d)
    assert public.primary_caps.out_channels == config.primary_caps_channels * config.primary_caps_dim
    assert public.weight.shape == (config.num_classes, config.num_primary_caps, config.digit_caps_dim,
                                   config.primary_caps_dim)
    assert expected.coupling.std() > 0.05  # the test's premise: the coupling moved away from uniform
    torch.testing.assert_close(probabilities, expected.probabilities, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(poses, expected.poses, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(reconstruction, expected.reconstruction, atol=1e-5, rtol=1e-4)


def test_bench_public_reference_does_not_share_our_parameters():
    """A copy, not a view: training or changing ours afterwards leaves the baseline as it was."""
    torch.manual_seed(1)
    ours = CapsNet(preset("tiny")).eval()
    public = PublicCapsNet(ours)
    before = [p.detach().clone() for p in public.parameters()]
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(1.0)
    assert all(torch.equal(p, b) for p, b in zip(public.parameters(), before))


@pytest.mark.parametrize("change", [{"routing": "leaky"}, {"routing": "su"}, {"squash_constant": 0.5}])
def test_bench_public_reference_refuses_routing_the_public_code_does_not_have(change):
    with pytest.raises(CapsNetError, match="routes as the paper does"):
        PublicCapsNet(CapsNet(preset("tiny", **change)))
