"""Summarise training runs as a Markdown table, over the seeds of each configuration.

Usage:
  python scripts/experiments/summarize.py models/ablation/*.last.ckpt
      held-out accuracy after the last epoch (no selection): mean ± standard deviation and range
  python scripts/experiments/summarize.py --choose models/fashion-levers/*-seed?.ckpt
      the best checkpoints (chosen on validation): each configuration's mean validation accuracy, then the
      rule fixed before the runs: the run with the highest validation accuracy is the model, and its test
      accuracy is read once, for the report
A run is named <configuration>-seed<N>[.last].ckpt (as scripts/experiments/*.sh write them).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from capsnet.models.checkpoint import Checkpoint, load_checkpoint

RUN_NAME = re.compile(r"(?P<configuration>.+)-seed(?P<seed>\d+)(\.last)?\.ckpt$")


def main(argv: list[str]) -> int:
    choose = argv[:1] == ["--choose"]
    paths = argv[1:] if choose else argv
    runs: dict[str, dict[int, Checkpoint]] = defaultdict(dict)
    for path in paths:
        match = RUN_NAME.search(Path(path).name)
        if match is None:
            print(f"summarize: {path} is not named <configuration>-seed<N>[.last].ckpt", file=sys.stderr)
            return 2
        runs[match["configuration"]][int(match["seed"])] = load_checkpoint(path)
    if not runs:
        print("summarize: no checkpoints given", file=sys.stderr)
        return 2
    (print_choice if choose else print_last_epochs)(runs)
    return 0


def print_last_epochs(runs: dict[str, dict[int, Checkpoint]]) -> None:
    print("| configuration | seeds | held-out accuracy, mean ± std | range | per seed | training s per run |")
    print("|---|---|---|---|---|---|")
    for configuration, by_seed in runs.items():
        lasts = [by_seed[seed].history[-1] for seed in sorted(by_seed)]
        accuracies = [100 * last["test_accuracy"] for last in lasts]
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        seconds = statistics.mean(last["train_seconds"] for last in lasts)
        per_seed = ", ".join(f"{accuracy:.1f}" for accuracy in accuracies)
        print(f"| {configuration} | {len(accuracies)} | {statistics.mean(accuracies):.2f} ± {spread:.2f} | "
              f"{min(accuracies):.1f}–{max(accuracies):.1f} | {per_seed} | {seconds:.0f} |")


def print_choice(runs: dict[str, dict[int, Checkpoint]]) -> None:
    def validation(checkpoint: Checkpoint) -> float:
        return 100 * checkpoint.metrics["validation_accuracy"]

    means = {configuration: statistics.mean(map(validation, by_seed.values()))
             for configuration, by_seed in runs.items()}
    print("| configuration | seeds | best validation accuracy, mean | per seed (epoch) |")
    print("|---|---|---|---|")
    for configuration in sorted(runs, key=lambda name: -means[name]):
        by_seed = runs[configuration]
        per_seed = ", ".join(f"{validation(by_seed[seed]):.2f} ({by_seed[seed].epoch})" for seed in sorted(by_seed))
        print(f"| {configuration} | {len(by_seed)} | {means[configuration]:.2f} | {per_seed} |")
    name, chosen = max(((f"{configuration}-seed{seed}", checkpoint) for configuration, by_seed in runs.items()
                        for seed, checkpoint in by_seed.items()), key=lambda run: validation(run[1]))
    print(f"\nchosen: {name}, epoch {chosen.epoch}: validation {validation(chosen):.2f}%, "
          f"test {100 * chosen.metrics['test_accuracy']:.2f}%")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
