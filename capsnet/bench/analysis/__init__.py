"""The analysis of a benchmark, apart from the measuring core (capsnet.bench): the CPU's fp32 ceiling (FLOPs per
image from the graph, and the peak measured beside the backends), ONNX Runtime's profile, the public PyTorch
CapsNet as a reference backend, the performance targets (the GPU check's too) and the plots.

It is installed with the bench extra, `pip install 'capsnet-serve[bench]'`, which brings matplotlib; the serving
image leaves it out. `capsnet bench` measures throughput and latency without it and says in one line what to
install. This module imports nothing heavy, so asking whether the analysis can run costs nothing.
"""

from __future__ import annotations

INSTALL = "pip install 'capsnet-serve[bench]'"
WHAT = "the CPU's ceiling, ONNX Runtime's profile, the public reference, the targets and the plots"


def missing() -> str | None:
    """Why the analysis cannot run here (the bench extra is not installed), in one line; None where it can."""
    try:
        import matplotlib  # noqa: F401 - the extra's dependency
    except ImportError:
        return f"{WHAT} need the bench extra: {INSTALL}"
    return None
