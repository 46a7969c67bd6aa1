"""Measure how far a capsule network's poses show in its decoder's drawings (capsnet/model_description/pose.py
defines the figures): `capsnet eval --pose` prints them, `capsnet export --reconstruction` records them in model.json.

Each held-out image is drawn from its true class's capsule, as in training, and compared with the image and with
the class template (the class's mean training image). Each dimension of that capsule is then moved alone by −step
and +step, held where the capsule would grow longer than a squashed capsule can be (as the explorer holds its
sliders and grid), and the two drawings compared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.model_description.decoder import LENGTH_SLACK, UNIT_LENGTH
from capsnet.model_description.pose import DEFAULT_POSE_IMAGES, GREY_LEVELS, POSE_STEP, PoseFigures
from capsnet.models.capsnet import CapsNet
from capsnet.models.checkpoint import Model
from capsnet.models.em import EMCapsNet
from capsnet.models.config import CAPSULE_ARCHITECTURES, CapsNetConfig
from capsnet.training.data import Dataset, Split, to_float

def pose_length_limit(config: CapsNetConfig) -> float | None:
    """A capsule network's poses are squashed to a length under 1; EM's matrix capsules are not bounded."""
    return UNIT_LENGTH if config.arch == "capsnet" else None


def class_templates(split: Split, num_classes: int) -> torch.Tensor:
    """The mean image of each class in `split`, flattened: (J, C*H*W) in [0, 1]; a class absent from it is blank."""
    images = to_float(split.images).flatten(1)  # (N, C*H*W)
    labels = torch.as_tensor(split.labels)
    sums = torch.zeros(num_classes, images.shape[1]).index_add_(0, labels, images)  # (J, C*H*W)
    counts = torch.bincount(labels, minlength=num_classes).clamp_min(1)  # (J,)
    return sums / counts[:, None]


def training_images(dataset: Dataset) -> Split:
    """All of the data's training images, the share a run held out to validate on included: the templates are
    then the same whichever split is measured."""
    if dataset.validation is None:
        return dataset.train
    return Split(np.concatenate([dataset.train.images, dataset.validation.images]),
                 np.concatenate([dataset.train.labels, dataset.validation.labels]))


def measure_pose(model: Model, dataset: Dataset, split_name: str = "test", images: int = DEFAULT_POSE_IMAGES,
                 batch_size: int = 100, device: torch.device | None = None) -> PoseFigures:
    """The pose figures of `model` on the first `images` images of `dataset`'s `split_name` split."""
    config: CapsNetConfig = model.config
    if not isinstance(model, (CapsNet, EMCapsNet)):  # the CAPSULE_ARCHITECTURES, which have a decoder
        raise CapsNetError(f"a {config.arch} model has no decoder, so its poses draw nothing: --pose is for "
                           f"{' and '.join(CAPSULE_ARCHITECTURES)} models")
    split = getattr(dataset, split_name)
    if split is None or not len(split):
        raise CapsNetError(f"data {dataset.name!r} has no {split_name} images to measure the poses on")
    if images < 1:
        raise CapsNetError(f"--pose-images must be at least 1, got {images}")
    device = device or torch.device("cpu")
    count = min(images, len(split))
    templates = class_templates(training_images(dataset), config.num_classes).to(device)  # (J, C*H*W)
    limit = pose_length_limit(config)
    steps = torch.tensor([-POSE_STEP, POSE_STEP], device=device)  # (2,)
    squared = torch.zeros(2, dtype=torch.float64)  # reconstruction, template: summed squared errors
    change = torch.zeros(config.digit_caps_dim, dtype=torch.float64)  # summed mean |Δ| per dimension
    model.eval()
    with torch.inference_mode():
        for start in range(0, count, batch_size):
            batch = to_float(split.images[start:min(start + batch_size, count)]).to(device)  # (B, C, H, W)
            labels = torch.as_tensor(split.labels[start:start + len(batch)]).to(device)  # (B,)
            output = model(batch, labels)
            target = batch.flatten(1)  # (B, C*H*W)
            squared[0] += (output.reconstruction.float() - target).square().sum().double().cpu()
            squared[1] += (templates[labels] - target).square().sum().double().cpu()
            change += dimension_changes(model.decoder, output.poses.float(), labels, steps, limit).double().cpu()
    pixels = count * config.input_size
    return PoseFigures(images=count, split=split_name, dataset=dataset.name,
                       reconstruction_mse=float(squared[0] / pixels), template_mse=float(squared[1] / pixels),
                       sensitivity=tuple(float(level) for level in change / count * GREY_LEVELS))


def dimension_changes(decoder: torch.nn.Module, poses: torch.Tensor, labels: torch.Tensor, steps: torch.Tensor,
                      limit: float | None) -> torch.Tensor:
    """Summed over the batch, per dimension: the mean |drawing at +step − drawing at −step| of each image's own
    capsule moved along that dimension alone, held within `limit` as the explorer's sliders and grid hold it:
    poses (B, J, D) -> (D,)."""
    batch, _, dims = poses.shape
    own = poses[torch.arange(batch), labels]  # (B, D)
    values = own[:, :, None] + steps  # (B, D, S): dimension k of the pose moved by each step
    if limit is not None:
        others = own.square().sum(dim=1, keepdim=True) - own.square()  # (B, D): the other dimensions' share
        room = ((limit - LENGTH_SLACK) ** 2 - others).clamp_min(0).sqrt()[:, :, None]  # (B, D, 1)
        values = torch.maximum(torch.minimum(values, room), -room)
    moved = own[:, None, None, :].repeat(1, dims, len(steps), 1)  # (B, D, S, D)
    every = torch.arange(dims)
    moved[:, every, :, every] = values.permute(1, 0, 2)  # (D, B, S): dimension k of row k
    drawn_poses = poses[:, None, None].repeat(1, dims, len(steps), 1, 1)  # (B, D, S, J, D)
    drawn_poses[torch.arange(batch), :, :, labels] = moved
    drawn = decoder(drawn_poses.flatten(0, 2), labels.repeat_interleave(dims * len(steps)))  # (B*D*S, C*H*W)
    drawn = drawn.float().view(batch, dims, len(steps), -1)  # (B, D, S, C*H*W)
    return (drawn[:, :, -1] - drawn[:, :, 0]).abs().mean(dim=2).sum(dim=0)  # (D,)


def pose_report(model: Model, dataset: Dataset, split_name: str, images: int, device: torch.device,
                out: Path | None) -> PoseFigures:
    """`capsnet eval --pose`: the figures on `split_name`, also written to `out` as JSON when given."""
    figures = measure_pose(model, dataset, split_name, images, device=device)
    if out is not None:
        try:
            out.write_text(json.dumps(figures.to_json(), indent=2) + "\n")
        except OSError as err:
            raise CapsNetError(f"cannot write --pose-out {out}: {err.strerror or err}") from None
    return figures
