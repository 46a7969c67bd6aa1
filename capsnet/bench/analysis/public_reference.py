"""The most-used public PyTorch CapsNet's formulation, re-implemented as the speed baseline.

NOT our model and no code taken from the project: a re-implementation, for benchmarking only, of how
XifengGuo/CapsNet-Pytorch (`capsulelayers.py`, `capsulenet.py`), the most-used public PyTorch CapsNet,
computes a forward pass:
- PrimaryCaps as one 256-channel Conv2d, its output cut into 8-dimensional capsules and squashed as
  |s|² / (1 + |s|²) / (|s| + 1e-8) · s;
- DigitCaps weights W as one (10, 1152, 16, 8) parameter, û = W @ u[:, None, :, :, None] as a broadcast
  `torch.matmul` (one 16×8 by 8×1 product per capsule pair), û (B, 10, 1152, 16);
- routing logits b (B, 10, 1152) from zeros, c = softmax(b) over the 10 classes in every iteration
  (the first one too), s = Σ_i c·û as an elementwise product then a sum, b += Σ_d v·û, and û detached in
  every iteration but the last;
- lengths as the class probabilities, then the decoder on the capsules masked by a one-hot of the
  predicted class, as the public code's evaluation runs it.

One deviation, so that our weights give our outputs and both backends' accuracies compare: the public code
cuts capsules with `x.view(B, -1, 8)`, which groups 8 neighbouring grid positions of one channel; a
capsule here is 8 channels at one position (Sabour et al.'s grouping, our model's). That costs one copy of
the (B, 256, 6, 6) PrimaryCaps output, under 0.1% of the work. Its routing is the paper's (b += û·v,
squash constant 1): a model trained with another routing variant has no public counterpart.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsnet.errors import CapsNetError
from capsnet.models.capsnet import CapsNet

SOURCE = "XifengGuo/CapsNet-Pytorch"
DESCRIBED_IN = "capsnet/bench/analysis/public_reference.py"


class PublicCapsNet(nn.Module):
    def __init__(self, model: nn.Module):
        """The same network with copies of `model`'s weights, laid out the public way."""
        super().__init__()
        if not isinstance(model, CapsNet):
            raise CapsNetError(f"{SOURCE} is the dynamic-routing CapsNet; this checkpoint holds a "
                               f"{type(model).__name__}")
        cfg = model.config
        if cfg.routing != "sabour" or cfg.squash_constant != 1.0:
            raise CapsNetError(f"{SOURCE} routes as the paper does (b += û·v, squash constant 1); this model uses "
                               f"routing {cfg.routing!r} with squash constant {cfg.squash_constant:g}")
        self.config = cfg
        # the identity for [0, 1] images, as the public code takes
        self.normalised = copy.deepcopy(model.input_normalisation)
        self.conv1 = copy.deepcopy(model.conv1)
        self.primary_caps = copy.deepcopy(model.primary_caps.conv)  # one Conv2d, 256 output channels
        self.decoder = copy.deepcopy(model.decoder.net)
        # Ours is (I, P, J*D) with [i, p, j*D + d] = W_ij[d, p].
        ours = model.digit_caps.weight.detach().view(
            cfg.num_primary_caps, cfg.primary_caps_dim, cfg.num_classes, cfg.digit_caps_dim
        )  # (1152, 8, 10, 16)
        grouped = ours.permute(2, 0, 3, 1).clone(memory_format=torch.contiguous_format)  # (10, 1152, 16, 8)
        self.weight = nn.Parameter(grouped)  # (10, 1152, 16, 8)
        self.eval()

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """images (B, C, H, W) in [0, 1] -> probabilities (B, J), poses (B, J, D), reconstruction (B, C*H*W)."""
        cfg = self.config
        features = F.relu(self.conv1(self.normalised(images)))  # (B, 256, 20, 20)
        x = self.primary_caps(features)  # (B, 256, 6, 6)
        batch, _, grid_h, grid_w = x.shape
        x = x.view(batch, cfg.primary_caps_channels, cfg.primary_caps_dim, grid_h, grid_w)  # (B, 32, 8, 6, 6)
        u = _squash(x.permute(0, 1, 3, 4, 2).reshape(batch, -1, cfg.primary_caps_dim))  # (B, 1152, 8)
        poses = self._route(u)  # (B, 10, 16)
        probabilities = poses.norm(dim=-1)  # (B, 10)
        one_hot = torch.zeros_like(probabilities).scatter_(1, probabilities.argmax(dim=1, keepdim=True), 1.0)  # (B, 10)
        reconstruction = self.decoder((poses * one_hot[:, :, None]).view(batch, -1))  # (B, 784)
        return probabilities, poses, reconstruction

    def _route(self, u: Tensor) -> Tensor:
        # (10, 1152, 16, 8) @ (B, 1, 1152, 8, 1) -> (B, 10, 1152, 16, 1) -> (B, 10, 1152, 16)
        u_hat = torch.matmul(self.weight, u[:, None, :, :, None]).squeeze(-1)
        u_hat_detached = u_hat.detach()
        b = u.new_zeros(u.shape[0], self.config.num_classes, self.config.num_primary_caps)  # (B, 10, 1152)
        iterations = self.config.routing_iterations
        for iteration in range(iterations):
            c = F.softmax(b, dim=1)  # (B, 10, 1152): over the classes
            votes = u_hat if iteration == iterations - 1 else u_hat_detached
            outputs = _squash(torch.sum(c[:, :, :, None] * votes, dim=-2, keepdim=True))  # (B, 10, 1, 16)
            if iteration < iterations - 1:
                b = b + torch.sum(outputs * u_hat_detached, dim=-1)  # (B, 10, 1152)
        return outputs.squeeze(-2)  # (B, 10, 16)


def _squash(s: Tensor) -> Tensor:
    """The public code's squash: |s|² / (1 + |s|²) / (|s| + 1e-8) · s."""
    norm = torch.norm(s, p=2, dim=-1, keepdim=True)
    return norm**2 / (1 + norm**2) / (norm + 1e-8) * s
