"""ONNX Runtime's OpenVINO execution provider against the same build's CPU provider, on an export's FP32 and INT8
graphs, in one run (docs/benchmarks/openvino.md). It needs `onnxruntime-openvino`, which replaces the `onnxruntime`
module: run it in a virtual environment of its own with numpy, never in the server's.

    python scripts/openvino_provider_race.py EXPORT_DIR [--threads 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

BATCHES = (1, 16, 64)


def session(path: str, openvino: bool, threads: int) -> ort.InferenceSession:
    """A session set up as the server's ONNX Runtime backend sets up its own, on the CPU or OpenVINO provider."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = ([("OpenVINOExecutionProvider", {"device_type": "CPU", "num_of_threads": threads, "precision": "FP32"})]
                 if openvino else ["CPUExecutionProvider"])
    return ort.InferenceSession(path, options, providers=providers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    files = {"fp32": "model.onnx", "int8": "model.int8.onnx"}
    engines = {(provider, precision): session(f"{args.export}/{file}", provider == "openvino", args.threads)
               for precision, file in files.items() for provider in ("cpu", "openvino")}
    print(f"onnxruntime-openvino {ort.__version__}; images/s, median of {args.rounds} rounds taken in turns")
    for batch in BATCHES:
        images = np.random.default_rng(0).random((batch, 1, 28, 28), dtype=np.float32)  # (B, C, H, W)
        feed = {"images": images}
        for engine in engines.values():
            for _ in range(3):
                engine.run(["probabilities"], feed)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        for _ in range(args.rounds):
            for key, engine in engines.items():
                started = time.perf_counter()
                engine.run(["probabilities"], feed)
                times[key].append(time.perf_counter() - started)
        median = {key: statistics.median(taken) for key, taken in times.items()}
        cells = [f"{provider} {precision} {batch / median[provider, precision]:,.0f} "
                 f"({median['cpu', precision] / median[provider, precision]:.2f}x)" for provider, precision in engines]
        print(f"batch {batch}: {', '.join(cells)}")


if __name__ == "__main__":
    main()
