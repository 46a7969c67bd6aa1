"""The CapsNet loss: margin loss on capsule lengths plus a small reconstruction term (Sabour et al. 2017);
for EM capsules (`arch` em) the spread loss on class activations (Hinton et al. 2018) takes the margin loss's place."""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from capsnet.models.config import CapsNetConfig
from capsnet.models.capsnet import CapsNetOutput, at_least_float32


class LossParts(NamedTuple):
    total: Tensor  # () batch mean of margin + weighted reconstruction: what is optimised
    margin: Tensor  # (B,) margin (or, for EM capsules, spread) loss of each sample
    reconstruction: Tensor  # (B,) sum of squared reconstruction errors of each sample


def margin_loss(lengths: Tensor, labels: Tensor, m_plus: float = 0.9, m_minus: float = 0.1,
                lambda_absent: float = 0.5) -> Tensor:
    """Σ_k T_k max(0, m+ − |v_k|)² + λ (1 − T_k) max(0, |v_k| − m−)², per sample: (B, J) -> (B,)."""
    lengths = at_least_float32(lengths)  # the squares underflow in fp16/bf16
    present = F.one_hot(labels, lengths.shape[1]).to(lengths.dtype)  # (B, J)
    present_term = present * F.relu(m_plus - lengths).square()  # (B, J)
    absent_term = lambda_absent * (1.0 - present) * F.relu(lengths - m_minus).square()  # (B, J)
    return (present_term + absent_term).sum(dim=1)  # (B,)


def spread_loss(activations: Tensor, labels: Tensor, margin: float) -> Tensor:
    """Σ_{i≠t} max(0, m − (a_t − a_i))², per sample: (B, J) -> (B,)."""
    activations = at_least_float32(activations)
    target = activations.gather(1, labels.unsqueeze(1))  # (B, 1)
    others = 1.0 - F.one_hot(labels, activations.shape[1]).to(activations.dtype)  # (B, J)
    return (others * F.relu(margin - (target - activations)).square()).sum(dim=1)  # (B,)


def reconstruction_error(reconstruction: Tensor, images: Tensor) -> Tensor:
    """Sum of squared errors against the [0, 1] input image, per sample: -> (B,)."""
    target = at_least_float32(images.flatten(1))  # (B, C*H*W)
    return (at_least_float32(reconstruction) - target).square().sum(dim=1)  # (B,)


def capsnet_loss(output: CapsNetOutput, images: Tensor, labels: Tensor, config: CapsNetConfig,
                 epoch: int | None = None) -> LossParts:
    """The training objective; `epoch` (0-based) sets the spread loss's margin, None its final one."""
    if config.arch == "em":
        margin = spread_loss(output.probabilities, labels, config.spread_margin(epoch))
    else:
        margin = margin_loss(output.probabilities, labels, config.m_plus, config.m_minus, config.lambda_absent)
    reconstruction = reconstruction_error(output.reconstruction, images)
    total = (margin + config.reconstruction_weight * reconstruction).mean()
    return LossParts(total, margin, reconstruction)
