"""The machine's fp32 peak, measured: a large matmul and a convolution shaped like the model's PrimaryCaps.

The convolution runs in both PyTorch (oneDNN) and ONNX Runtime (MLAS) and the faster counts, so the
ceiling is the best this CPU does on the shape that holds almost all of CapsNet's work.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from capsnet.bench.timing import time_calls
from capsnet.models.config import CapsNetConfig

MATMUL_SIZE = 2048


def measure_peak(config: CapsNetConfig, *, batch: int, threads: int, min_seconds: float) -> dict:
    """GFLOP/s of a MATMUL_SIZE³ matmul and of a PrimaryCaps-shaped conv at `batch` images."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    a = torch.from_numpy(rng.random((MATMUL_SIZE, MATMUL_SIZE), dtype=np.float32))
    b = torch.from_numpy(rng.random((MATMUL_SIZE, MATMUL_SIZE), dtype=np.float32))
    matmul = _gflops(lambda: torch.mm(a, b), 2 * MATMUL_SIZE**3, min_seconds)

    grid_h, grid_w = config.primary_grid
    after_conv1 = (config.height - config.conv1_kernel + 1, config.width - config.conv1_kernel + 1)
    x = rng.random((batch, config.conv1_channels, *after_conv1), dtype=np.float32)  # (B, 256, 20, 20)
    out_channels = config.primary_caps_channels * config.primary_caps_dim
    kernel = config.primary_caps_kernel
    w = rng.random((out_channels, config.conv1_channels, kernel, kernel), dtype=np.float32) - 0.5  # (256, 256, 9, 9)
    conv_flops = 2 * batch * out_channels * grid_h * grid_w * config.conv1_channels * kernel * kernel
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    conv_torch = _gflops(
        lambda: F.conv2d(xt, wt, stride=config.primary_caps_stride), conv_flops, min_seconds
    )
    session = ort.InferenceSession(
        _conv_model(w, config.primary_caps_stride).SerializeToString(),
        _session_options(threads),
        providers=["CPUExecutionProvider"],
    )
    conv_ort = _gflops(lambda: session.run(None, {"x": x}), conv_flops, min_seconds)
    return {
        "threads": threads,
        "matmul": {"shape": [MATMUL_SIZE] * 3, "gflops": matmul},
        "conv": {
            "input_shape": list(x.shape),
            "weight_shape": list(w.shape),
            "stride": config.primary_caps_stride,
            "gflops_torch": conv_torch,
            "gflops_onnxruntime": conv_ort,
            "gflops": max(conv_torch, conv_ort),
        },
    }


def median_peak(runs: list[dict]) -> dict:
    """measure_peak() results, one per interleaved round -> the median figure of each, with every run kept.

    The median, like the backends' median call time over the same rounds: the ceiling then holds the machine
    to the conditions the backends ran under, where the best round would compare them with its calmest moment."""
    conv = {key: float(np.median([run["conv"][key] for run in runs])) for key in ("gflops_torch", "gflops_onnxruntime")}
    conv["gflops"] = max(conv.values())  # the faster implementation counts, as in measure_peak
    matmul = float(np.median([run["matmul"]["gflops"] for run in runs]))
    first = runs[0]
    return {**first, "matmul": {**first["matmul"], "gflops": matmul}, "conv": {**first["conv"], **conv}, "runs": runs}


def _gflops(fn, flops: int, min_seconds: float) -> float:
    fn()  # warm-up: first calls pick kernels and allocate
    durations = time_calls(fn, min_calls=5, min_seconds=min_seconds)
    return flops / float(np.median(durations)) / 1e9


def _conv_model(weight: np.ndarray, stride: int) -> onnx.ModelProto:
    """A one-node ONNX graph: Conv(x, weight) with a dynamic batch."""
    out_channels, in_channels = weight.shape[:2]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride, stride])],
        "primary_caps_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", in_channels, None, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", out_channels, None, None])],
        [numpy_helper.from_array(weight, "w")],
    )
    # IR 10 (not onnx's newest default), so any ONNX Runtime that reads opset 18 loads it
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return options
