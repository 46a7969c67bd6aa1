"""tests/conftest.py makes the fused routing kernels run in Triton's CPU interpreter where there is no CUDA GPU.
The backend's tests serve through tests/serving's helpers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
