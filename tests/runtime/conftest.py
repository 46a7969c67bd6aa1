"""The fused routing kernels' tests need triton (the dev extra installs it); tests/conftest.py makes them run in its
CPU interpreter where there is no CUDA GPU. The backend's tests serve through tests/serving's helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton, in the dev extra)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
