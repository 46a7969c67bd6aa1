"""Does a model that takes any size answer a digit the same on a larger blank canvas? The figures of
docs/experiments/pairs.md: each test digit alone (28x28), beside a blank square (28x56, as in a pair but with no
second digit) and in the middle of a blank strip (28x84); accuracy, the true class's mean length, and the share of
digits where another class is above 0.5 (present).

Usage: python scripts/experiments/blank_canvas.py CHECKPOINT --data DIR
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset
from capsnet.training.evaluate import Scoring
from capsnet.training.robustness import PRESENT_THRESHOLD, class_probabilities


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True)
    args = parser.parse_args()
    model = load_checkpoint(args.checkpoint).build_model()
    test = load_dataset(args.data).test
    blank = np.zeros_like(test.images)  # (N, C, H, W)
    canvases = {"alone": test.images, "beside a blank square": np.concatenate([test.images, blank], axis=3),
                "in a blank strip three times as wide": np.concatenate([blank, test.images, blank], axis=3)}
    rows = np.arange(len(test))
    report = {"checkpoint": args.checkpoint, "test_images": len(test)}
    for name, images in canvases.items():
        lengths = class_probabilities(model, images, Scoring(250, torch.device("cpu")))  # (N, J)
        others = lengths.copy()
        others[rows, test.labels] = -1.0
        report[name] = {"image_shape": list(images.shape[1:]),
                        "accuracy": float((lengths.argmax(axis=1) == test.labels).mean()),
                        "true_class_mean_length": float(lengths[rows, test.labels].mean()),
                        "another_class_present": float((others.max(axis=1) > PRESENT_THRESHOLD).mean())}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
