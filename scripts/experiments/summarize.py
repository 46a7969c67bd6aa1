"""Summarise training runs as a Markdown table: held-out accuracy after the last epoch, mean ± standard
deviation and range over the seeds of each configuration.

Usage: python scripts/experiments/summarize.py models/ablation/*.last.ckpt
A run is named <configuration>-seed<N>.last.ckpt (as scripts/experiments/ablation.sh writes them).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from capsnet.training.checkpoint import load_checkpoint

RUN_NAME = re.compile(r"(?P<configuration>.+)-seed(?P<seed>\d+)\.last\.ckpt$")


def main(paths: list[str]) -> int:
    runs: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    for path in paths:
        match = RUN_NAME.search(Path(path).name)
        if match is None:
            print(f"summarize: {path} is not named <configuration>-seed<N>.last.ckpt", file=sys.stderr)
            return 2
        checkpoint = load_checkpoint(path)
        last = checkpoint.history[-1]
        runs[match["configuration"]][int(match["seed"])] = (100 * last["test_accuracy"], last["train_seconds"])
    print("| configuration | seeds | held-out accuracy, mean ± std | range | per seed | training s per run |")
    print("|---|---|---|---|---|---|")
    for configuration, by_seed in runs.items():
        accuracies = [by_seed[seed][0] for seed in sorted(by_seed)]
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        seconds = statistics.mean(value[1] for value in by_seed.values())
        per_seed = ", ".join(f"{accuracy:.1f}" for accuracy in accuracies)
        print(f"| {configuration} | {len(accuracies)} | {statistics.mean(accuracies):.2f} ± {spread:.2f} | "
              f"{min(accuracies):.1f}–{max(accuracies):.1f} | {per_seed} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
