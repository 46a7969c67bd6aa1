"""Matrix capsules with EM routing (Hinton, Sabour & Frosst 2018): `capsnet train --arch em`.

ReLU Conv1 (5×5, stride 2; batch-normalised with `em_batch_norm`) → an optional second ReLU convolution
(`em_conv2_channels`, 3×3) → an optional third (`em_conv3_channels`, 3×3, batch-normalised with
`em_batch_norm`) → PrimaryCaps (1×1 convolutions: a 4×4 pose matrix, batch-normalised with
`em_batch_norm`, and a logistic activation per capsule type and position) → ConvCaps1 (3×3, stride 2) →
ConvCaps2 (3×3, stride 1) → ClassCaps (one transform per input type shared over positions, with coordinate
addition). Every capsule layer votes V_ij = M_i · W_ij and is routed by a fixed number of EM iterations
(`em_route`).

The model returns the CapsNet's outputs, so training, export and serving take it unchanged:
probabilities = class activations, poses = the class pose matrices flattened to 16, reconstruction =
a decoder masked by one class, coupling = the class layer's last assignments R.

As in most public implementations, a convolutional capsule layer routes each K×K patch on its own: an
input capsule's assignments are normalised over the parents of each patch it is in, rather than over
every parent that receives one of its votes (Gritzman 2019's competition across positions did not learn
faster here: docs/experiments).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsnet.models.config import CapsNetConfig
from capsnet.models.capsnet import CapsNetOutput, Decoder, InputNormalisation, at_least_float32

POSE = 4  # poses are POSE×POSE matrices
EPSILON = 1e-6  # keeps σ² and the normalisations away from 0 when inputs are inactive


class EMResult(NamedTuple):
    poses: Tensor  # (..., J, 16) means μ_j of the votes
    activations: Tensor  # (..., J) in (0, 1)
    assignments: Tensor  # (..., I, J) the last iteration's R_ij


def inverse_temperatures(iterations: int, final: float) -> list[float]:
    """λ per iteration, rising towards `final` as final·(1 − 0.95^t) for t = 1, 2, ... (the paper gives no
    schedule; this is Gritzman 2019's). λ stays small because the cost grows with the number of inputs and
    a large λ saturates the logistic."""
    return [final * (1 - 0.95 ** (t + 1)) for t in range(iterations)]


def full_precision(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off: E[V²] − μ² and the Gaussian log-likelihoods lose everything in bf16/fp16 matmuls.
    A no-op context when autocast is off, so exported graphs stay plain."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def em_route(votes: Tensor, activations: Tensor, beta_u: Tensor, beta_a: Tensor, iterations: int,
             final_inverse_temperature: float, normalise: Callable[[Tensor], Tensor] | None = None) -> EMResult:
    """EM routing of votes V (..., J, I, H) from I capsules with activations a (..., I) to J parents.

    M-step: μ, σ² as the R·a-weighted mean and variance of the votes per dimension h;
    cost_j = Σ_h (β_u + log σ_jh) Σ_i R_ij a_i; a_j = logistic(λ(β_a − cost_j)).
    E-step: R_ij ∝ a_j p_j(V_ij), p a Gaussian with diagonal σ², normalised over j (in log space).
    R starts uniform; the E-step after the last M-step is skipped. Leading axes (batch, positions)
    are independent, so every sample and patch is routed on its own. `normalise`, if given, replaces the
    softmax over the J parents, for R and for its uniform start (from zeros): scripts/experiments uses it
    to let parents at different positions compete for an input.

    The votes are laid out parent-major so both steps are matrix products over [V, V²], which is
    computed once: the weighted moments give μ and σ² = E[V²] − μ², and Σ_h (V − μ)²/σ² expands into
    products with V and V². Nothing of the votes' size is made per iteration.
    """
    with full_precision(votes.device.type):
        votes = at_least_float32(votes)
        pose_size = votes.shape[-1]
        moments = torch.cat([votes, votes.square()], dim=-1)  # (..., J, I, 2H)
        input_activations = at_least_float32(activations).unsqueeze(-2)  # (..., 1, I)
        if normalise is None:
            assignments = torch.full_like(votes[..., 0], 1.0 / votes.shape[-3])  # (..., J, I)
        else:
            assignments = normalise(torch.zeros_like(votes[..., 0]))  # (..., J, I)
        log_norm = 0.5 * pose_size * math.log(2 * math.pi)
        schedule = inverse_temperatures(iterations, final_inverse_temperature)
        for iteration, inverse_temperature in enumerate(schedule):
            # M-step
            weights = assignments * input_activations  # (..., J, I)
            weight_sums = weights.sum(dim=-1, keepdim=True)  # (..., J, 1)
            coefficients = weights / weight_sums.clamp_min(EPSILON)  # (..., J, I): sums to 1 over i
            weighted_moments = torch.matmul(coefficients.unsqueeze(-2), moments).select(-2, 0)  # (..., J, 2H)
            mean, mean_square = weighted_moments.split(pose_size, dim=-1)  # (..., J, H) each
            variance = (mean_square - mean.square()).clamp_min(0.0) + EPSILON  # (..., J, H)
            log_sigma = 0.5 * torch.log(variance)  # (..., J, H)
            # float factors here and below: torch 2.11's ONNX exporter turns an int scalar of a float product into
            # a scalar tensor and failed to re-dispatch the product ("Expected same OpOverload packet, got
            # prim.device != aten.mul"); tests/export/test_export_graph.py keeps every architecture free of them
            cost = (float(pose_size) * beta_u + log_sigma.sum(dim=-1)) * weight_sums.select(-1, 0)  # (..., J)
            parent_activations = torch.sigmoid(inverse_temperature * (beta_a - cost))  # (..., J)
            if iteration == iterations - 1:
                break
            # E-step: −Σ_h (V − μ)²/(2σ²) = Σ_h (2μ/(2σ²))·V − (1/(2σ²))·V² − μ²/(2σ²)
            precision = 0.5 / variance  # (..., J, H)
            linear = torch.cat([2.0 * precision * mean, -precision], dim=-1).unsqueeze(-2)  # (..., J, 1, 2H)
            # a row times the transposed moments: as a matrix-vector product over [V, V²] this ran ~1.4x slower
            exponent = torch.matmul(linear, moments.transpose(-1, -2)).select(-2, 0)  # (..., J, I)
            offsets = (mean.square() * precision + log_sigma).sum(dim=-1, keepdim=True) + log_norm  # (..., J, 1)
            log_p = exponent - offsets  # (..., J, I)
            log_prior = torch.log(parent_activations + EPSILON).unsqueeze(-1)  # (..., J, 1)
            logits = log_prior + log_p  # (..., J, I)
            assignments = torch.softmax(logits, dim=-2) if normalise is None else normalise(logits)  # (..., J, I)
    return EMResult(poses=mean, activations=parent_activations, assignments=assignments.transpose(-1, -2))


def patches(x: Tensor, kernel: int, stride: int) -> Tensor:
    """The K×K patches of a capsule grid: (B, H, W, N, ...) -> (B, H', W', K*K*N, ...), as strided slices."""
    height, width = x.shape[1], x.shape[2]
    out_h, out_w = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    views = [x[:, dy : dy + stride * (out_h - 1) + 1 : stride, dx : dx + stride * (out_w - 1) + 1 : stride]
             for dy in range(kernel) for dx in range(kernel)]  # K*K of (B, H', W', N, ...)
    return torch.stack(views, dim=3).flatten(3, 4)  # (B, H', W', K*K, N, ...) -> (B, H', W', K*K*N, ...)


def votes_from(poses: Tensor, transforms: Tensor) -> Tensor:
    """V_ij = M_i · W_ij: poses (B, ..., I, 16), transforms (I, J, 4, 4) -> votes (B, ..., J, I, 16).

    One batched MatMul over the inputs i, each the rows of all of i's poses times [W_i1 ... W_iJ],
    rather than millions of 4×4 products.
    """
    num_out = transforms.shape[1]
    positions = poses.shape[1:-2]  # the static axes between batch and inputs
    rows = poses.unflatten(-1, (POSE, POSE)).movedim(-3, 0).flatten(1, -2)  # (I, B*...*4, 4)
    weights = transforms.permute(0, 2, 1, 3).flatten(2)  # (I, 4, J*4)
    products = torch.matmul(rows, weights)  # (I, B*...*4, J*4)
    products = products.unflatten(1, (-1, *positions, POSE)).unflatten(-1, (num_out, POSE))  # (I, B, ..., 4, J, 4)
    leading = len(positions) + 1
    order = [*range(1, leading + 1), leading + 2, 0, leading + 1, leading + 3]
    return products.permute(order).flatten(-2)  # (B, ..., J, I, 4, 4) -> (B, ..., J, I, 16)


class EMCapsLayer(nn.Module):
    """What every EM capsule layer learns: transforms and the cost/activation offsets β_u, β_a per parent."""

    def __init__(self, num_inputs: int, num_parents: int, config: CapsNetConfig):
        super().__init__()
        # Identity plus noise: votes start near the input poses, so early routing sees structure.
        identity = torch.eye(POSE).expand(num_inputs, num_parents, POSE, POSE)
        self.transforms = nn.Parameter(identity + 0.5 * torch.randn(num_inputs, num_parents, POSE, POSE))
        self.beta_u = nn.Parameter(torch.zeros(num_parents))
        self.beta_a = nn.Parameter(torch.zeros(num_parents))
        self.iterations = config.routing_iterations
        self.inverse_temperature = config.em_inverse_temperature

    def route(self, votes: Tensor, activations: Tensor) -> EMResult:
        return em_route(votes, activations, self.beta_u, self.beta_a, self.iterations, self.inverse_temperature)


class ConvCaps(EMCapsLayer):
    """A convolutional capsule layer: each K×K patch of N-type capsules routes to the M types at its output position."""

    def __init__(self, in_types: int, out_types: int, kernel: int, stride: int, config: CapsNetConfig):
        super().__init__(kernel * kernel * in_types, out_types, config)
        self.kernel, self.stride = kernel, stride

    def forward(self, poses: Tensor, activations: Tensor) -> tuple[Tensor, Tensor]:
        """poses (B, H, W, N, 16), activations (B, H, W, N) -> (B, H', W', M, 16), (B, H', W', M)."""
        pose_patches = patches(poses, self.kernel, self.stride)  # (B, H', W', K*K*N, 16)
        activation_patches = patches(activations, self.kernel, self.stride)  # (B, H', W', K*K*N)
        routed = self.route(votes_from(pose_patches, self.transforms), activation_patches)
        return routed.poses, routed.activations


class ClassCaps(EMCapsLayer):
    """Class capsules: every position of an input type shares its transforms, and the votes get the
    position's scaled (row, column) centre added to their first two entries (coordinate addition)."""

    coordinate_offsets: Tensor  # (H, W, 1, 1, 16), a buffer

    def __init__(self, in_types: int, grid: tuple[int, int], num_classes: int, config: CapsNetConfig):
        super().__init__(in_types, num_classes, config)
        rows = (torch.arange(grid[0], dtype=torch.float32) + 0.5) / grid[0]  # (H,)
        cols = (torch.arange(grid[1], dtype=torch.float32) + 0.5) / grid[1]  # (W,)
        offsets = torch.zeros(grid[0], grid[1], 1, 1, POSE * POSE)  # (H, W, 1, 1, 16): broadcast over J, N
        offsets[..., 0] = rows.view(-1, 1, 1, 1)  # (H, 1, 1, 1)
        offsets[..., 1] = cols.view(1, -1, 1, 1)  # (1, W, 1, 1)
        self.register_buffer("coordinate_offsets", offsets, persistent=False)

    def forward(self, poses: Tensor, activations: Tensor) -> EMResult:
        """poses (B, H, W, N, 16), activations (B, H, W, N) -> class poses (B, J, 16), activations (B, J)."""
        votes = votes_from(poses, self.transforms) + self.coordinate_offsets  # (B, H, W, J, N, 16)
        votes = votes.permute(0, 3, 1, 2, 4, 5).flatten(2, 4)  # (B, J, H*W*N, 16)
        return self.route(votes, activations.flatten(1, 3))  # activations (B, H*W*N)


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """Batch normalisation whose running statistics follow the last batches closely (momentum 0.9, not torch's
    0.1): evaluation and serving use them, and statistics that lag the weights by a few steps of Adam at 0.01
    scored 5 points lower on the validation split than the same weights with fresh statistics."""
    return nn.BatchNorm2d(channels, momentum=0.9)


class PrimaryMatrixCaps(nn.Module):
    """1×1 convolutions: a 4×4 pose and a logistic activation for each capsule type at each position.

    With `normalise_poses` every pose entry is batch-normalised. The poses' scale sets the votes' σ and so
    every layer's cost and activations; without a normalisation it follows the front end's width and depth,
    and a wider or deeper front end made training collapse (docs/experiments).
    """

    def __init__(self, in_channels: int, types: int, normalise_poses: bool = False):
        super().__init__()
        self.types = types
        self.pose = nn.Conv2d(in_channels, types * POSE * POSE, kernel_size=1)
        self.activation = nn.Conv2d(in_channels, types, kernel_size=1)
        # Identity when off: checkpoints of models without it keep their parameter names
        self.pose_norm = batch_norm(types * POSE * POSE) if normalise_poses else nn.Identity()

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """features (B, A, H, W) -> poses (B, H, W, N, 16), activations (B, H, W, N)."""
        poses = self.pose_norm(self.pose(features)).unflatten(1, (self.types, POSE * POSE))  # (B, N, 16, H, W)
        activations = torch.sigmoid(self.activation(features))  # (B, N, H, W)
        return poses.permute(0, 3, 4, 1, 2), activations.permute(0, 2, 3, 1)  # (B, H, W, N, 16), (B, H, W, N)


class EMCapsNet(nn.Module):
    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.config = config
        self.input_normalisation = InputNormalisation(config)
        first_types, second_types = config.conv_caps_types
        self.conv1 = nn.Conv2d(config.in_channels, config.conv1_channels, kernel_size=config.conv1_kernel, stride=2,
                               padding=config.conv1_kernel // 2)
        self.conv1_norm = batch_norm(config.conv1_channels) if config.em_batch_norm else nn.Identity()
        # The capsule layers are close to linear in the primary poses (docs/experiments), so the features'
        # nonlinearity comes from the front end: Conv1 alone capped accuracy near 93%.
        features = config.conv1_channels
        self.conv2 = self.conv3 = None
        if config.em_conv2_channels:
            self.conv2 = nn.Conv2d(features, config.em_conv2_channels, kernel_size=3, padding=1)
            features = config.em_conv2_channels
        if config.em_conv3_channels:
            self.conv3 = nn.Conv2d(features, config.em_conv3_channels, kernel_size=3, padding=1)
            self.conv3_norm = batch_norm(config.em_conv3_channels) if config.em_batch_norm else nn.Identity()
            features = config.em_conv3_channels
        self.primary_caps = PrimaryMatrixCaps(features, config.primary_caps_channels, config.em_batch_norm)
        self.conv_caps1 = ConvCaps(config.primary_caps_channels, first_types, kernel=3, stride=2, config=config)
        self.conv_caps2 = ConvCaps(first_types, second_types, kernel=3, stride=1, config=config)
        self.class_caps = ClassCaps(second_types, config.em_grids[-1], config.num_classes, config)
        self.decoder = Decoder(config)

    def features(self, images: Tensor) -> Tensor:
        """The convolutional front end: images (B, C, H, W) -> features (B, A, 14, 14) for PrimaryCaps."""
        features = F.relu(self.conv1_norm(self.conv1(self.input_normalisation(images))))  # (B, A, 14, 14)
        if self.conv2 is not None:
            features = F.relu(self.conv2(features))  # (B, A2, 14, 14)
        if self.conv3 is not None:
            features = F.relu(self.conv3_norm(self.conv3(features)))  # (B, A3, 14, 14)
        return features

    def forward(self, images: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        """images (B, C, H, W) in [0, 1]; the decoder is masked by `target` if given, else by the prediction."""
        # capsule types: P = primary_caps_channels, (C, D) = conv_caps_types; 8, 8 and 8 in the `em` preset
        poses, activations = self.primary_caps(self.features(images))  # (B, 14, 14, P, 16), (B, 14, 14, P)
        poses, activations = self.conv_caps1(poses, activations)  # (B, 6, 6, C, 16), (B, 6, 6, C)
        poses, activations = self.conv_caps2(poses, activations)  # (B, 4, 4, D, 16), (B, 4, 4, D)
        routed = self.class_caps(poses, activations)  # poses (B, 10, 16), activations (B, 10)
        if target is None:
            target = routed.activations.argmax(dim=1)  # (B,)
        reconstruction = self.decoder(routed.poses, target)  # (B, C*H*W)
        return CapsNetOutput(routed.activations, routed.poses, reconstruction, routed.assignments)
