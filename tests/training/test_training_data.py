"""Data: the IDX loader (files written here and the real Fashion-MNIST), the embedded split, augmentation."""

from __future__ import annotations

import gzip
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from capsnet.errors import CapsNetError
from capsnet.training.data import (ERASE_AREA, FASHION_MNIST_NAMES, Augmentation, channel_mean_std, load_dataset,
                                   load_embedded, random_erase, random_shift, to_float)

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def small_digits(count: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=count).astype(np.uint8)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(idx_dataset, gz):
    train_images, train_labels = small_digits(30, 0)
    test_images, test_labels = small_digits(12, 1)
    directory = idx_dataset(train_images, train_labels, test_images, test_labels, gz=gz)
    dataset = load_dataset(str(directory))
    assert dataset.image_shape == (1, 28, 28)
    np.testing.assert_array_equal(dataset.train.images[:, 0], train_images)
    np.testing.assert_array_equal(dataset.train.labels, train_labels)
    np.testing.assert_array_equal(dataset.test.images[:, 0], test_images)
    assert dataset.train.labels.dtype == np.int64 and dataset.class_names == tuple("0123456789")
    # `capsnet eval` and `robustness` hand slices of the splits to torch, which warns on read-only arrays
    assert dataset.train.images.flags.writeable and dataset.test.images.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_float(dataset.test.images[:4])


def test_idx_channels_last_and_class_names_file(idx_dataset):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 32, 30, 3), dtype=np.uint8)  # (N, H, W, C) as IDX stores colour
    labels = np.array([0, 1, 2, 0, 1, 2], dtype=np.uint8)
    directory = idx_dataset(images, labels, images, labels)
    (directory / "classes.txt").write_text("cat\ndog\nbird\n")
    dataset = load_dataset(str(directory))
    assert dataset.image_shape == (3, 32, 30)
    np.testing.assert_array_equal(dataset.train.images, images.transpose(0, 3, 1, 2))
    assert dataset.class_names == ("cat", "dog", "bird")


def corrupt(directory: Path, name: str, data: bytes) -> None:
    (directory / name).write_bytes(data)


def gzip_with_corrupt_body(path: Path) -> None:
    """Replace an IDX file with a .gz whose header is valid and whose deflate stream is not."""
    packed = gzip.compress(path.read_bytes())
    path.unlink()
    path.with_name(path.name + ".gz").write_bytes(packed[:10] + b"\xff" * 40 + packed[50:])


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "t10k-labels-idx1-ubyte").unlink(), "has no t10k-labels-idx1-ubyte"),
    (lambda d: corrupt(d, "train-images-idx3-ubyte", b"\x00\x00\x0d\x03" + bytes(16)), "bad magic number"),
    (lambda d: corrupt(d, "train-images-idx3-ubyte", b"\x00\x00\x08\x03\x00\x00"), "truncated"),
    (lambda d: corrupt(d, "train-labels-idx1-ubyte", (d / "train-labels-idx1-ubyte").read_bytes()[:-3]),
     "its header declares"),
    (lambda d: corrupt(d, "train-labels-idx1-ubyte", b"\x00\x00\x08\x01\x00\x00\x00\x02\x01\x02"),
     "labels for 30 images"),
    (lambda d: (d / "classes.txt").write_text("a\nb\n"), "lists 2 names for 10 classes"),
    (lambda d: (d / "classes.txt").write_bytes(b"\xff\xfe\x00"), "cannot read .*classes.txt"),
    (lambda d: gzip_with_corrupt_body(d / "train-images-idx3-ubyte"), "cannot read IDX file .*decompressing"),
])
def test_malformed_idx_directory_is_a_clear_error(idx_dataset, damage, message):
    train_images, train_labels = small_digits(30, 0)
    train_labels[:10] = np.arange(10)
    directory = idx_dataset(train_images, train_labels, *small_digits(12, 1))
    damage(directory)
    with pytest.raises(CapsNetError, match=message):
        load_dataset(str(directory))


@pytest.mark.parametrize("test_images, message", [
    (np.zeros((0, 28, 28), np.uint8), "t10k-images-idx3-ubyte in .* holds no images"),
    (np.zeros((12, 20, 20), np.uint8), "training images in .* are 28x28 with 1 channel but the test images 20x20"),
])
def test_a_test_split_that_cannot_be_scored_is_a_clear_error(idx_dataset, test_images, message):
    directory = idx_dataset(*small_digits(30, 0), test_images, np.zeros(len(test_images), np.uint8))
    with pytest.raises(CapsNetError, match=message):
        load_dataset(str(directory))


@pytest.mark.parametrize("shape", [(0, 28), (28, 0), (28, 28, 0)])
def test_images_without_pixels_are_a_clear_error(idx_dataset, shape):
    images = np.zeros((12, *shape), np.uint8)  # the header declares 12 images of no pixels (or channels) each
    directory = idx_dataset(images, np.arange(12) % 10, images, np.arange(12) % 10)
    height, width = shape[:2]
    with pytest.raises(CapsNetError, match=f"train-images-idx3-ubyte in .* declares images of {height}x{width} with "
                                           f"{1 if len(shape) == 2 else 0} channels?; an image needs at least one"):
        load_dataset(str(directory))


@pytest.mark.parametrize("train_label, test_label, message", [
    (12, 0, "train-labels-idx1-ubyte in .*: classes 10, 11 have no training images \\(labels run 0..12\\)"),
    (255, 0, "classes 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, ... \\(245 in all\\) have no training images"),
    (9, 10, "t10k-labels-idx1-ubyte in .*: class 10 is not among the training classes 0..9"),
])
def test_labels_are_the_training_classes(idx_dataset, train_label, test_label, message):
    """A corrupt label (255) must not make a 256-class model: every class up to the highest label needs training
    images, and the test split has no classes of its own."""
    train_images, train_labels = small_digits(30, 0)
    train_labels[:10] = np.arange(10)
    train_labels[10] = train_label
    test_images, test_labels = small_digits(12, 1)
    test_labels[0] = test_label
    directory = idx_dataset(train_images, train_labels, test_images, test_labels)
    with pytest.raises(CapsNetError, match=message):
        load_dataset(str(directory))


def test_missing_data_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CapsNetError, match="does not exist"):
        load_dataset(str(tmp_path / "nowhere"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CapsNetError, match="is not a directory"):
        load_dataset(str(tmp_path / "file"))


def test_an_empty_data_path_is_named_as_such(tmp_path, monkeypatch):
    # `--data "$UNSET"` read the working directory and said "data directory . has no train-images..."
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CapsNetError, match=r"^--data needs 'embedded' or a directory of IDX files, got an empty path$"):
        load_dataset("")


@pytest.mark.skipif(not FASHION_MNIST.is_dir(), reason="Debian package dataset-fashion-mnist is not installed")
def test_real_fashion_mnist():
    dataset = load_dataset(str(FASHION_MNIST))
    assert (len(dataset.train), len(dataset.test)) == (60_000, 10_000)
    assert dataset.image_shape == (1, 28, 28) and dataset.train.images.dtype == np.uint8
    assert dataset.class_names == FASHION_MNIST_NAMES
    assert np.bincount(dataset.train.labels).tolist() == [6000] * 10
    assert np.bincount(dataset.test.labels).tolist() == [1000] * 10


def test_embedded_split_is_fixed_balanced_and_disjoint():
    first, second = load_embedded(), load_embedded()
    np.testing.assert_array_equal(first.train.labels, second.train.labels)
    np.testing.assert_array_equal(first.test.images, second.test.images)
    assert (len(first.train), len(first.test)) == (4000, 1000)
    assert np.bincount(first.train.labels).tolist() == [400] * 10
    assert np.bincount(first.test.labels).tolist() == [100] * 10
    train_rows = {image.tobytes() for image in first.train.images}
    assert not any(image.tobytes() in train_rows for image in first.test.images)
    assert len(set(first.train.labels[:20].tolist())) > 3, "the training split must be shuffled across classes"


def test_random_shift_moves_each_image_by_at_most_max_shift():
    images = torch.zeros(256, 1, 28, 28)
    images[:, 0, 14, 14] = 1.0
    shifted = random_shift(images, 2, torch.Generator().manual_seed(0))
    positions = shifted[:, 0].flatten(1).argmax(dim=1)  # (B,)
    dy, dx = positions // 28 - 14, positions % 28 - 14
    assert shifted.sum().item() == 256  # content kept
    assert dy.abs().max() == 2 and dx.abs().max() == 2
    assert len(set(zip(dy.tolist(), dx.tolist()))) == 25  # every offset in [-2, 2]² occurs
    assert torch.equal(random_shift(images, 0), images)


def test_random_shift_equals_padding_and_cropping():
    images = torch.rand(16, 3, 28, 30)
    shifted = random_shift(images, 3, torch.Generator().manual_seed(1))
    offsets = torch.randint(0, 7, (16, 2), generator=torch.Generator().manual_seed(1))
    padded = F.pad(images, (3, 3, 3, 3))
    expected = torch.stack([padded[i, :, dy : dy + 28, dx : dx + 30] for i, (dy, dx) in enumerate(offsets.tolist())])
    assert torch.equal(shifted, expected)


def test_channel_mean_std():
    images = np.zeros((4, 2, 3, 3), dtype=np.uint8)
    images[:2, 0] = 255  # channel 0: half black, half white
    images[:, 1] = 51  # channel 1: constant 0.2
    mean, std = channel_mean_std(images)
    assert mean == pytest.approx((0.5, 0.2)) and std == pytest.approx((0.5, 1e-6))


def test_hflip_mirrors_about_half_the_images_and_a_resume_replays_the_draws():
    images = torch.rand(64, 1, 6, 5)  # (B, C, H, W)
    flipped = Augmentation(hflip=True)(images, torch.Generator().manual_seed(0))
    mirrored = [torch.equal(after, before.flip(-1)) for after, before in zip(flipped, images)]
    kept = [torch.equal(after, before) for after, before in zip(flipped, images)]
    assert all(m != k for m, k in zip(mirrored, kept)) and 20 <= sum(mirrored) <= 44
    # skipping two batches' draws leaves the generator where augmenting them would
    augmentation = Augmentation(max_shift=2, hflip=True, erase=0.5)
    generator, skipped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for batch in (images[:10], images[10:30]):
        augmentation(batch, generator)
    augmentation.skip([10, 20], skipped)
    assert torch.equal(augmentation(images, generator), augmentation(images, skipped))


def test_random_erasing_blanks_one_rectangle_of_the_drawn_size_in_the_share_of_images_asked():
    images = torch.rand(2000, 2, 28, 28) + 0.1  # (B, C, H, W): no pixel is 0 before erasing
    erased = random_erase(images, 0.5, torch.Generator().manual_seed(0))
    blank = erased == 0  # (B, C, H, W)
    assert torch.equal(blank[:, 0], blank[:, 1])  # every channel of a pixel together
    assert torch.equal(erased[~blank], images[~blank])  # nothing else changes
    counts = blank[:, 0].sum(dim=(1, 2))  # (B,)
    hit = counts > 0
    assert 900 <= int(hit.sum()) <= 1100  # binomial(2000, 0.5): 5 standard deviations either side
    for mask in blank[hit, 0][:200]:
        rows, cols = mask.any(dim=1).nonzero().flatten(), mask.any(dim=0).nonzero().flatten()
        height, width = int(rows[-1] - rows[0] + 1), int(cols[-1] - cols[0] + 1)
        assert int(mask.sum()) == height * width  # one solid rectangle
    # the areas spread over the drawn range; cutting boxes to the image only shrinks them
    share = counts[hit].double() / (28 * 28)
    assert share.min() < ERASE_AREA[0] + 0.02 and share.max() > ERASE_AREA[1] - 0.1
    assert share.max() <= ERASE_AREA[1] + 0.03  # rounding the sides to whole pixels
    assert torch.equal(random_erase(images, 0.0, torch.Generator().manual_seed(0)), images)


def test_the_validation_split_is_a_fixed_stratified_share_of_the_training_images():
    full = load_embedded()
    dataset = load_dataset("embedded", 0.1)
    assert (len(dataset.train), len(dataset.validation), len(dataset.test)) == (3600, 400, 1000)
    assert np.bincount(dataset.validation.labels).tolist() == [40] * 10
    assert dataset.test.images.tobytes() == full.test.images.tobytes()  # the test split is untouched
    # together the two are the training images, each once: no image is both trained on and validated on
    rows = lambda split: {image.tobytes() for image in split.images}  # noqa: E731
    assert rows(dataset.train) | rows(dataset.validation) == rows(full.train)
    assert not rows(dataset.train) & rows(dataset.validation)
    again = load_dataset("embedded", 0.1)
    assert np.array_equal(again.validation.images, dataset.validation.images)  # the same every time
    assert load_dataset("embedded", 0.0).validation is None
