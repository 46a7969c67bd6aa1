"""INT8 accuracy of one exported model under each calibration choice, on its whole test split.

    python scripts/experiments/int8_calibration.py DIR [--data DIR] [--images 200,1000] [--out results.jsonl]

DIR is a `capsnet export` directory (its model.onnx and model.ckpt). For each number of calibration images (the
first N of the training split, as export takes them) and each choice (minmax; the 99.999th, 99.99th, 99.95th,
99.9th (export's) and 99.5th percentile of |values|; entropy; minmax and two percentiles with the first convolution
kept FP32), it writes the QDQ INT8 model as export would and measures its top-1 accuracy with ONNX Runtime against
FP32's, one JSON line each, with the CPU kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from capsnet.runtime.cpu import CpuKind
from capsnet.export.parity import onnxruntime_probabilities, onnxruntime_session
from capsnet.export.quantize import Calibration, quantize_int8
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.evaluate import load_checkpoint_data

CHOICES = (Calibration("minmax"), Calibration("percentile", 99.999), Calibration("percentile", 99.99),
           Calibration("entropy"), Calibration("minmax", float_first_convolution=True),
           Calibration("percentile", 99.999, float_first_convolution=True), Calibration("percentile", 99.95),
           Calibration("percentile", 99.9), Calibration("percentile", 99.5),
           Calibration("percentile", 99.99, float_first_convolution=True))


def accuracy(session, images: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    predictions = onnxruntime_probabilities(session, images).argmax(axis=1)
    return float((predictions == labels).mean()), predictions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="a `capsnet export` directory")
    parser.add_argument("--data", default=None, help="the data (default: the checkpoint's)")
    parser.add_argument("--images", default="200,1000", metavar="N,M", help="calibration image counts")
    parser.add_argument("--choices", default=None, metavar="I,J", help="indices into the choices (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    args = parser.parse_args()
    checkpoint_path = args.export / "model.ckpt"
    checkpoint = load_checkpoint(checkpoint_path)
    dataset = load_checkpoint_data(checkpoint, checkpoint_path, args.data, every_class=True)
    test = dataset.test
    fp32 = args.export / "model.onnx"
    fp32_accuracy, fp32_predictions = accuracy(onnxruntime_session(str(fp32)), test.images, test.labels)
    cpu = CpuKind.this_host().describe()
    choices = CHOICES if args.choices is None else [CHOICES[int(index)] for index in args.choices.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        for count in map(int, args.images.split(",")):
            for choice in choices:
                started = time.perf_counter()
                int8 = Path(scratch) / "model.int8.onnx"
                quantize_int8(fp32, int8, dataset.train.images[:count], choice)
                int8_accuracy, predictions = accuracy(onnxruntime_session(str(int8)), test.images, test.labels)
                record = {"model": str(args.export), "dataset": dataset.name, "epochs": checkpoint.epoch,
                          "calibration_images": count, "calibration": choice.describe(),
                          "fp32_accuracy": fp32_accuracy, "int8_accuracy": int8_accuracy,
                          "change_points": round(100 * (int8_accuracy - fp32_accuracy), 2),
                          "same_class": float((predictions == fp32_predictions).mean()), "test_images": len(test),
                          "cpu": cpu, "seconds": round(time.perf_counter() - started, 1)}
                line = json.dumps(record)
                print(line, flush=True)
                if args.out:
                    with args.out.open("a") as stream:
                        stream.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
