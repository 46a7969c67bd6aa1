"""Routing by agreement: the vectorised `route` against a capsule-by-capsule transcription of the paper."""

from __future__ import annotations

import itertools

import pytest
import torch

from capsnet.models.config import ROUTING_VARIANTS, preset
from capsnet.models.capsnet import DigitCaps, route


def naive_route(u_hat, iterations, variant, squash_constant, detach_agreement):
    """Procedure 1 of Sabour et al., one sample, one capsule, one scalar at a time.

    u_hat (B, I, J, D) -> poses (B, J, D), coupling of the last iteration (B, I, J).
    """
    batch, num_in, num_out, _ = u_hat.shape
    zero = u_hat.new_zeros(())
    all_poses, all_coupling = [], []
    for sample in range(batch):
        logits = [[zero for _ in range(num_out)] for _ in range(num_in)]
        for iteration in range(iterations):
            coupling = []
            for i in range(num_in):
                row = logits[i] + ([zero] if variant == "leaky" else [])
                coupling.append(torch.softmax(torch.stack(row), dim=0)[:num_out])
            poses = []
            for j in range(num_out):
                s = sum(coupling[i][j] * u_hat[sample, i, j] for i in range(num_in))
                norm_squared = (s * s).sum()
                poses.append(norm_squared / (squash_constant + norm_squared) * s / norm_squared.sqrt())
            if iteration < iterations - 1:
                for i, j in itertools.product(range(num_in), range(num_out)):
                    agreement = (u_hat[sample, i, j] * poses[j]).sum()
                    if detach_agreement:
                        agreement = agreement.detach()
                    logits[i][j] = agreement if variant == "su" else logits[i][j] + agreement
        all_poses.append(torch.stack(poses))
        all_coupling.append(torch.stack(coupling))
    return torch.stack(all_poses), torch.stack(all_coupling)


@pytest.mark.parametrize("detach_agreement", [False, True])
@pytest.mark.parametrize("iterations", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", ROUTING_VARIANTS)
def test_route_equals_naive_loop_values_and_gradients(variant, iterations, detach_agreement):
    generator = torch.Generator().manual_seed(iterations)
    u_hat = torch.randn(2, 5, 3, 4, dtype=torch.float64, generator=generator)  # (B, I, J, D)
    weights = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator)  # a generic loss on the poses
    constant = 0.5 if variant == "su" else 1.0

    fast_input = u_hat.clone().requires_grad_()
    poses, coupling = route(fast_input.transpose(1, 2), iterations, variant, constant, detach_agreement)  # (B, J, I, D)
    (poses * weights).sum().backward()

    naive_input = u_hat.clone().requires_grad_()
    naive_poses, naive_coupling = naive_route(naive_input, iterations, variant, constant, detach_agreement)
    (naive_poses * weights).sum().backward()

    torch.testing.assert_close(poses, naive_poses, rtol=0, atol=1e-12)
    torch.testing.assert_close(coupling, naive_coupling, rtol=0, atol=1e-12)
    # the gradient flows through every iteration (or skips the agreement update when detached), as in the loop
    torch.testing.assert_close(fast_input.grad, naive_input.grad, rtol=0, atol=1e-12)


def test_detaching_the_agreement_changes_the_gradient():
    u_hat = torch.randn(2, 7, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gradients = []
    for detach in (False, True):
        leaf = u_hat.clone().requires_grad_()
        route(leaf.transpose(1, 2), 3, "sabour", 1.0, detach).poses.sum().backward()
        gradients.append(leaf.grad)
    assert not torch.allclose(gradients[0], gradients[1])


@pytest.mark.parametrize("variant", ROUTING_VARIANTS)
def test_coupling_is_a_distribution_over_parents(variant):
    u_hat = torch.randn(4, 10, 50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # (B, J, I, D)
    coupling = route(u_hat, 3, variant).coupling  # (B, I, J)
    totals = coupling.sum(dim=-1)  # (B, I)
    assert (coupling > 0).all()
    if variant == "leaky":
        # the extra "none of these" parent takes the rest
        assert (totals < 1).all() and (totals > 0).all()
    else:
        torch.testing.assert_close(totals, torch.ones_like(totals), rtol=0, atol=1e-12)
    assert not torch.allclose(coupling, coupling.mean(dim=-1, keepdim=True)), "routing left the coupling uniform"


@pytest.mark.parametrize("variant", ROUTING_VARIANTS)
def test_digit_caps_predicts_every_pair_and_its_uniform_sum_equals_summing_the_predictions(variant):
    """DigitCaps lays û out class-major and hands routing Σ_i û_j|i computed from W; both must be what
    the paper's per-pair û_j|i = W_ij u_i gives."""
    config = preset("tiny", routing=variant)
    torch.manual_seed(2)
    caps = DigitCaps(config).double()
    with torch.no_grad():
        caps.weight.normal_()  # far from the 0.01 init, so a wrong layout cannot hide in rounding
    u = torch.randn(3, config.num_primary_caps, config.primary_caps_dim, dtype=torch.float64)  # (B, I, P)
    weight = caps.weight.view(config.num_primary_caps, config.primary_caps_dim, config.num_classes,
                              config.digit_caps_dim)  # (I, P, J, D)
    u_hat = caps.predictions(u)  # (B, J, I, D)
    for i, j in itertools.product(range(0, config.num_primary_caps, 7), range(config.num_classes)):
        torch.testing.assert_close(u_hat[:, j, i], u[:, i] @ weight[i, :, j], rtol=0, atol=1e-12)

    fast = caps(u)
    plain = route(u_hat, config.routing_iterations, variant, config.squash_constant, config.detach_agreement)
    torch.testing.assert_close(fast.poses, plain.poses, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.coupling, plain.coupling, rtol=0, atol=1e-12)
