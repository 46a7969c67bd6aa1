"""The CPU engines of the backend table as the server builds them, timed in one run: ONNX Runtime and OpenVINO on the
export's FP32 and INT8 graphs (built by capsnet.bench.engines, as every benchmark builds them), and OpenVINO under other
settings with --openvino-settings (this study's own: no served engine). Each batch size is timed with the auto race's
loop (times_in_turns), the engines taking turns, so that other work on the machine slows every engine alike. Prints a
markdown table of images/s (median of the rounds) with each engine's ratio to ONNX Runtime at the same precision, and
one JSON object per cell with --json.

    python scripts/engine_race.py --model DIR [--batches 1 16 64] [--threads 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from capsnet.bench.engines import WARMUP_CALLS, Engine, build_engine
from capsnet.runtime.cpu import CpuKind
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import load_artifacts

# imports openvino when built
from capsnet.serving.engine.backends.openvino_backend import COMPILE_CONFIG, OpenVinoBackend
from capsnet.serving.engine.self_check import times_in_turns

# OpenVINO settings the served one is measured against (docs/serving.md, "OpenVINO")
OPENVINO_SETTINGS = {
    "throughput": {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": 2},
    "pinned": {"ENABLE_CPU_PINNING": True},
    "bf16": {"INFERENCE_PRECISION_HINT": "bf16"},
}


def static_shapes(artifacts, precision: str, threads: int, batches: list[int]) -> Callable[[np.ndarray], dict]:
    """OpenVINO with the graph compiled once per batch size, at a fixed batch: what "static shapes" would serve. A
    run of a batch size not compiled is a KeyError."""
    import openvino

    core = openvino.Core()
    requests = {}
    for batch in batches:
        model = core.read_model(str(artifacts.onnx[precision]))
        model.reshape({artifacts.input_name: [batch, *artifacts.input_shape]})
        compiled = core.compile_model(model, "CPU", {**COMPILE_CONFIG, "INFERENCE_NUM_THREADS": threads})
        requests[batch] = (compiled.create_infer_request(), compiled.output("probabilities"))

    def run(images: np.ndarray) -> dict[str, np.ndarray]:
        request, output = requests[len(images)]
        return {"probabilities": np.array(request.infer({artifacts.input_name: images})[output])}

    return run


def engines(model: Path, threads: int, batches: list[int], settings: list[str]) -> dict[str, Engine]:
    """The served engines as the benchmarks build them (capsnet.bench.engines), then this study's OpenVINO variants,
    which no registry row serves: by label, "<engine> <precision>[ <setting>]"."""
    artifacts = load_artifacts(model)
    config = ServerConfig(model_dir=model, threads=threads, max_batch_size=max(batches))
    built: dict[str, Engine] = {}
    for precision in ("fp32", "int8"):
        for name in ("onnxruntime", "openvino"):
            built[f"{name} {precision}"] = build_engine(f"{name}:{precision}", model, threads=threads,
                                                       max_batch=max(batches))
        for setting in settings:
            label = f"openvino {precision} {setting}"
            if setting == "static":
                built[label] = Engine(label, "static shapes", static_shapes(artifacts, precision, threads, batches))
            else:
                backend = OpenVinoBackend(artifacts, precision, config.intra_op_threads, OPENVINO_SETTINGS[setting])
                built[label] = Engine(label, backend.description, backend.run)
    return built


def race(built: dict[str, Engine], shape: tuple[int, ...], batches: list[int], rounds: int) -> dict:
    """{(engine, batch): [seconds of each round]}, the engines taking turns in every round."""
    times: dict[tuple[str, int], list[float]] = {}
    for batch in batches:
        images = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)  # (B, C, H, W)
        for engine in built.values():
            for _ in range(WARMUP_CALLS):  # allocations, kernel choices, a shape's first compilation
                engine.run(images)
        taken = times_in_turns({label: engine.run for label, engine in built.items()}, images, rounds)
        times.update({(label, batch): seconds for label, seconds in taken.items()})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an export folder with model.int8.onnx")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--openvino-settings", nargs="*", default=[], choices=[*OPENVINO_SETTINGS, "static"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    built = engines(args.model, args.threads, args.batches, args.openvino_settings)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"CPU: {CpuKind.this_host().describe()}; load average before: {load}")
    for label, engine in built.items():
        print(f"- {label}: {engine.description}")
    times = race(built, load_artifacts(args.model).input_shape, args.batches, args.rounds)
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}\n")
    print(f"| engine | {' | '.join(f'batch {b}' for b in args.batches)} |")
    print(f"|---|{'---|' * len(args.batches)}")
    for label in built:
        baseline = f"onnxruntime {label.split()[1]}"
        cells = []
        for batch in args.batches:
            rate = batch / statistics.median(times[(label, batch)])
            ratio = statistics.median(times[(baseline, batch)]) / statistics.median(times[(label, batch)])
            cells.append(f"{rate:,.0f} ({ratio:.2f}x)")
            if args.json:
                print(json.dumps({"engine": label, "batch": batch, "images_per_s": rate, "vs_onnxruntime": ratio}))
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
