"""Bench test fixtures: the trained tiny model exported with INT8 (FP32 + INT8), the export the serving tests use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_export(int8_tiny_export) -> Path:
    return int8_tiny_export
