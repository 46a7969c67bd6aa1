"""squash: lengths in [0, 1), direction kept, finite at and around 0, safe in fp16/bf16."""

from __future__ import annotations

import pytest
import torch

from capsnet.models.capsnet import squash


@pytest.mark.parametrize("constant", [1.0, 0.5])
def test_squash_length_and_direction(constant):
    scales = torch.logspace(-3, 3, 200, dtype=torch.float64)[:, None]  # (200, 1)
    s = scales * torch.randn(200, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # (200, 16)
    v = squash(s, constant)
    norm = s.norm(dim=-1)
    lengths = v.norm(dim=-1)
    assert (lengths >= 0).all() and (lengths < 1).all()
    torch.testing.assert_close(lengths, norm**2 / (constant + norm**2), rtol=1e-12, atol=0)
    cosine = (v * s).sum(dim=-1) / (lengths * norm)
    torch.testing.assert_close(cosine, torch.ones_like(cosine), rtol=0, atol=1e-12)


def test_squash_acts_on_the_requested_axis():
    s = torch.randn(3, 16, 5, dtype=torch.float64)
    torch.testing.assert_close(squash(s, dim=1), squash(s.transpose(1, 2)).transpose(1, 2))


def test_squash_is_finite_with_a_finite_gradient_at_and_near_zero():
    s = torch.zeros(4, 8)
    s[1, 0] = 1e-30  # |s|² underflows to 0 in float32
    s[2] = 1e-20
    s.requires_grad_()
    v = squash(s)
    v.sum().backward()
    assert torch.isfinite(v).all() and torch.isfinite(s.grad).all()
    assert torch.equal(v[0], torch.zeros(8)) and torch.equal(s.grad[0], torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_squash_is_safe_in_half_precision(dtype):
    # |s|² = 16 · 300² overflows fp16 (max 65504); tiny values underflow
    s = torch.cat([torch.full((1, 16), 300.0), torch.full((1, 16), 1e-4), torch.zeros(1, 16), torch.randn(8, 16)])
    s = s.to(dtype).requires_grad_()
    v = squash(s)
    v.float().sum().backward()
    assert v.dtype == dtype
    assert torch.isfinite(v).all() and torch.isfinite(s.grad).all()
    lengths = v.float().norm(dim=-1)
    assert (lengths <= 1).all()
    torch.testing.assert_close(v.float(), squash(s.detach().float()), rtol=1e-2, atol=1e-3)
