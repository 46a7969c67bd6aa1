"""The figures of docs/experiments/pairs.md from a folder that scripts/experiments/pairs.sh filled.

Usage: python scripts/experiments/pairs_summary.py RUNS_DIR DOCS_DIR
Reads each <preset>-seed<N>.last.ckpt (every epoch's record) and <preset>-seed<N>.pairs.json (`capsnet eval
--pairs side-by-side --json` of the checkpoint chosen on validation). Writes to DOCS_DIR the per-epoch records and
the scores as JSON lines, named by what they hold, and prints the Markdown table: each figure per seed, then
mean, standard deviation (n − 1) and range over the seeds.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from capsnet.models.checkpoint import load_checkpoint

RUN_NAME = re.compile(r"(?P<preset>.+)-seed(?P<seed>\d+)\.pairs\.json$")
EPOCHS_FILE = "pairs-mnist-{epochs}-epochs-per-epoch-cpu.jsonl"
SCORES_FILE = "pairs-mnist-{epochs}-epochs-side-by-side-test-scores-cpu.jsonl"
FIGURES = (("accuracy", "single digits"), ("top2_accuracy", "top-2 set"),
           ("top2_both_present_accuracy", "top-2, both > 0.5"))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    runs_dir, docs_dir = map(Path, argv)
    epoch_lines, score_lines = [], []
    by_preset: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in sorted(runs_dir.glob("*-seed*.pairs.json")):
        match = RUN_NAME.search(path.name)
        preset, seed = match["preset"], int(match["seed"])
        report = json.loads(path.read_text())
        last = load_checkpoint(runs_dir / f"{preset}-seed{seed}.last.ckpt")
        chosen = load_checkpoint(runs_dir / f"{preset}-seed{seed}.ckpt")
        for record in last.history:
            epoch_lines.append({"preset": preset, "seed": seed, "arch": last.config.arch, **record})
        figures = {"accuracy": report["accuracy"], **{k: report["pairs"][k] for k, _ in FIGURES[1:]}}
        score_lines.append({"preset": preset, "seed": seed, "chosen_epoch": chosen.epoch,
                            "validation_accuracy": chosen.metrics["validation_accuracy"], **figures,
                            "pairs": report["pairs"]["count"], "pair_seed": report["pairs"]["seed"],
                            "train_seconds": [record["train_seconds"] for record in last.history]})
        by_preset[preset][seed] = score_lines[-1]
    if not score_lines:
        print(f"pairs_summary: no <preset>-seed<N>.pairs.json in {runs_dir}", file=sys.stderr)
        return 2
    epochs = max(line["epoch"] for line in epoch_lines)
    for name, lines in ((EPOCHS_FILE.format(epochs=epochs), epoch_lines),
                        (SCORES_FILE.format(epochs=epochs), score_lines)):
        (docs_dir / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    print("| model | seed | chosen epoch | validation | " + " | ".join(label for _, label in FIGURES) + " |")
    print("|---|---|---|---|" + "---|" * len(FIGURES))
    for preset, seeds in by_preset.items():
        for seed, line in sorted(seeds.items()):
            print(f"| `{preset}` | {seed} | {line['chosen_epoch']} | {100 * line['validation_accuracy']:.2f}% | "
                  + " | ".join(f"{100 * line[key]:.2f}%" for key, _ in FIGURES) + " |")
        values = {key: [100 * line[key] for line in seeds.values()] for key, _ in FIGURES}
        print(f"| `{preset}` | mean ± sd (range) | | | " + " | ".join(
            f"**{statistics.mean(v):.2f}** ± {statistics.stdev(v) if len(v) > 1 else 0:.2f} "
            f"({min(v):.2f}–{max(v):.2f})" for v in values.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
