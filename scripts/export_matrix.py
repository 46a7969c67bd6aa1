"""Every architecture through `capsnet train` and `capsnet export --int8` on the torch of this interpreter.

The exporters differ between torch releases (torch 2.11's ONNX exporter rewrites what 2.13's leaves alone), so each
torch the project declares in pyproject.toml is checked by running this under it, in CI (the environment's torch)
and before each release (the GPU machines' torch):

    python scripts/export_matrix.py --out /tmp/export-matrix             # tiny presets, one epoch: minutes on 2 cores
    python scripts/export_matrix.py --full --out /tmp/export-matrix      # the full presets (paper, em, shared, ...)

For each architecture (capsnet, em, shared-capsnet, gap-cnn, cnn-baseline) it trains one epoch on the embedded
digits, then exports with INT8: the ONNX graph must match PyTorch (export's parity check) and each variant is held to
the precision gate. An export that writes FP32 but has its INT8 refused by the gate (exit 3) counts as exported: the
gate ran; its figures are in the summary. Writes OUT/summary.json and OUT/<architecture>/{train,export}.log, prints
one line per architecture and exits 1 if any failed to train or export.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from capsnet.export.cli import EXIT_REFUSED

# architecture -> (tiny preset, full preset, extra flags)
ARCHITECTURES = {
    "capsnet": ("tiny", "paper", ()),
    "em": ("em-tiny", "em", ()),
    "shared-capsnet": ("shared-tiny", "shared", ()),
    "gap-cnn": ("gap-cnn-tiny", "gap-cnn", ()),
    "cnn-baseline": ("tiny", "paper", ("--arch", "cnn-baseline", "--reconstruction-weight", "0")),
}


def run(command: list[str], log: Path) -> tuple[int, float]:
    """`command` in the log's folder: from a checkout's root, `-m capsnet` would find its bare capsnet/ folder first,
    which holds only part of the package."""
    started = time.perf_counter()
    with log.open("w") as stream:
        code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=log.parent, check=False).returncode
    return code, time.perf_counter() - started


def check(architecture: str, full: bool, out: Path, device: str) -> dict:
    tiny, paper, flags = ARCHITECTURES[architecture]
    folder = out / architecture
    folder.mkdir(parents=True, exist_ok=True)
    capsnet = [sys.executable, "-m", "capsnet"]
    checkpoint = folder / "model.ckpt"
    code, seconds = run([*capsnet, "train", "--data", "embedded", "--preset", paper if full else tiny, *flags,
                         "--epochs", "1", "--device", device, "--no-progress", "--out", str(checkpoint)],
                        folder / "train.log")
    result: dict = {"preset": paper if full else tiny, "flags": list(flags), "train_exit": code,
                    "train_seconds": round(seconds, 1)}
    if code != 0:
        return {**result, "exported": False, "why": f"capsnet train exited {code} ({folder / 'train.log'})"}
    code, seconds = run([*capsnet, "export", str(checkpoint), "--out", str(folder / "export"), "--int8"],
                        folder / "export.log")
    result.update(export_exit=code, export_seconds=round(seconds, 1), exported=code in (0, EXIT_REFUSED))
    if not result["exported"]:
        lines = (folder / "export.log").read_text().strip().splitlines()
        return {**result, "why": lines[-1] if lines else f"capsnet export exited {code}"}
    description = json.loads((folder / "export" / "model.json").read_text())
    parity = description["parity"]["onnxruntime"]
    result.update(parity_max_abs_diff=parity["max_abs_diff"], argmax_agreement=parity["argmax_agreement"],
                  precision_gate={name: {key: gate[key] for key in ("accuracy_fp32", "accuracy",
                                                                    "accuracy_change_points", "max_drop_points")}
                                  for name, gate in description["precision_gate"]["variants"].items()},
                  refused=description.get("refused", {}))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the checkpoints, exports, logs and summary go")
    parser.add_argument("--full", action="store_true", help="the full presets rather than the tiny ones")
    parser.add_argument("--device", default="cpu", help="where training runs (default cpu; export runs on the CPU)")
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES), metavar="A,B",
                        help=f"a subset of {', '.join(ARCHITECTURES)} (default: all)")
    args = parser.parse_args()
    chosen = args.architectures.split(",")
    unknown = [name for name in chosen if name not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architecture {', '.join(unknown)}; choose from {', '.join(ARCHITECTURES)}")
    import onnxruntime
    import torch

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for architecture in chosen:
        results[architecture] = outcome = check(architecture, args.full, args.out, args.device)
        if outcome["exported"]:
            gate = outcome["precision_gate"].get("onnx_int8", {})
            print(f"{architecture}: exported on torch {torch.__version__}; ONNX vs PyTorch max |diff| "
                  f"{max(outcome['parity_max_abs_diff'].values()):.1e}; INT8 "
                  f"{gate.get('accuracy_change_points', float('nan')):+.2f} points"
                  f"{' (refused by the gate)' if outcome['refused'] else ''}", flush=True)
        else:
            print(f"{architecture}: FAILED on torch {torch.__version__}: {outcome['why']}", flush=True)
    summary = {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
               "machine": platform.machine(), "full": args.full, "architectures": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(outcome["exported"] for outcome in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
