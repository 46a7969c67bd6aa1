"""Train the `em` preset with one or more variants, for the EM diagnosis in docs/experiments/README.md. The
variants not adopted are patched in here rather than made model options; each patch says what it changes.
With no variant it trains what `capsnet train --arch em` trains. The earlier presets of the docs' tables:
`conv3=0 schedule=exponential` until issue 16's seventh session, `conv2=0 conv3=0 no-batch-norm schedule=exponential`
before its fifth; the rows with `conv3=N` before the seventh added that convolution by a patch (the same layers,
initialised in another order), those with `lr-decay=X` had `schedule=exponential`.

Usage: python scripts/experiments/em_variants.py NAME [--epochs 3] [--seed 0] [--out-dir /tmp] [VARIANT ...]
VARIANT: bn | direct-moments | no-reconstruction | logit-ce (cross-entropy on the class logits) | margin-per-step |
         renormalise-r | transforms-normal | logit-beta | logit-beta-a | lr=X | iterations=N | lambda=X |
         class-lambda=X (the class layer's alone) | conv1=N | types=N (ConvCaps1 and 2) | max-shift=N | lr-decay=X |
         margin-start=X | margin-step=X (the spread margin's start and its rise per epoch; 0.2 and 0.1) |
         conv2=N (em_conv2_channels; 0: none) | batch-norm | no-batch-norm (em_batch_norm) |
         conv3=N (em_conv3_channels; 0: none) | schedule=linear|exponential (--lr-schedule) | warmup=X |
         cross-position | ibm-cost | pose-ln |
         linear-head | conv-body (diagnosis only: parts of the model replaced by ordinary layers)
Prints one JSON line: the variants and (epoch, validation %, test %) per epoch. Embedded data, its default 10%
validation split, batch 64, fp32, one thread.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from capsnet.training import config as config_module
from capsnet.training import em_model
from capsnet.training import train as train_module
from capsnet.training.loss import LossParts, reconstruction_error, spread_loss
from capsnet.training.train import TrainOptions, train

EMBEDDED_TRAIN_IMAGES = 3600  # after the validation split


def conv1_batch_norm() -> None:
    """yl-1993: batch normalisation between Conv1 and its ReLU (as `batch-norm` does, which came later; with it on,
    this adds a second)."""
    original_init = em_model.EMCapsNet.__init__

    def init(self, config):
        original_init(self, config)
        self.conv1 = nn.Sequential(self.conv1, nn.BatchNorm2d(config.conv1_channels))

    em_model.EMCapsNet.__init__ = init


def margin_per_step(epochs: int) -> None:
    """The spread margin rises linearly per step from 0.2 to 0.9 over the whole run (not 0.1 per epoch)."""
    total_steps, state = epochs * (EMBEDDED_TRAIN_IMAGES // 64), {"step": 0}
    original = train_module.capsnet_loss

    def loss(output, images, labels, config, epoch=None):
        if epoch is None:
            return original(output, images, labels, config, None)
        state["step"] += output.probabilities.requires_grad
        margin = spread_loss(output.probabilities, labels, min(0.9, 0.2 + 0.7 * state["step"] / total_steps))
        reconstruction = reconstruction_error(output.reconstruction, images)
        return LossParts((margin + config.reconstruction_weight * reconstruction).mean(), margin, reconstruction)

    train_module.capsnet_loss = loss


def logit_cross_entropy() -> None:
    """Cross-entropy on the class activations' logits λ(β_a − cost) instead of the spread loss on activations
    that never fall below 0.5, which bounds the gap the spread loss can open."""
    original = train_module.capsnet_loss

    def loss(output, images, labels, config, epoch=None):
        logits = torch.logit(output.probabilities.float(), eps=1e-6)  # (B, J)
        classification = F.cross_entropy(logits, labels, reduction="none")  # (B,)
        reconstruction = reconstruction_error(output.reconstruction, images)  # (B,)
        return LossParts((classification + config.reconstruction_weight * reconstruction).mean(), classification,
                         reconstruction)

    train_module.capsnet_loss = loss


def renormalise_r() -> None:
    """yl-1993: R·a renormalised over the parents before the M-step, which cancels the input activations."""
    original = em_model.em_route
    em_model.em_route = lambda votes, activations, *rest: original(votes, torch.ones_like(activations), *rest)


def transforms_normal() -> None:
    """yl-1993: W ~ N(0, 1) instead of the identity plus 0.5·N(0, 1)."""
    original = em_model.EMCapsLayer.__init__

    def init(self, num_inputs, num_parents, config):
        original(self, num_inputs, num_parents, config)
        with torch.no_grad():
            self.transforms.normal_()

    em_model.EMCapsLayer.__init__ = init


def logit_beta(both: bool) -> None:
    """β_a (and with `both` β_u) learned in units of the last iteration's λ, so an Adam step moves the
    activation's logit by about the learning rate instead of λ times it."""
    def route(self, votes, activations):
        scale = em_model.inverse_temperatures(self.iterations, self.inverse_temperature)[-1]
        beta_u = self.beta_u / scale if both else self.beta_u
        return em_model.em_route(votes, activations, beta_u, self.beta_a / scale, self.iterations,
                                 self.inverse_temperature)

    em_model.EMCapsLayer.route = route


def direct_moments() -> None:
    """σ² as Σ_i c_ij (V − μ)² and the E-step's exponent as Σ_h (V − μ)²/(2σ²), computed from the centred
    votes (a votes-sized pass per step), instead of E[V²] − μ² and its expansion, which cancel in float32
    when σ² is far below μ²."""
    import math

    def route(votes, activations, beta_u, beta_a, iterations, final_inverse_temperature):
        with em_model.full_precision(votes.device.type):
            votes = em_model.at_least_float32(votes)  # (..., J, I, H)
            num_parents, pose_size = votes.shape[-3], votes.shape[-1]
            input_activations = em_model.at_least_float32(activations).unsqueeze(-2)  # (..., 1, I)
            assignments = torch.full_like(votes[..., 0], 1.0 / num_parents)  # (..., J, I)
            log_norm = 0.5 * pose_size * math.log(2 * math.pi)
            schedule = em_model.inverse_temperatures(iterations, final_inverse_temperature)
            for iteration, inverse_temperature in enumerate(schedule):
                weights = assignments * input_activations  # (..., J, I)
                weight_sums = weights.sum(dim=-1, keepdim=True)  # (..., J, 1)
                coefficients = weights / weight_sums.clamp_min(em_model.EPSILON)  # (..., J, I)
                mean = torch.matmul(coefficients.unsqueeze(-2), votes)  # (..., J, 1, H)
                centred_square = (votes - mean).square()  # (..., J, I, H)
                variance = torch.matmul(coefficients.unsqueeze(-2), centred_square) + em_model.EPSILON  # (..., J, 1, H)
                log_sigma = 0.5 * torch.log(variance)  # (..., J, 1, H)
                cost = (pose_size * beta_u + log_sigma.sum(dim=(-1, -2))) * weight_sums.select(-1, 0)  # (..., J)
                parent_activations = torch.sigmoid(inverse_temperature * (beta_a - cost))  # (..., J)
                if iteration == iterations - 1:
                    break
                log_p = -(centred_square / (2 * variance)).sum(dim=-1) - log_sigma.sum(dim=-1) - log_norm  # (..., J, I)
                log_prior = torch.log(parent_activations + em_model.EPSILON).unsqueeze(-1)  # (..., J, 1)
                assignments = torch.softmax(log_prior + log_p, dim=-2)  # (..., J, I)
        return em_model.EMResult(poses=mean.squeeze(-2), activations=parent_activations,
                                 assignments=assignments.transpose(-1, -2))

    em_model.em_route = route


def class_lambda(final: float) -> None:
    """The class capsules' λ schedule ends at `final`; the convolutional capsule layers keep the preset's."""
    original = em_model.ClassCaps.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.inverse_temperature = final

    em_model.ClassCaps.__init__ = init


def child_slots(values, height: int, width: int, kernel: int, stride: int):
    """The inverse of `patches`: (B, H', W', K*K, N) per patch slot -> (B, H, W, K*K, N) per input capsule and
    the slot it fills in each patch it is in; a slot with no patch holds the dtype's lowest value."""
    out_h, out_w = values.shape[1], values.shape[2]
    grid = values.new_full((values.shape[0], height, width, *values.shape[3:]), torch.finfo(values.dtype).min)
    for dy in range(kernel):
        for dx in range(kernel):
            grid[:, dy : dy + stride * (out_h - 1) + 1 : stride, dx : dx + stride * (out_w - 1) + 1 : stride,
                 dy * kernel + dx] = values[:, :, :, dy * kernel + dx]
    return grid


def cross_position() -> None:
    """Gritzman 2019's pitfall 3: an input capsule's assignments are normalised over every parent of every patch
    it is in (positions and types), not over the parents of each patch on its own."""
    def forward(self, poses, activations):
        height, width, types = poses.shape[1], poses.shape[2], poses.shape[3]

        def normalise(logits):  # (B, H', W', J, K*K*N)
            per_patch = torch.logsumexp(logits, dim=-2).unflatten(-1, (self.kernel ** 2, types))  # (B, H', W', K*K, N)
            slots = child_slots(per_patch, height, width, self.kernel, self.stride)  # (B, H, W, K*K, N)
            per_input = torch.logsumexp(slots, dim=3)  # (B, H, W, N)
            return torch.exp(logits - em_model.patches(per_input, self.kernel, self.stride).unsqueeze(-2))

        pose_patches = em_model.patches(poses, self.kernel, self.stride)  # (B, H', W', K*K*N, 16)
        activation_patches = em_model.patches(activations, self.kernel, self.stride)  # (B, H', W', K*K*N)
        routed = em_model.em_route(em_model.votes_from(pose_patches, self.transforms), activation_patches,
                                   self.beta_u, self.beta_a, self.iterations, self.inverse_temperature, normalise)
        return routed.poses, routed.activations

    em_model.ConvCaps.forward = forward


def ibm_cost() -> None:
    """IBM's (Gritzman 2019) cost scale and β_a: the cost times 100·J/I (I inputs per routing problem, J parents)
    and β_a drawn from N(−1000, 500²) truncated at 2σ, in those units; written as λ·s and β_a/s."""
    original = em_model.EMCapsLayer.__init__

    def init(self, num_inputs, num_parents, config):
        original(self, num_inputs, num_parents, config)
        positions = config.em_grids[-1][0] * config.em_grids[-1][1] if isinstance(self, em_model.ClassCaps) else 1
        inputs = num_inputs * positions
        scale = 100 * num_parents / inputs
        self.inverse_temperature *= scale
        with torch.no_grad():
            nn.init.trunc_normal_(self.beta_a, -1000.0, 500.0, -2000.0, 0.0).div_(scale)

    em_model.EMCapsLayer.__init__ = init


def linear_head() -> None:
    """Diagnosis only: the class capsules replaced by linear maps of ConvCaps2's poses and activations (class
    activations through a logistic, class poses for the decoder), to see whether the EM class layer limits learning."""
    class LinearHead(nn.Module):
        def __init__(self, in_types, grid, num_classes, config):
            super().__init__()
            inputs = grid[0] * grid[1] * in_types * 17
            self.activations = nn.Linear(inputs, num_classes)
            self.poses = nn.Linear(inputs, num_classes * 16)

        def forward(self, poses, activations):  # (B, 4, 4, D, 16), (B, 4, 4, D)
            flat = torch.cat([poses.flatten(1), activations.flatten(1)], dim=1)  # (B, 4*4*D*17)
            out = torch.sigmoid(self.activations(flat))  # (B, J)
            no_assignments = out.new_zeros(out.shape[0], 1, out.shape[1])  # (B, 1, J)
            return em_model.EMResult(self.poses(flat).unflatten(1, (-1, 16)), out, no_assignments)

    em_model.ClassCaps = LinearHead


def conv_body() -> None:
    """Diagnosis only: PrimaryCaps, ConvCaps1 and ConvCaps2 replaced by ReLU convolutions of the same grids
    (14 -> 6 -> 4, 64 channels) ending in D poses (linear) and activations (logistic), before the EM class layer."""
    original_init = em_model.EMCapsNet.__init__

    class Body(nn.Module):
        def __init__(self, channels, types):
            super().__init__()
            self.types = types
            self.conv_a = nn.Conv2d(channels, 64, 3, stride=2)
            self.conv_b = nn.Conv2d(64, 64, 3)
            self.out = nn.Conv2d(64, types * 17, 1)

        def forward(self, features):  # (B, A, 14, 14)
            x = self.out(F.relu(self.conv_b(F.relu(self.conv_a(features)))))  # (B, D*17, 4, 4)
            x = x.permute(0, 2, 3, 1).unflatten(-1, (self.types, 17))  # (B, 4, 4, D, 17)
            return x[..., :16], torch.sigmoid(x[..., 16])

    def init(self, config):
        original_init(self, config)
        self.body = Body(config.conv1_channels, config.conv_caps_types[-1])

    def forward(self, images, target=None):
        poses, activations = self.body(self.features(images))
        routed = self.class_caps(poses, activations)
        if target is None:
            target = routed.activations.argmax(dim=1)
        return em_model.CapsNetOutput(routed.activations, routed.poses, self.decoder(routed.poses, target),
                                      routed.assignments)

    em_model.EMCapsNet.__init__, em_model.EMCapsNet.forward = init, forward


def pose_layer_norm() -> None:
    """Layer normalisation of each primary capsule's 16 pose entries: the scale control of `batch-norm` without batch
    statistics, so training and evaluation compute the same function."""
    original_init, original_forward = em_model.PrimaryMatrixCaps.__init__, em_model.PrimaryMatrixCaps.forward

    def init(self, in_channels, types):
        original_init(self, in_channels, types)
        self.pose_layer_norm = nn.LayerNorm(16)

    def forward(self, features):
        poses, activations = original_forward(self, features)  # (B, H, W, N, 16), (B, H, W, N)
        return self.pose_layer_norm(poses), activations

    em_model.PrimaryMatrixCaps.__init__, em_model.PrimaryMatrixCaps.forward = init, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("variants", nargs="*")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="/tmp")
    args = parser.parse_args()
    settings = dict(variant.split("=") for variant in args.variants if "=" in variant)
    flags = {variant for variant in args.variants if "=" not in variant}
    patches = {"bn": conv1_batch_norm, "margin-per-step": lambda: margin_per_step(args.epochs),
               "renormalise-r": renormalise_r, "transforms-normal": transforms_normal,
               "logit-beta": lambda: logit_beta(both=True), "logit-beta-a": lambda: logit_beta(both=False),
               "no-reconstruction": lambda: None, "direct-moments": direct_moments, "logit-ce": logit_cross_entropy,
               "cross-position": cross_position, "ibm-cost": ibm_cost, "pose-ln": pose_layer_norm,
               "linear-head": linear_head, "conv-body": conv_body}
    for flag in flags - {"batch-norm", "no-batch-norm"}:
        patches[flag]()
    if "class-lambda" in settings:
        class_lambda(float(settings["class-lambda"]))
    overrides = {"reconstruction_weight": 0.0} if "no-reconstruction" in flags else {}
    if flags & {"batch-norm", "no-batch-norm"}:
        overrides["em_batch_norm"] = "batch-norm" in flags
    for key, field, kind in (("iterations", "routing_iterations", int), ("lambda", "em_inverse_temperature", float),
                             ("conv1", "conv1_channels", int), ("conv2", "em_conv2_channels", int),
                             ("conv3", "em_conv3_channels", int),
                             ("margin-start", "spread_margin_start", float),
                             ("margin-step", "spread_margin_step", float)):
        if key in settings:
            overrides[field] = kind(settings[key])
    if "types" in settings:
        overrides["conv_caps_types"] = (int(settings["types"]),) * 2
    config_module.PRESETS["em"] = config_module.PRESETS["em"].replace(**overrides)
    # the training options a variant may set; the rest keep TrainOptions' defaults
    chosen = {field: kind(settings[key]) for key, field, kind in (("lr", "lr", float), ("lr-decay", "lr_decay", float),
                                                                   ("schedule", "lr_schedule", str),
                                                                   ("warmup", "warmup", float),
                                                                   ("max-shift", "max_shift", int)) if key in settings}
    options = TrainOptions(data="embedded", arch="em", epochs=args.epochs, batch_size=64, seed=args.seed, threads=1,
                           out=f"{args.out_dir}/{args.name}.ckpt", progress=False, **chosen)
    started = time.time()
    checkpoint = train(options)
    print(json.dumps({"name": args.name, "variants": sorted(args.variants), "seed": args.seed,
                      "seconds": round(time.time() - started),
                      "history": [(h["epoch"], round(100 * h["validation_accuracy"], 2), round(100 * h["test_accuracy"], 2))
                                  for h in checkpoint.history]}))


if __name__ == "__main__":
    main()
