"""ONNX Runtime's own profiler: the time per operator type, and which kernels (op, dtypes, provider) ran.

The session is set up like the server's ONNX Runtime backend (all graph optimisations, one
inter-op thread, intra-op threads that sleep rather than spin between operators), so the op types are
those after fusion (e.g. QLinearConv for a Q/DQ convolution). Several models are profiled with their
runs interleaved, so that other load on the machine falls on each alike; each op type's time is its
median over the runs.

`python -m capsnet.bench.analysis.ortprofile A.onnx B.onnx --batch 32` prints the comparison (e.g. a graph before
and after a change, as docs/benchmarks/routing-profile.md does).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from capsnet.errors import first_line

WARMUP_RUNS = 3
CONV_OP_TYPES = ("Conv", "QLinearConv", "FusedConv", "NchwcConv")


def profile_onnx(path: Path, images: np.ndarray, threads: int, runs: int) -> dict:
    """Profile `runs` runs on images (N, C, H, W) after a warm-up; op types by share of node time."""
    return profile_interleaved([path], images, threads, runs)[0]


def profile_interleaved(paths: list[Path], images: np.ndarray, threads: int, runs: int) -> list[dict]:
    """profile_onnx for each of `paths`, one run of each in turn."""
    with tempfile.TemporaryDirectory(prefix="capsnet-ort-profile-") as tmp:
        sessions = [_session(path, threads, Path(tmp) / f"profile{index}") for index, path in enumerate(paths)]
        feeds = [{session.get_inputs()[0].name: images} for session in sessions]
        for _ in range(WARMUP_RUNS):
            for session, feed in zip(sessions, feeds):
                session.run(None, feed)
        for _ in range(runs):
            for session, feed in zip(sessions, feeds):
                session.run(None, feed)
        events = [json.loads(Path(session.end_profiling()).read_text()) for session in sessions]
    return [_summarise(path, events_of_one, len(images), runs) for path, events_of_one in zip(paths, events)]


def _session(path: Path, threads: int, prefix: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_profiling = True
    options.profile_file_prefix = str(prefix)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _summarise(path: Path, events: list[dict], batch_size: int, runs: int) -> dict:
    """Op types by their median time per run over the last `runs` runs."""
    timed_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-runs:]
    starts = [run["ts"] for run in timed_runs]
    per_run: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(len(starts)))
    kernels: dict[str, set] = defaultdict(set)
    for event in events:
        if event.get("cat") != "Node" or event["ts"] < starts[0]:
            continue
        args = event["args"]
        op_type = args["op_name"]
        per_run[op_type][np.searchsorted(starts, event["ts"], side="right") - 1] += event["dur"]
        input_types = ", ".join(next(iter(shape)) for shape in args.get("input_type_shape", []) if shape)
        kernels[op_type].add(f"{args.get('provider', '?')} ({input_types})")
    medians = {op_type: float(np.median(micros)) for op_type, micros in per_run.items()}
    node_time = sum(medians.values())
    return {
        "onnx": path.name,
        "batch_size": batch_size,
        "runs": runs,
        "ms_per_run": node_time / 1e3,
        "op_types": [
            {"op_type": op_type, "share": micros / node_time, "ms_per_run": micros / 1e3,
             "kernels": sorted(kernels[op_type])}
            for op_type, micros in sorted(medians.items(), key=lambda item: -item[1])
        ],
    }


def conv_rate(profile: dict, conv_flops_per_image: int, images_per_s: float) -> dict:
    """How fast the convolutions ran inside the model: their share of the profiled node time applied to
    the measured throughput at the profiled batch size (G multiply-add pairs per second; int8 for INT8)."""
    share = sum(op["share"] for op in profile["op_types"] if op["op_type"] in CONV_OP_TYPES)
    return {"conv_share": share, "conv_gops_in_model": conv_flops_per_image * images_per_s / share / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capsnet.bench.analysis.ortprofile",
                                     description="ONNX Runtime's profile of ONNX files, their runs interleaved.")
    parser.add_argument("onnx", type=Path, nargs="+", help="ONNX files taking images (N, C, H, W)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    # --batch 0 profiled empty runs and --runs 0 the warm-up alone, each printed as a profile
    if not (1 <= args.batch <= 1024 and args.runs >= 1 and 1 <= args.threads <= 1024):
        parser.error("--batch and --threads must be from 1 to 1024, --runs at least 1")
    sessions = []
    for path in args.onnx:
        if not path.is_file():
            parser.error(f"{path} does not exist")
        try:
            sessions.append(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
        except Exception as err:  # onnxruntime's own error types: not an ONNX file, or one it cannot run
            parser.error(f"{path} is not an ONNX model ONNX Runtime can load: {first_line(err)}")
    graph_input = sessions[0].get_inputs()[0]
    shape = [args.batch, *graph_input.shape[1:]]  # the batch axis is symbolic
    images = np.random.default_rng(0).random(shape, dtype=np.float32)  # (batch, C, H, W)
    for profile in profile_interleaved(args.onnx, images, args.threads, args.runs):
        conv = sum(op["ms_per_run"] for op in profile["op_types"] if op["op_type"] in CONV_OP_TYPES)
        rest = profile["ms_per_run"] - conv
        print(f"{profile['onnx']}: batch {profile['batch_size']}, median of {profile['runs']} runs: node time "
              f"{profile['ms_per_run']:.1f} ms, convolutions {conv:.1f} ms, the rest {rest:.1f} ms "
              f"({rest / profile['ms_per_run'] * 100:.1f}%)")
        for op in profile["op_types"]:
            print(f"  {op['op_type']:<16} {op['ms_per_run']:8.2f} ms  {op['share'] * 100:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
