"""The fused routing kernels run in Triton's CPU interpreter where there is no CUDA GPU. Triton reads
TRITON_INTERPRET when a kernel is defined, so it is set here, before any test module imports the kernels."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton, in the dev extra)")
