"""Datasets: MNIST-format IDX files from a directory, or the embedded 5,000 MNIST digits.

Images stay uint8 (N, C, H, W) in memory; batches are converted to float32 in [0, 1] on the fly.
A seeded, class-stratified share of the training images can be held out as a validation split
(`with_validation`): model selection uses it, so the test split is only ever reported.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from capsnet.errors import CapsNetError

DIGIT_NAMES = tuple(str(d) for d in range(10))
FASHION_MNIST_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
KMNIST_NAMES = ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo")

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_DTYPES = {0x08: np.uint8}
EMBEDDED_TRAIN_PER_CLASS = 400
# Fixed, not --seed: runs with different seeds are selected on the same validation images.
VALIDATION_SEED = 0


@dataclass
class Split:
    images: np.ndarray  # (N, C, H, W) uint8
    labels: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split
    class_names: tuple[str, ...]
    validation: Split | None = None  # held out of the training images by with_validation
    validation_fraction: float = 0.0

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.images.shape[1:])  # (C, H, W)


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed) into an array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # zlib.error: a gzip stream whose body is corrupt
        raise CapsNetError(f"cannot read IDX file {path}: {err}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise CapsNetError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CapsNetError(f"{path} is truncated (header)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape))
    if len(raw) - header != count:
        raise CapsNetError(f"{path} holds {len(raw) - header} bytes of data; its header declares {shape} = {count}")
    # a writable copy: torch warns on read-only arrays (eval and robustness take slices of them whole)
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()


def _find_idx(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz", directory / stem.replace("-idx", ".idx")):
        if candidate.is_file():
            return candidate
    raise CapsNetError(f"data directory {directory} has no {stem}[.gz]")


def guess_class_names(directory: Path, num_classes: int) -> tuple[str, ...]:
    """Class names travel with the data: a `classes.txt` (one per line) wins, then the folder name."""
    names_file = directory / "classes.txt"
    if names_file.is_file():
        try:
            text = names_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CapsNetError(f"cannot read {names_file}: {err}") from None
        names = tuple(line.strip() for line in text.splitlines() if line.strip())
        if len(names) != num_classes:
            raise CapsNetError(f"{names_file} lists {len(names)} names for {num_classes} classes")
        return names
    lowered = str(directory).lower()
    if "fashion" in lowered and num_classes == 10:
        return FASHION_MNIST_NAMES
    if "kmnist" in lowered and num_classes == 10:
        return KMNIST_NAMES
    return DIGIT_NAMES if num_classes == 10 else tuple(str(i) for i in range(num_classes))


def load_idx_directory(directory: str | Path) -> Dataset:
    directory = Path(directory)
    if not directory.is_dir():
        raise CapsNetError(f"data directory {directory} does not exist" if not directory.exists()
                           else f"{directory} is not a directory")
    splits = {}
    for split, (image_stem, label_stem) in IDX_FILES.items():
        images = read_idx(_find_idx(directory, image_stem))
        labels = read_idx(_find_idx(directory, label_stem))
        if images.ndim == 3:
            images = images[:, None]  # (N, 1, H, W)
        elif images.ndim == 4:
            images = images.transpose(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
        else:
            raise CapsNetError(f"{image_stem} in {directory} has {images.ndim} dimensions; expected 3 or 4")
        if labels.ndim != 1 or len(labels) != len(images):
            raise CapsNetError(f"{label_stem} in {directory} has {labels.shape} labels for {len(images)} images")
        if not len(images):
            raise CapsNetError(f"{image_stem} in {directory} holds no images")
        if not all(images.shape[1:]):
            raise CapsNetError(f"{image_stem} in {directory} declares images of {_shape_text(images)}; an image "
                               "needs at least one pixel and one channel")
        splits[split] = Split(np.ascontiguousarray(images), labels.astype(np.int64))
    train, test = splits["train"], splits["test"]
    if train.images.shape[1:] != test.images.shape[1:]:
        raise CapsNetError(f"the training images in {directory} are {_shape_text(train.images)} but the test "
                           f"images {_shape_text(test.images)}; both splits need one size")
    # The classes are the training labels 0..highest: a stray label (255 in a corrupt file) would add classes
    # the model can never learn.
    highest = int(train.labels.max())
    empty = np.flatnonzero(np.bincount(train.labels) == 0)
    if len(empty):
        raise CapsNetError(f"{IDX_FILES['train'][1]} in {directory}: {_classes(empty)} "
                           f"{'has' if len(empty) == 1 else 'have'} no training images (labels run 0..{highest})")
    unknown = np.unique(test.labels[test.labels > highest])
    if len(unknown):
        raise CapsNetError(f"{IDX_FILES['test'][1]} in {directory}: {_classes(unknown)} "
                           f"{'is' if len(unknown) == 1 else 'are'} not among the training classes 0..{highest}")
    return Dataset(directory.name, train, test, guess_class_names(directory, highest + 1))


def _shape_text(images: np.ndarray) -> str:
    channels, height, width = images.shape[1:]  # (N, C, H, W)
    return f"{height}x{width} with {channels} channel{'s' if channels != 1 else ''}"


def _classes(labels: np.ndarray) -> str:
    return f"class {labels[0]}" if len(labels) == 1 else f"classes {brief_list(labels.tolist())}"


def brief_list(items: Sequence) -> str:
    """At most 10 items: Fashion-MNIST's ten names are worth reading in full, a thousand classes are not."""
    return ", ".join(map(str, items[:10])) + (f", ... ({len(items)} in all)" if len(items) > 10 else "")


def load_embedded() -> Dataset:
    """The 5,000 MNIST digits shipped in the package, split 4,000/1,000 with a fixed seed."""
    with resources.files("capsnet.training").joinpath("data/mnist_5k.npz").open("rb") as f:
        archive = np.load(f)
        images, labels = archive["images"][:, None], archive["labels"].astype(np.int64)  # (5000, 1, 28, 28)
    rng = np.random.default_rng(0)
    train_parts, test_parts = [], []
    for digit in range(10):
        members = rng.permutation(np.flatnonzero(labels == digit))
        train_parts.append(members[:EMBEDDED_TRAIN_PER_CLASS])
        test_parts.append(members[EMBEDDED_TRAIN_PER_CLASS:])
    train_idx = rng.permutation(np.concatenate(train_parts))
    test_idx = np.sort(np.concatenate(test_parts))
    return Dataset(
        "embedded-mnist-5k",
        Split(images[train_idx], labels[train_idx]),
        Split(images[test_idx], labels[test_idx]),
        DIGIT_NAMES,
    )


def load_dataset(spec: str, validation_fraction: float = 0.0) -> Dataset:
    """`embedded` or a directory of MNIST-format IDX files, with `validation_fraction` of the training
    images held out for validation."""
    if not spec:  # `--data "$UNSET"`: Path("") is the working directory, which the error would name as "."
        raise CapsNetError("--data needs 'embedded' or a directory of IDX files, got an empty path")
    dataset = load_embedded() if spec == "embedded" else load_idx_directory(spec)
    return with_validation(dataset, validation_fraction)


def with_validation(dataset: Dataset, fraction: float) -> Dataset:
    """Hold out round(fraction · n_k) training images of every class k, chosen with VALIDATION_SEED; the
    rest stay for training in their original order. The same training files always give the same split."""
    if not 0 <= fraction < 1:
        raise CapsNetError(f"the validation fraction must be at least 0 and below 1, got {fraction}")
    if fraction == 0:
        return dataset
    labels = dataset.train.labels
    rng = np.random.default_rng(VALIDATION_SEED)
    held_parts = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        held_parts.append(rng.choice(members, size=round(fraction * len(members)), replace=False))
    held = np.sort(np.concatenate(held_parts))
    kept = np.setdiff1d(np.arange(len(labels)), held)  # sorted
    if not len(held) or not len(kept):
        raise CapsNetError(f"a validation fraction of {fraction} leaves {len(kept)} training and {len(held)} "
                           f"validation images of the {len(labels)} in {dataset.name!r}")
    # round(fraction · n_k) is all of a class of 1 image above 0.5: the model would train without ever seeing
    # it, as with a stray label, which the loader refuses
    emptied = np.setdiff1d(np.unique(labels), labels[kept])
    if len(emptied):
        names = brief_list([dataset.class_names[k] for k in emptied])
        raise CapsNetError(f"a validation fraction of {fraction} holds out every training image of "
                           f"{'class' if len(emptied) == 1 else 'classes'} {names} in {dataset.name!r}")
    train, validation = (Split(dataset.train.images[i], labels[i]) for i in (kept, held))
    return dataclasses.replace(dataset, train=train, validation=validation, validation_fraction=fraction)


def data_location(spec: str) -> str:
    """`spec` as load_dataset will find it again from another working directory."""
    return spec if spec == "embedded" else str(Path(spec).resolve())


def to_float(images: np.ndarray | Tensor) -> Tensor:
    """uint8 (N, C, H, W) -> float32 in [0, 1]."""
    return torch.as_tensor(images).float().div_(255.0)


def channel_mean_std(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 (N, C, H, W) images on the [0, 1] scale (for input normalisation)."""
    scaled = images.astype(np.float64) / 255.0  # (N, C, H, W)
    mean = scaled.mean(axis=(0, 2, 3))  # (C,)
    std = np.maximum(scaled.std(axis=(0, 2, 3)), 1e-6)  # (C,): a blank channel must not divide by 0
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def random_shift(images: Tensor, max_shift: int, generator: torch.Generator | None = None) -> Tensor:
    """Shift each image by up to `max_shift` pixels in x and y, zero-filled (the paper's augmentation)."""
    if max_shift <= 0:
        return images
    batch, _, height, width = images.shape
    padded = F.pad(images, (max_shift,) * 4)  # (B, C, H+2s, W+2s)
    offsets = _shift_offsets(batch, max_shift, generator)  # (B, 2): dy, dx
    rows = offsets[:, :1] + torch.arange(height)  # (B, H)
    cols = offsets[:, 1:] + torch.arange(width)  # (B, W)
    samples = torch.arange(batch)[:, None, None]  # (B, 1, 1)
    # One gather for the whole batch; advanced indices around the channel slice put it last.
    shifted = padded[samples, :, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return shifted.permute(0, 3, 1, 2).contiguous()  # (B, C, H, W)


def _shift_offsets(batch: int, max_shift: int, generator: torch.Generator | None) -> Tensor:
    return torch.randint(0, 2 * max_shift + 1, (batch, 2), generator=generator)  # (B, 2): dy, dx


def random_flip(images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image left to right with probability 1/2: for data without a handedness (clothes), not digits."""
    flipped = _flip_draws(len(images), generator)  # (B,)
    return torch.where(flipped[:, None, None, None], images.flip(-1), images)  # (B, C, H, W)


def _flip_draws(batch: int, generator: torch.Generator | None) -> Tensor:
    return torch.rand(batch, generator=generator) < 0.5  # (B,)


# Random erasing (Zhong et al. 2020): the rectangle covers 2-40% of the image, aspect ratio 0.3-3.3.
ERASE_AREA = (0.02, 0.4)
ERASE_ASPECT = (0.3, 1 / 0.3)


def random_erase(images: Tensor, probability: float, generator: torch.Generator | None = None) -> Tensor:
    """With `probability`, set a random rectangle of each image to 0 (the background). A rectangle taller or
    wider than the image is cut to it, where the paper draws again; the reconstruction target is the erased
    image, as it is the shifted one."""
    batch, _, height, width = images.shape
    draws = _erase_draws(batch, generator)  # (B, 5): apply, area, aspect, top, left
    area = (ERASE_AREA[0] + (ERASE_AREA[1] - ERASE_AREA[0]) * draws[:, 1]) * height * width  # (B,)
    low, high = math.log(ERASE_ASPECT[0]), math.log(ERASE_ASPECT[1])
    aspect = torch.exp(low + (high - low) * draws[:, 2])  # (B,): height / width
    box_height = torch.sqrt(area * aspect).round().clamp(1, height)  # (B,)
    box_width = torch.sqrt(area / aspect).round().clamp(1, width)  # (B,)
    top = torch.floor(draws[:, 3] * (height - box_height + 1))  # (B,)
    left = torch.floor(draws[:, 4] * (width - box_width + 1))  # (B,)
    rows = torch.arange(height)  # (H,)
    cols = torch.arange(width)  # (W,)
    in_rows = (rows >= top[:, None]) & (rows < (top + box_height)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + box_width)[:, None])  # (B, W)
    erased = in_rows[:, :, None] & in_cols[:, None, :] & (draws[:, 0] < probability)[:, None, None]  # (B, H, W)
    return images.masked_fill(erased[:, None], 0.0)  # (B, C, H, W)


def _erase_draws(batch: int, generator: torch.Generator | None) -> Tensor:
    return torch.rand(batch, 5, generator=generator)  # (B, 5)


@dataclass(frozen=True)
class Augmentation:
    """The training augmentation: a random shift of up to `max_shift` pixels (a random crop of the image
    zero-padded by `max_shift`), then, with `hflip`, a random left-right mirror, then, with probability
    `erase`, random erasing."""

    max_shift: int = 0
    hflip: bool = False
    erase: float = 0.0

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        images = random_shift(images, self.max_shift, generator)  # (B, C, H, W)
        if self.hflip:
            images = random_flip(images, generator)
        return random_erase(images, self.erase, generator) if self.erase > 0 else images

    def skip(self, batch_sizes: list[int], generator: torch.Generator) -> None:
        """Advance `generator` past the draws augmenting these batches makes (a run resumed mid-epoch)."""
        for batch in batch_sizes:
            if self.max_shift > 0:
                _shift_offsets(batch, self.max_shift, generator)
            if self.hflip:
                _flip_draws(batch, generator)
            if self.erase > 0:
                _erase_draws(batch, generator)
