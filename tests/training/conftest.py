"""Helpers for the training tests: a colour data set (IDX files written by the shared `idx_dataset`)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture()
def random_colour_dataset(idx_dataset):
    """A 3x32x32 data set of random images (IDX stores them (N, H, W, C)), 10 classes."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(96, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(96) % 10
    return idx_dataset(images[:64], labels[:64], images[64:], labels[64:], name="colour-32")
