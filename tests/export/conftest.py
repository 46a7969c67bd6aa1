"""Export fixtures: one full export of the trained tiny model, shared by every export test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from capsnet.training.data import Dataset, load_dataset


@dataclass
class TinyExport:
    checkpoint: Path
    out: Path  # the export directory
    repo: Path  # the Triton model repository
    sidecar: dict


@pytest.fixture(scope="session")
def embedded() -> Dataset:
    return load_dataset("embedded")


@pytest.fixture(scope="session")
def tiny_export(trained_tiny_checkpoint, full_tiny_export) -> TinyExport:
    """The trained tiny model exported with every CPU option (tests/conftest.py's full_tiny_export)."""
    out, repo = full_tiny_export / "model", full_tiny_export / "triton"
    return TinyExport(trained_tiny_checkpoint, out, repo, json.loads((out / "model.json").read_text()))
