"""Helpers for the training tests: small MNIST-format IDX datasets written on the fly."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (the MNIST format): magic 0x0000 08 <ndim>, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


@pytest.fixture()
def idx_dataset(tmp_path):
    """make(images (N, H, W[, C]) uint8, labels, test_images, test_labels, gz=False) -> a folder of IDX files."""

    def make(train_images, train_labels, test_images, test_labels, gz: bool = False, name: str = "idx-data") -> Path:
        directory = tmp_path / name
        directory.mkdir()
        suffix = ".gz" if gz else ""
        write_idx(directory / f"train-images-idx3-ubyte{suffix}", train_images)
        write_idx(directory / f"train-labels-idx1-ubyte{suffix}", train_labels)
        write_idx(directory / f"t10k-images-idx3-ubyte{suffix}", test_images)
        write_idx(directory / f"t10k-labels-idx1-ubyte{suffix}", test_labels)
        return directory

    return make


@pytest.fixture()
def random_colour_dataset(idx_dataset):
    """A 3x32x32 data set of random images (IDX stores them (N, H, W, C)), 10 classes."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(96, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(96) % 10
    return idx_dataset(images[:64], labels[:64], images[64:], labels[64:], name="colour-32")
