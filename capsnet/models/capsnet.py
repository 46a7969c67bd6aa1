"""CapsNet (Sabour, Frosst & Hinton 2017): Conv1 → PrimaryCaps → DigitCaps with routing by agreement.

Everything is batch-agnostic and device-agnostic: no fixed-batch reshapes, no `.squeeze()`, no
state shared across the batch, and routing is a fixed number of plain tensor ops, so it traces to
ONNX with no Loop/If and an image's output does not depend on what it was batched with.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsnet.models.config import CapsNetConfig


def squash(s: Tensor, constant: float = 1.0, dim: int = -1) -> Tensor:
    """v = |s|² / (constant + |s|²) · s / |s|, written as s·|s| / (constant + |s|²).

    That form has no division by |s|, so it is finite at s = 0 with a finite gradient there
    (vector_norm's backward is 0 at 0), and it is computed in at least float32 so fp16/bf16
    inputs cannot overflow |s|².
    """
    wide = at_least_float32(s)
    norm = torch.linalg.vector_norm(wide, dim=dim, keepdim=True)
    return (wide * (norm / (constant + norm * norm))).to(s.dtype)


def at_least_float32(x: Tensor) -> Tensor:
    """fp16/bf16 -> float32; float32 and float64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def capsule_lengths(v: Tensor) -> Tensor:
    """Capsule lengths: the probability that each entity is present."""
    return torch.linalg.vector_norm(at_least_float32(v), dim=-1)


class RoutingResult(NamedTuple):
    poses: Tensor  # (B, J, D) output capsules v_j
    coupling: Tensor  # (B, I, J) coupling coefficients of the last iteration


def route(u_hat: Tensor, iterations: int, variant: str = "sabour", squash_constant: float = 1.0,
          detach_agreement: bool = False, uniform_sum: Tensor | None = None) -> RoutingResult:
    """Routing by agreement over predictions u_hat (B, J, I, D), per sample.

    With û laid out class-major, both sums over the input capsules are batched matrix products over
    (B, J): s_j = c_j · û_j and the agreement û_j · v_j. Each reads û once and writes only the small
    result, where an elementwise product then a sum would write and re-read a temporary of û's size.
    b starts at 0, so the first coupling is uniform (1/J, or 1/(J+1) with the leaky extra logit)
    and needs no softmax; `uniform_sum` (B, J, D) is Σ_i û_j|i where the caller has it cheaper than
    a pass over û. The logits of every later iteration are each sample's own.
    """
    batch, num_out, num_in, dim = u_hat.shape
    # Flattened after û's transpose, so ONNX Runtime materialises û once instead of fusing the
    # transpose into every MatMul below (each would then re-gather û; measured slower).
    flat = u_hat.reshape(batch * num_out, num_in, dim)  # (B*J, I, D)
    leaky = variant == "leaky"
    logits = coupling = v = None
    for iteration in range(iterations):
        if logits is None:
            total = u_hat.sum(dim=2) if uniform_sum is None else uniform_sum  # (B, J, D)
            s = total / float(num_out + leaky)  # (B, J, D): uniform coupling; a float divisor, as em_route's factors
        else:
            if leaky:
                # A zero logit for an extra "none of these" parent absorbs votes that fit no class.
                padded = F.pad(logits, (0, 0, 0, 1))  # (B, J+1, I)
                coupling = torch.softmax(padded, dim=1)[:, :num_out]  # (B, J, I)
            else:
                coupling = torch.softmax(logits, dim=1)  # (B, J, I): over the classes
            rows = coupling.reshape(batch * num_out, 1, num_in)  # (B*J, 1, I)
            s = torch.matmul(rows, flat)  # (B*J, 1, I) @ (B*J, I, D) -> (B*J, 1, D)
            s = s.view(batch, num_out, dim)  # (B, J, D)
        v = squash(s, squash_constant)  # (B, J, D)
        if iteration < iterations - 1:
            agreement = torch.matmul(flat, v.view(batch * num_out, dim, 1))  # (B*J, I, D) @ (B*J, D, 1) -> (B*J, I, 1)
            agreement = agreement.view(batch, num_out, num_in)  # (B, J, I)
            if detach_agreement:
                agreement = agreement.detach()
            logits = agreement if (logits is None or variant == "su") else logits + agreement
    assert v is not None  # iterations >= 1, as CapsNetConfig checks
    if coupling is None:
        return RoutingResult(v, u_hat.new_full((batch, num_in, num_out), 1.0 / (num_out + leaky)))  # (B, I, J)
    return RoutingResult(poses=v, coupling=coupling.transpose(1, 2))  # (B, I, J)


class PrimaryCaps(nn.Module):
    """A 9×9 stride-2 convolution whose channels are grouped into capsules, then squashed."""

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.num_caps_channels = config.primary_caps_channels
        self.caps_dim = config.primary_caps_dim
        self.squash_constant = config.squash_constant
        self.conv = nn.Conv2d(
            config.conv1_channels,
            config.primary_caps_channels * config.primary_caps_dim,
            kernel_size=config.primary_caps_kernel,
            stride=config.primary_caps_stride,
        )

    def forward(self, features: Tensor) -> Tensor:
        x = self.conv(features)  # (B, 32*8, 6, 6)
        batch, _, grid_h, grid_w = x.shape
        x = x.view(batch, self.num_caps_channels, self.caps_dim, grid_h, grid_w)  # (B, 32, 8, 6, 6)
        x = x.permute(0, 1, 3, 4, 2)  # (B, 32, 6, 6, 8): capsules ordered (channel, y, x)
        u = x.reshape(batch, -1, self.caps_dim)  # (B, 1152, 8)
        return squash(u, self.squash_constant)


class DigitCaps(nn.Module):
    """One learned 8→16 matrix W_ij per (input capsule i, class j), then routing."""

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.config = config
        num_in, num_out = config.num_primary_caps, config.num_classes
        # Stored as (I, P, J*D) so û for the whole batch is one batched MatMul over i.
        self.weight = nn.Parameter(
            0.01 * torch.randn(num_in, config.primary_caps_dim, num_out * config.digit_caps_dim)
        )

    def predictions(self, u: Tensor) -> Tensor:
        """û_j|i = W_ij · u_i for every pair, as one MatMul, laid out class-major for `route`."""
        cfg = self.config
        batch = u.shape[0]
        u_hat = torch.matmul(u.transpose(0, 1), self.weight)  # (I, B, P) @ (I, P, J*D) -> (I, B, J*D)
        u_hat = u_hat.view(cfg.num_primary_caps, batch, cfg.num_classes, cfg.digit_caps_dim)  # (1152, B, 10, 16)
        return u_hat.permute(1, 2, 0, 3)  # (B, 10, 1152, 16)

    def forward(self, u: Tensor) -> RoutingResult:
        cfg = self.config
        batch, num_in, caps_dim = u.shape
        # Σ_i û_j|i = Σ_i W_ij u_i is one GEMM of u by W, so the uniform first iteration reads W, not û.
        total = u.reshape(batch, num_in * caps_dim) @ self.weight.view(num_in * caps_dim, -1)  # (B, I*P) @ (I*P, J*D)
        return route(
            self.predictions(u),
            uniform_sum=total.view(batch, cfg.num_classes, cfg.digit_caps_dim),  # (B, J, D)
            iterations=cfg.routing_iterations,
            variant=cfg.routing,
            squash_constant=cfg.squash_constant,
            detach_agreement=cfg.detach_agreement,
        )


class Decoder(nn.Module):
    """Reconstructs the image from the poses, all capsules but one masked to zero."""

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        widths = [config.num_classes * config.digit_caps_dim, *config.decoder_hidden]
        layers: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU(inplace=True)]
        layers += [nn.Linear(widths[-1], config.input_size), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)
        self.num_classes = config.num_classes

    def forward(self, poses: Tensor, target: Tensor) -> Tensor:
        """poses (B, J, D), target (B,) class indices -> (B, C*H*W) in [0, 1]."""
        # A comparison with arange (not one_hot of a traced value) keeps the mask a graph op.
        classes = torch.arange(self.num_classes, device=poses.device)  # (J,)
        mask = (classes.unsqueeze(0) == target.unsqueeze(1)).to(poses.dtype)  # (B, J)
        masked = poses * mask.unsqueeze(-1)  # (B, J, D)
        return self.net(masked.flatten(1))  # (B, J*D) -> (B, C*H*W)


class InputNormalisation(nn.Module):
    """The config's per-channel mean/std, applied inside the model so exported graphs take [0, 1] images.
    Buffers, not weights: they come from the config and stay out of the state dict."""

    mean: Tensor  # (1, C, 1, 1)
    std: Tensor  # (1, C, 1, 1)

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        channels = config.in_channels
        self.identity = config.input_mean == (0.0,) and config.input_std == (1.0,)
        mean = torch.tensor(config.input_mean, dtype=torch.float32).expand(channels)
        std = torch.tensor(config.input_std, dtype=torch.float32).expand(channels)
        self.register_buffer("mean", mean.reshape(1, channels, 1, 1).clone(), persistent=False)  # (1, C, 1, 1)
        self.register_buffer("std", std.reshape(1, channels, 1, 1).clone(), persistent=False)  # (1, C, 1, 1)

    def forward(self, images: Tensor) -> Tensor:
        return images if self.identity else (images - self.mean) / self.std


class CapsNetOutput(NamedTuple):
    probabilities: Tensor  # (B, J) capsule lengths
    poses: Tensor  # (B, J, D)
    reconstruction: Tensor  # (B, C*H*W)
    coupling: Tensor  # (B, I, J)


class CapsNet(nn.Module):
    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.config = config
        self.input_normalisation = InputNormalisation(config)
        self.conv1 = nn.Conv2d(config.in_channels, config.conv1_channels, kernel_size=config.conv1_kernel)
        self.primary_caps = PrimaryCaps(config)
        self.digit_caps = DigitCaps(config)
        self.decoder = Decoder(config)

    def normalised(self, images: Tensor) -> Tensor:
        return self.input_normalisation(images)

    def forward(self, images: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        """images (B, C, H, W) in [0, 1]; the decoder is masked by `target` if given, else by the prediction."""
        features = F.relu(self.conv1(self.normalised(images)))  # (B, 256, 20, 20)
        u = self.primary_caps(features)  # (B, 1152, 8)
        poses, coupling = self.digit_caps(u)  # (B, 10, 16), (B, 1152, 10)
        probabilities = capsule_lengths(poses)  # (B, 10)
        if target is None:
            target = probabilities.argmax(dim=1)  # (B,)
        reconstruction = self.decoder(poses, target)  # (B, C*H*W)
        return CapsNetOutput(probabilities, poses, reconstruction, coupling)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
