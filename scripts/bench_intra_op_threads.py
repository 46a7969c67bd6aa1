"""ONNX Runtime's intra-op threads and spinning, called in process: CPU time per image (this process's, all its
threads') and images/s at the batch sizes a server forms, for 1 and 2 threads with spinning on and off. The settings
take turns in a shuffled order within every round, so that load from other work falls on all of them alike; the
figures are medians over the rounds. With one thread there is no pool, so its two spinning settings are one setting
measured twice: their difference is the run's noise.

    python scripts/bench_intra_op_threads.py --model-dir EXPORT_DIR
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

BATCH_SIZES = (1, 4, 16, 64)
SETTINGS = ((1, False), (1, True), (2, False), (2, True))  # (intra-op threads, spinning)


def session(onnx: Path, threads: int, spinning: bool) -> ort.InferenceSession:
    """Set up as serving/engine/backends/onnxruntime_backend.py does, but for the threads and spinning."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="an export folder (its model.onnx)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=0.2, help="per setting, batch size and round")
    args = parser.parse_args(argv)
    sessions = {setting: session(args.model_dir / "model.onnx", *setting) for setting in SETTINGS}
    graph_input = sessions[SETTINGS[0]].get_inputs()[0]
    image = [d if isinstance(d, int) else 1 for d in graph_input.shape[1:]]
    cpu: dict = {(setting, size): [] for setting in SETTINGS for size in BATCH_SIZES}
    rate: dict = {key: [] for key in cpu}
    for _ in range(args.rounds):
        for size in BATCH_SIZES:
            feed = {graph_input.name: np.zeros((size, *image), np.float32)}
            for setting in random.sample(SETTINGS, len(SETTINGS)):
                sessions[setting].run(None, feed)
                runs, cpu_start, start = 0, time.process_time(), time.perf_counter()
                while time.perf_counter() < start + args.seconds:
                    sessions[setting].run(None, feed)
                    runs += 1
                cpu[setting, size].append((time.process_time() - cpu_start) * 1e3 / (runs * size))
                rate[setting, size].append(runs * size / (time.perf_counter() - start))
    print("| intra-op threads, spinning | " + " | ".join(f"CPU ms/image b{s}" for s in BATCH_SIZES) + " | "
          + " | ".join(f"images/s b{s}" for s in BATCH_SIZES) + " |")
    print("|---|" + "---:|" * 2 * len(BATCH_SIZES))
    for setting in SETTINGS:
        print(f"| {setting[0]}, {'spinning' if setting[1] else 'not spinning'} | "
              + " | ".join(f"{statistics.median(cpu[setting, s]):.3f}" for s in BATCH_SIZES) + " | "
              + " | ".join(f"{statistics.median(rate[setting, s]):,.0f}" for s in BATCH_SIZES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
