"""Test sets the model never trained on, built from a data split: affine-distorted digits,
MultiMNIST-style pairs of overlaid digits (Sabour et al. 2017, section 6), and pairs of digits side by side
or stacked on a canvas twice the size (Su 2018), for models that take any image size.

Each keeps the split's uint8 (N, C, H, W) images, and every random choice comes from one seed, so a set is
rebuilt bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from capsnet.errors import CapsNetError
from capsnet.training.data import Split, random_shift, to_float

MAX_ROTATION_DEGREES = 20.0
SCALE_RANGE = (0.8, 1.2)
MAX_SHEAR = 0.3  # x' = x + shear·y, about ±17°
OVERLAY_MAX_SHIFT = 4  # pixels each digit moves in x and y, as in MultiMNIST


class AffineParameters(NamedTuple):
    rotation_degrees: np.ndarray  # (N,)
    scale: np.ndarray  # (N,) the same in x and y
    shear: np.ndarray  # (N,)


def random_affine_parameters(count: int, seed: int) -> AffineParameters:
    rng = np.random.default_rng(seed)
    return AffineParameters(
        rotation_degrees=rng.uniform(-MAX_ROTATION_DEGREES, MAX_ROTATION_DEGREES, count),
        scale=rng.uniform(*SCALE_RANGE, count),
        shear=rng.uniform(-MAX_SHEAR, MAX_SHEAR, count),
    )


def affine_transform(images: np.ndarray, parameters: AffineParameters) -> np.ndarray:
    """Rotate, shear and scale uint8 (N, C, H, W) images about their centre (bilinear, zero-filled)."""
    count, _, height, width = images.shape
    angle = np.deg2rad(parameters.rotation_degrees)  # (N,)
    cos, sin = np.cos(angle), np.sin(angle)
    rotation = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)  # (N, 2, 2)
    shear = np.tile(np.eye(2), (count, 1, 1))  # (N, 2, 2)
    shear[:, 0, 1] = parameters.shear
    forward = rotation @ shear * parameters.scale[:, None, None]  # (N, 2, 2) pixel (x, y) about the centre
    # affine_grid maps each output point back to where it samples the input, in coordinates
    # normalised to [-1, 1] per axis: theta = D⁻¹ A⁻¹ D with D = diag(W/2, H/2).
    half = np.array([width / 2, height / 2])  # (2,)
    inverse = np.linalg.inv(forward) * half[None, None, :] / half[None, :, None]  # (N, 2, 2)
    affine = np.concatenate([inverse, np.zeros((count, 2, 1))], axis=2)  # (N, 2, 3)
    theta = torch.as_tensor(affine, dtype=torch.float32)  # (N, 2, 3)
    pixels = to_float(images)  # (N, C, H, W)
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)  # (N, H, W, 2)
    warped = F.grid_sample(pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=False)  # (N, C, H, W)
    return warped.mul(255).round().clamp(0, 255).to(torch.uint8).numpy()


def affine_split(split: Split, seed: int) -> tuple[Split, AffineParameters]:
    """Every image of `split` under its own random affine distortion; labels unchanged."""
    parameters = random_affine_parameters(len(split), seed)
    return Split(affine_transform(split.images, parameters), split.labels.copy()), parameters


@dataclass
class PairSet:
    images: np.ndarray  # (N, C, H', W') uint8
    labels: np.ndarray  # (N, 2) int64: two different classes per image
    sources: np.ndarray  # (N, 2) int64: indices of the two digits in the split


def different_class_pairs(split: Split, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices of `count` pairs of images of `split` whose classes differ: (N,) first and (N,) second."""
    if len(np.unique(split.labels)) < 2:
        raise CapsNetError("pairs of different digits need images of at least 2 classes in the split")
    first = rng.integers(0, len(split), count)  # (N,)
    second = rng.integers(0, len(split), count)  # (N,)
    same = split.labels[first] == split.labels[second]
    while same.any():  # redraw partners of the same class
        second[same] = rng.integers(0, len(split), int(same.sum()))
        same = split.labels[first] == split.labels[second]
    return first, second


def _pair_set(split: Split, first: np.ndarray, second: np.ndarray, images: np.ndarray) -> PairSet:
    labels = np.stack([split.labels[first], split.labels[second]], axis=1)  # (N, 2)
    return PairSet(images, labels, np.stack([first, second], axis=1))


def overlay_pairs(split: Split, count: int, seed: int, max_shift: int = OVERLAY_MAX_SHIFT) -> PairSet:
    """`count` images, each two digits of different classes from `split`, each shifted by up to
    `max_shift` pixels in x and y, added and clipped at 255."""
    first, second = different_class_pairs(split, count, np.random.default_rng(seed))
    generator = torch.Generator().manual_seed(seed)
    shifted = [random_shift(torch.as_tensor(split.images[indices]), max_shift, generator).numpy()  # (N, C, H, W)
               for indices in (first, second)]
    combined = np.minimum(shifted[0].astype(np.int16) + shifted[1], 255).astype(np.uint8)  # (N, C, H, W)
    return _pair_set(split, first, second, combined)


def digit_pairs(split: Split, count: int, seed: int, layout: str) -> PairSet:
    """`count` images of two digits of different classes from `split`, placed as `layout` (pairs.PAIR_LAYOUTS) says:
    side by side or stacked as they are, with no shift (each digit keeps its place in its half), or overlaid."""
    if layout == "overlap":
        return overlay_pairs(split, count, seed)
    axis = {"side-by-side": 3, "stacked": 2}[layout]  # the width or the height of (N, C, H, W)
    first, second = different_class_pairs(split, count, np.random.default_rng(seed))
    return _pair_set(split, first, second, np.concatenate([split.images[first], split.images[second]], axis=axis))
