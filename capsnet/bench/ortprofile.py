"""ONNX Runtime's own profiler: the time per operator type, and which kernels (op, dtypes, provider) ran.

The session is set up like the server's ONNX Runtime backend (all graph optimisations, one
inter-op thread, intra-op threads that sleep rather than spin between operators), so the op types are those after fusion (e.g. QLinearConv for a Q/DQ convolution).
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

WARMUP_RUNS = 3


def profile_onnx(path: Path, images: np.ndarray, threads: int, runs: int) -> dict:
    """Profile `runs` runs on images (N, C, H, W) after a warm-up; op types by share of node time."""
    with tempfile.TemporaryDirectory(prefix="capsnet-ort-profile-") as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: images}
        for _ in range(WARMUP_RUNS + runs):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    timed_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-runs:]
    start = timed_runs[0]["ts"]
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, set] = defaultdict(set)
    for event in events:
        if event.get("cat") != "Node" or event["ts"] < start:
            continue
        args = event["args"]
        op_type = args["op_name"]
        totals[op_type] += event["dur"]
        input_types = ", ".join(next(iter(shape)) for shape in args.get("input_type_shape", []) if shape)
        kernels[op_type].add(f"{args.get('provider', '?')} ({input_types})")
    node_time = sum(totals.values())
    return {
        "onnx": path.name,
        "batch_size": len(images),
        "runs": runs,
        "op_types": [
            {"op_type": op_type, "share": micros / node_time, "ms_per_run": micros / runs / 1e3,
             "kernels": sorted(kernels[op_type])}
            for op_type, micros in sorted(totals.items(), key=lambda item: -item[1])
        ],
    }


CONV_OP_TYPES = ("Conv", "QLinearConv", "FusedConv", "NchwcConv")


def conv_rate(profile: dict, conv_flops_per_image: int, images_per_s: float) -> dict:
    """How fast the convolutions ran inside the model: their share of the profiled node time applied to
    the measured throughput at the profiled batch size (G multiply-add pairs per second; int8 for INT8)."""
    share = sum(op["share"] for op in profile["op_types"] if op["op_type"] in CONV_OP_TYPES)
    return {"conv_share": share, "conv_gops_in_model": conv_flops_per_image * images_per_s / share / 1e9}
