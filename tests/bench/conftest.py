"""Bench test fixtures: the tiny model exported once (FP32 + INT8) for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_export(random_tiny_checkpoint, tmp_path_factory) -> Path:
    from capsnet.export.exporter import export_model

    out = tmp_path_factory.mktemp("bench-export") / "model"
    # Untrained weights: the INT8 accuracy change is noise, so the exporter must not refuse it.
    export_model(random_tiny_checkpoint, out, int8=True, max_accuracy_drop=100.0)
    return out
