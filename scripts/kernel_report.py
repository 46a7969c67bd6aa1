"""Every Triton kernel the fused GPU engine launches, compiled for Hopper (sm_90a) on a CPU machine and read there
(scripts/kernel_reading.py): registers, spills and shared memory, CTAs per SM and occupancy on an H100/H200, waves,
the product instruction, the barriers and SASS instructions of the capsule loop, and a time modelled from those
counts.

The kernels are compiled by the Triton release the GPU machines run (TRITON_RELEASE); where another is installed,
that release is installed once into a cache folder of its own (pip, --target) and the report runs there.

    python scripts/kernel_report.py --markdown docs/benchmarks/kernels.md --json kernels.json

--baseline adds each plan's figures beside those of an earlier --json (one --label names what that reading was of).

Exit status 3 (and one line) where that Triton cannot be installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kernel_reading import (BATCHES, MODEL, PRECISIONS, SMS, TRITON_RELEASE, KernelReading, engine_readings,
                            triton_cache_home)

CANNOT_INSTALL = 3


# ---------------------------------------------------------------- the Triton release the GPU machines run

def installed_triton() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_release() -> Path | None:
    """None where TRITON_RELEASE is the installed Triton; else the folder it was installed into (once). Raises
    RuntimeError with pip's last line where it cannot be installed."""
    if installed_triton() == TRITON_RELEASE:
        return None
    target = triton_cache_home() / f"triton-{TRITON_RELEASE}"
    if not (target / "triton" / "__init__.py").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="triton-", dir=target.parent))  # renamed into place once complete
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                               "--no-deps", "--target", str(staging), f"triton=={TRITON_RELEASE}"],
                              capture_output=True, text=True)
        if done.returncode:
            shutil.rmtree(staging, ignore_errors=True)
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise RuntimeError(last)
        staging.rename(target)
    return target


def run_in_release(argv: list[str]) -> int:
    """This script again, in a process whose Triton is TRITON_RELEASE, compiling rather than interpreting."""
    try:
        folder = ensure_release()
    except (RuntimeError, OSError) as err:
        print(f"kernel report: cannot install triton=={TRITON_RELEASE}: {err}", file=sys.stderr)
        return CANNOT_INSTALL
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_cache_home() / f"compiled-{TRITON_RELEASE}")
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, __file__, "--in-release", *argv], env=env).returncode


# ---------------------------------------------------------------- the report

def last_measured(repo: Path) -> dict[str, float]:
    """The fused engines' last measured time at batch 256 (ms, numpy in and out) from the committed GPU check."""
    record = json.loads((repo / "docs" / "benchmarks" / "gpu_check.json").read_text())
    choice = record.get("serve", {}).get("served", {}).get("choice", "")
    return {precision: float(ms) for precision, ms in re.findall(r"fused (fp32|fp16|bf16) ([\d.]+) ms", choice)}


def markdown(readings: list[KernelReading], measured: dict[str, float], command: str,
             baseline: dict | None = None, baseline_path: str = "") -> str:
    out = [
        "# The fused routing kernels, read for Hopper",
        "",
        "Every Triton kernel the fused GPU engine (`capsnet/runtime/fused_routing.py`) launches for the `paper` model",
        f"at the launch plans it picks for a {SMS}-SM GPU, compiled for `sm_90a` by Triton {TRITON_RELEASE} (the GPU",
        "machines' release) on a CPU machine and read from its cubin (`cuobjdump --dump-resource-usage`) and SASS",
        "(`nvdisasm -c`). Occupancy and waves are an H100's or an H200's (the same SMs); the modelled time an H200's.",
        "The figures are the compiler's, the same on any CPU; made on a 2-core AMD EPYC with AVX2 (no GPU) by:",
        "",
        "```bash",
        command,
        "```",
        "",
        "## The model",
        "",
        MODEL,
        "## Each kernel",
        "",
        "per (sample, capsule): warp-instructions of the loop body per sample and input capsule (body × warps ÷",
        "(samples × capsules a trip covers)). Modelled µs: all launches of that kernel in one forward pass.",
        "",
        "| dtype | batch | kernel | variant | grid | warps | stages | regs | spill B | smem KB | CTAs/SM "
        "| occupancy | waves | product | loop SASS | BAR.SYNC | LDS/STS | per (sample, capsule) | modelled µs "
        "| bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in readings:
        loop = r.loop
        out.append(
            f"| {r.precision} | {r.batch} | `{r.kernel}` | {r.variant} | {'×'.join(map(str, r.grid))} | {r.warps} "
            f"| {r.stages} | {r.registers} | {r.spill_bytes} | {r.shared_bytes / 1024:.1f} | {r.ctas_per_sm} "
            f"({r.limited_by}) | {r.occupancy:.1%} | {r.waves:.2f} | {loop.product if loop else '—'} "
            f"| {loop.instructions if loop else '—'} | {loop.barriers if loop else '—'} "
            f"| {loop.shared_accesses if loop else '—'} "
            f"| {f'{r.per_sample_capsule:.1f}' if r.per_sample_capsule is not None else '—'} "
            f"| {r.modelled_s * 1e6:.1f} | {r.bound} |")
    out += ["", "## A forward pass's routing, modelled", "",
            "| dtype | " + " | ".join(f"batch {b}" for b in BATCHES) + " | measured at 256 (whole engine) |",
            "|---|" + "---|" * (len(BATCHES) + 1)]
    for precision in PRECISIONS:
        cells = [f"{routing_time(readings, precision, b) * 1e6:.1f} µs" for b in BATCHES]
        seen = f"{measured[precision]:g} ms" if precision in measured else "—"
        out.append(f"| {precision} | " + " | ".join(cells) + f" | {seen} |")
    for precision in PRECISIONS:
        cells = [f"{routing_time(readings, precision, b, 'unbounded') * 1e6:.1f} µs" for b in BATCHES]
        out.append(f"| {precision}, shifted softmax | " + " | ".join(cells) + " | — |")
    out += [
        "",
        "The rows are the engine as a CapsNet's weights build it: at its initial scale every routing logit is bounded",
        "inside exp2's range, so the later passes take the softmax over the classes without its shift by the maximum",
        "(`fused_routing.logits_bounded`). The shifted-softmax rows are the plans served to weights that bound no",
        "logit (here 10 everywhere): one more reduction across warps per capsule.",
        "",
        "The last GPU check (an H200, 2026-11-27: `docs/benchmarks/gpu.md`, `gpu_check.json`) timed no kernel on its",
        "own, and none of the current kernels has run on a GPU. The measured column is the whole fused engine at batch",
        "256, numpy in and out, from `--backend auto`'s choice, when the backends ran the model once per output: a",
        "batch was three forward passes (probabilities, poses, reconstruction), each with its convolutions and its",
        "routing, for one copy in and out. Taking the copies (about 0.4 ms) and `torch.compile`'s two bf16",
        "convolutions of the same run (0.67 ms) as the fused engine's, fp16 routing took at most about 0.56 ms a",
        "forward pass there, against about 0.2 ms modelled for the launch plans it ran (those of commit c3a7af7). In",
        "fp32, the fused engine's 36.69 ms against the torch backend's 19.55 ms (strict-fp32 convolutions in both,",
        "three passes in both) would put about 5.7 ms a forward pass in the fp32 routing kernels, some 13 times their",
        "model then, if the fused engine's channels-last convolutions cost what the torch backend's do. Either the",
        "model misses a stall that dominates (a wait on every barrier with one CTA an SM), or the time is in the",
        "convolutions: the GPU check's profile of the fused engine, which separates the kernels' own time, settles it.",
        "",
    ]
    if baseline is not None:
        out += against_baseline(as_json(readings), baseline, baseline_path)
    return "\n".join(out)


def plan_summary(record: dict, precision: str, batch: int) -> dict[str, Any]:
    """One plan's kernels in a --json record, summed up: routing time, launches, the most registers, the least
    occupancy and the spills of any of its kernels."""
    kernels = [k for k in record["kernels"] if k["precision"] == precision and k["batch"] == batch
               and k.get("logits", "bounded") == "bounded"]
    return {
        "routing_s": record["routing_s"][precision][str(batch)],
        "launches": sum(k["launches"] for k in kernels),
        "registers": max(k["registers"] for k in kernels),
        "occupancy": min(k["occupancy"] for k in kernels),
        "spill_bytes": sum(k["spill_bytes"] for k in kernels),
    }


def against_baseline(now: dict, baseline: dict, path: str) -> list[str]:
    label = f": {baseline['label']}" if baseline.get("label") else ""
    out = [
        "## Against the baseline",
        "",
        f"Each plan now, after the reading in `{path}`{label}.",
        "",
        "Registers: the most any of the plan's kernels holds a thread; occupancy: the least; spill: all its kernels'",
        "together; routing: a forward pass's, modelled.",
        "",
        "| dtype | batch | routing µs | ratio | registers | occupancy | spill B | launches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision in PRECISIONS:
        for batch in BATCHES:
            was, is_ = plan_summary(baseline, precision, batch), plan_summary(now, precision, batch)
            out.append(
                f"| {precision} | {batch} | {was['routing_s'] * 1e6:.1f} → {is_['routing_s'] * 1e6:.1f} "
                f"| {was['routing_s'] / is_['routing_s']:.2f}× | {was['registers']} → {is_['registers']} "
                f"| {was['occupancy']:.1%} → {is_['occupancy']:.1%} | {was['spill_bytes']} → {is_['spill_bytes']} "
                f"| {was['launches']} → {is_['launches']} |")
    return [*out, ""]


def routing_time(readings: list[KernelReading], precision: str, batch: int, logits: str = "bounded") -> float:
    return sum(r.modelled_s for r in readings if r.precision == precision and r.batch == batch
               and r.logits == logits)


def as_json(readings: list[KernelReading], label: str = "") -> dict:
    return {
        "triton": TRITON_RELEASE,
        "label": label,
        "kernels": [dataclasses.asdict(r) for r in readings],
        "routing_s": {p: {str(b): routing_time(readings, p, b) for b in BATCHES} for p in PRECISIONS},
        "routing_unbounded_s": {p: {str(b): routing_time(readings, p, b, "unbounded") for b in BATCHES}
                                for p in PRECISIONS},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, help="write the report here (docs/benchmarks/kernels.md)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--label", default="", help="what this reading is of, kept in --json for a later --baseline")
    parser.add_argument("--baseline", type=Path, help="an earlier --json: each plan's figures beside its own")
    parser.add_argument("--in-release", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.in_release:
        return run_in_release([a for a in argv if a != "--in-release"])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # capsnet from this checkout, installed or not
    import triton
    if triton.__version__ != TRITON_RELEASE:
        print(f"kernel report: triton {triton.__version__} imported, {TRITON_RELEASE} wanted", file=sys.stderr)
        return CANNOT_INSTALL
    repo = Path(__file__).resolve().parents[1]
    try:
        baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    except (OSError, ValueError) as err:
        print(f"kernel report: --baseline {args.baseline}: {err}", file=sys.stderr)
        return 2
    readings = engine_readings()
    if args.json:
        args.json.write_text(json.dumps(as_json(readings, args.label), indent=1))
    command = "python scripts/kernel_report.py" + (f" --markdown {args.markdown}" if args.markdown else "") + (
        f" --baseline {args.baseline}" if args.baseline else "")
    text = markdown(readings, last_measured(repo), command, baseline, str(args.baseline or ""))
    if args.markdown:
        args.markdown.write_text(text)
    if not (args.json or args.markdown):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
