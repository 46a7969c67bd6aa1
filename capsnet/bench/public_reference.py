"""A CapsNet written the way popular public PyTorch implementations write it: the speed baseline.

NOT our model and not code taken from any project: a re-implementation, for benchmarking only, of the
formulation that the widely copied public PyTorch CapsNets share (e.g. gram-ai/capsule-networks,
higgsfield/Capsule-Network-Tutorial):
- PrimaryCaps as a list of 8 separate convolutions (one per capsule dimension), stacked;
- DigitCaps weights as one (1, 1152, 10, 16, 8) parameter;
- u repeated once per class to (B, 1152, 10, 8, 1) and û = W @ u as a broadcast `torch.matmul` of
  (1, 1152, 10, 16, 8) by (B, 1152, 10, 8, 1), i.e. one tiny 16×8 product per capsule pair.
Routing follows the same math as ours (per sample, b starting at 0), so that, loaded with our weights
through `from_capsnet`, it computes the same probabilities and poses: only the formulation differs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsnet.training.model import CapsNet, capsule_lengths, route


class PublicStyleCapsNet(nn.Module):
    def __init__(self, model: CapsNet):
        super().__init__()
        cfg = model.config
        self.config = cfg
        self.normalised = model.normalised
        self.conv1 = model.conv1
        self.primary_caps = nn.ModuleList(
            nn.Conv2d(cfg.conv1_channels, cfg.primary_caps_channels, cfg.primary_caps_kernel, cfg.primary_caps_stride)
            for _ in range(cfg.primary_caps_dim)
        )
        self.W = nn.Parameter(
            torch.zeros(1, cfg.num_primary_caps, cfg.num_classes, cfg.digit_caps_dim, cfg.primary_caps_dim)
        )

    @classmethod
    def from_capsnet(cls, model: CapsNet) -> "PublicStyleCapsNet":
        """The same network with `model`'s weights laid out the public way."""
        cfg = model.config
        public = cls(model)
        conv = model.primary_caps.conv
        caps, dim = cfg.primary_caps_channels, cfg.primary_caps_dim
        # Our conv's output channel c*dim + k is capsule channel c, dimension k.
        weight = conv.weight.detach().view(caps, dim, *conv.weight.shape[1:])  # (32, 8, 256, 9, 9)
        bias = conv.bias.detach().view(caps, dim)  # (32, 8)
        with torch.no_grad():
            for k, capsule_conv in enumerate(public.primary_caps):
                capsule_conv.weight.copy_(weight[:, k])
                capsule_conv.bias.copy_(bias[:, k])
            # Ours is (I, P, J*D) with [i, p, j*D + d] = W_ij[d, p].
            ours = model.digit_caps.weight.detach().view(
                cfg.num_primary_caps, cfg.primary_caps_dim, cfg.num_classes, cfg.digit_caps_dim
            )  # (1152, 8, 10, 16)
            public.W.copy_(ours.permute(0, 2, 3, 1).unsqueeze(0))  # (1, 1152, 10, 16, 8)
        return public.eval()

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images (B, C, H, W) in [0, 1] -> probabilities (B, J), poses (B, J, D)."""
        cfg = self.config
        features = torch.relu(self.conv1(self.normalised(images)))  # (B, 256, 20, 20)
        u = torch.stack([conv(features) for conv in self.primary_caps], dim=-1)  # (B, 32, 6, 6, 8)
        batch = u.shape[0]
        u = u.view(batch, cfg.num_primary_caps, cfg.primary_caps_dim)  # (B, 1152, 8)
        u = _squash(u, cfg.squash_constant)
        u = torch.stack([u] * cfg.num_classes, dim=2).unsqueeze(-1)  # (B, 1152, 10, 8, 1)
        u_hat = torch.matmul(self.W, u).squeeze(-1)  # (1, 1152, 10, 16, 8) @ (B, 1152, 10, 8, 1) -> (B, 1152, 10, 16)
        poses = route(u_hat, cfg.routing_iterations, cfg.routing, cfg.squash_constant).poses  # (B, 10, 16)
        return capsule_lengths(poses), poses


def _squash(s: Tensor, constant: float) -> Tensor:
    """The public implementations' squash: |s|² / (constant + |s|²) · s / |s|."""
    squared_norm = (s * s).sum(dim=-1, keepdim=True)
    return squared_norm / (constant + squared_norm) * s / torch.sqrt(squared_norm)
