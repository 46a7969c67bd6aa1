"""The affine and overlap test-set builders: shapes, labels, determinism, and the geometry itself."""

from __future__ import annotations

import numpy as np
import pytest

from capsnet.errors import CapsNetError
from capsnet.training.data import Split, load_embedded
from capsnet.training.transforms import (
    MAX_ROTATION_DEGREES, MAX_SHEAR, SCALE_RANGE, AffineParameters, affine_split, affine_transform, overlay_pairs,
    random_affine_parameters,
)


@pytest.fixture(scope="module")
def digits() -> Split:
    test = load_embedded().test  # sorted by class: every 4th digit keeps all ten
    return Split(test.images[::4], test.labels[::4])


def one_transform(image: np.ndarray, rotation: float = 0.0, scale: float = 1.0, shear: float = 0.0) -> np.ndarray:
    parameters = AffineParameters(np.array([rotation]), np.array([scale]), np.array([shear]))
    return affine_transform(image[None, None], parameters)[0, 0]  # (H, W)


def test_affine_split_keeps_shapes_and_labels_and_repeats_with_its_seed(digits):
    distorted, parameters = affine_split(digits, seed=3)
    assert distorted.images.shape == digits.images.shape and distorted.images.dtype == np.uint8
    np.testing.assert_array_equal(distorted.labels, digits.labels)
    assert (distorted.images != digits.images).any(axis=(1, 2, 3)).mean() > 0.95
    np.testing.assert_array_equal(affine_split(digits, seed=3)[0].images, distorted.images)
    assert not np.array_equal(affine_split(digits, seed=4)[0].images, distorted.images)
    assert len(parameters.rotation_degrees) == len(digits)


def test_affine_parameters_cover_their_ranges():
    parameters = random_affine_parameters(2000, seed=0)
    rotation, scale, shear = parameters
    assert np.abs(rotation).max() <= MAX_ROTATION_DEGREES and np.abs(rotation).max() > 0.95 * MAX_ROTATION_DEGREES
    assert SCALE_RANGE[0] <= scale.min() < SCALE_RANGE[0] + 0.02
    assert SCALE_RANGE[1] - 0.02 < scale.max() <= SCALE_RANGE[1]
    assert np.abs(shear).max() <= MAX_SHEAR and np.abs(shear).max() > 0.95 * MAX_SHEAR
    assert rotation.min() < 0 < rotation.max() and shear.min() < 0 < shear.max()


def test_identity_leaves_the_image_unchanged(digits):
    np.testing.assert_array_equal(one_transform(digits.images[0, 0]), digits.images[0, 0])


def test_quarter_turn_rotates_about_the_centre(digits):
    # A 90° turn maps the 28×28 pixel centres onto each other, so bilinear sampling is exact.
    # Positive angles turn clockwise on screen (the image's y axis points down).
    digit = digits.images[0, 0]
    np.testing.assert_array_equal(one_transform(digit, rotation=90.0), np.rot90(digit, k=-1))


def test_shear_moves_x_by_shear_times_y():
    image = np.zeros((28, 28), np.uint8)
    image[17, 13] = 255  # x = 13 - 13.5 = -0.5, y = 17 - 13.5 = 3.5 from the centre
    sheared = one_transform(image, shear=2.0)  # x' = x + 2y = 6.5 -> column 20
    assert list(zip(*np.nonzero(sheared))) == [(17, 20)] and sheared[17, 20] == 255


@pytest.mark.parametrize("scale", SCALE_RANGE)
def test_scale_multiplies_the_area(scale):
    image = np.zeros((28, 28), np.uint8)
    image[9:19, 9:19] = 200
    ratio = one_transform(image, scale=scale).astype(float).sum() / image.astype(float).sum()
    assert ratio == pytest.approx(scale**2, rel=0.01)


def test_overlay_pairs_two_different_digits_with_their_labels(digits):
    overlay = overlay_pairs(digits, 200, seed=1)
    assert overlay.images.shape == (200, 1, 28, 28) and overlay.images.dtype == np.uint8
    assert overlay.labels.shape == (200, 2) and (overlay.labels[:, 0] != overlay.labels[:, 1]).all()
    np.testing.assert_array_equal(overlay.labels, digits.labels[overlay.sources])
    assert len(np.unique(overlay.labels)) == 10


def test_overlay_without_shift_is_the_clipped_sum(digits):
    overlay = overlay_pairs(digits, 50, seed=2, max_shift=0)
    first, second = (digits.images[overlay.sources[:, k]].astype(int) for k in range(2))
    np.testing.assert_array_equal(overlay.images, np.minimum(first + second, 255))


def test_overlay_shifts_are_seeded(digits):
    overlay = overlay_pairs(digits, 100, seed=5)
    np.testing.assert_array_equal(overlay_pairs(digits, 100, seed=5).images, overlay.images)
    assert not np.array_equal(overlay_pairs(digits, 100, seed=6).images, overlay.images)
    unshifted = overlay_pairs(digits, 100, seed=5, max_shift=0)
    np.testing.assert_array_equal(unshifted.sources, overlay.sources)
    assert (unshifted.images != overlay.images).any(axis=(1, 2, 3)).mean() > 0.9
    # Shifting moves ink without adding any: at most the two digits' ink, at least the larger one's.
    ink = overlay.images.astype(int).sum(axis=(1, 2, 3))  # (N,)
    sources = digits.images[overlay.sources].astype(int).sum(axis=(2, 3, 4))  # (N, 2)
    assert (ink <= sources.sum(axis=1)).all() and (ink >= 0.9 * sources.max(axis=1)).all()


def test_overlay_pairs_of_one_class_is_a_clear_error(digits):
    one_class = Split(digits.images[digits.labels == 3], digits.labels[digits.labels == 3])
    with pytest.raises(CapsNetError, match="at least 2 classes"):
        overlay_pairs(one_class, 4, seed=0)
