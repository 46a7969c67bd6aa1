"""The GPU check's report: every part scripts/gpu_check.sh's steps wrote so far, merged into OUT/gpu_check.json and
OUT/gpu_check.md, with what did not run and why, and the targets (capsnet/bench/analysis/targets.py) met or missed.

    python scripts/gpu_check_report.py --work DIR --out OUT

scripts/gpu_check.sh rewrites it after every step, so a check cut short still leaves its figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from capsnet.bench.analysis.targets import evaluate_gpu
from capsnet.bench.gpu_check import SERVE_MAX_BATCH
from capsnet.bench.harness import ratios
from capsnet.bench.results import COMPILE, EAGER, NUMPY, ON_DEVICE, PUBLIC, cells


def report(args) -> None:
    work, out = Path(args.work), Path(args.out)
    parts = {path.stem: json.loads(path.read_text()) for path in sorted((work / "parts").glob("*.json"))}
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()] if (
        work / "steps.jsonl").is_file() else []
    summary = {"steps": steps, **parts}
    flops = parts.get("flops", {}).get("flops_per_image")
    summary["analysis"] = _analysis(parts, flops)
    summary["engine_ratios"] = ratios(parts["engines"]) if "engines" in parts else {}
    summary["targets"] = evaluate_gpu(summary["engine_ratios"], {
        key: value for key, value in summary["analysis"].items() if key.startswith("served_")})
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    try:
        markdown = _markdown(summary, parts)
        if "engines" in parts:
            markdown += engines_markdown(parts["engines"])
    except Exception as err:  # a part missing a field must not cost the report: the JSON has everything
        markdown = f"# GPU check\n\nthe table could not be written ({type(err).__name__}: {err}); see gpu_check.json\n"
    (out / "gpu_check.md").write_text(markdown)


def _cells(parts: dict) -> dict[tuple[str, int], dict]:
    """(engine, batch) -> figures (numpy in and out) of the engines steps, with the engine's name and the step; the
    model eager or compiled are left out."""
    found = {}
    for name in sorted(parts):
        if name.startswith("engines"):
            for (engine, batch), figures in cells(parts[name]["measurements"], NUMPY).items():
                if engine not in (EAGER, COMPILE):
                    found[engine, batch] = {"engine": engine, **figures, "step": name}
    return found


def _f(value, spec: str) -> str:
    """`value` formatted, or a dash for a figure that was not measured."""
    return "—" if value is None else format(value, spec)


def _analysis(parts: dict, flops: float | None) -> dict:
    cells = _cells(parts)
    peak, analysis = parts.get("peak", {}), {}
    ours = {key: row for key, row in cells.items() if key[0] != PUBLIC}
    for batch in sorted({batch for _, batch in cells}):
        public = cells.get((PUBLIC, batch))
        candidates = [row for (spec, b), row in ours.items() if b == batch]
        if not candidates:
            continue
        best = max(candidates, key=lambda row: row["images_per_s"])
        entry = {"best": best["engine"], "best_images_per_s": best["images_per_s"], "best_p50_ms": best["p50_ms"]}
        if public:
            entry["public_images_per_s"] = public["images_per_s"]
            entry["speedup_vs_public"] = best["images_per_s"] / public["images_per_s"]
        if flops and peak:
            precision = best["engine"].split(":")[1]
            tflops = peak.get(f"matmul_{precision}_tflops") or peak.get("matmul_fp32_tflops")
            entry["achieved_tflops"] = flops * best["images_per_s"] / 1e12
            entry["share_of_matmul_peak"] = entry["achieved_tflops"] / tflops if tflops else None
            moved = parts["flops"]["bytes_in_per_image"] / (peak["h2d_gb_s"] * 1e9) + \
                parts["flops"]["bytes_out_per_image"] / (peak["d2h_gb_s"] * 1e9)
            entry["share_of_copy_bound"] = moved * best["images_per_s"]
        analysis[f"batch_{batch}"] = entry
    served = parts.get("serve", {})
    if served.get("cells"):
        reference = cells.get((f"{served['served']['backend']}:{served['served']['precision']}", 32))
        for cell in served["cells"]:
            most = max(c["concurrency"] for c in served["cells"])
            if cell["images_per_request"] == 32 and cell["concurrency"] == most:
                if reference:
                    analysis[f"served_{cell['api']}_share_of_inprocess_batch32"] = \
                        cell["images_per_s"] / reference["images_per_s"]
            if cell["images_per_request"] == 1 and cell["concurrency"] == 1:
                analysis[f"served_{cell['api']}_one_image_p50_ms"] = cell["p50_ms"]
    return analysis


def _markdown(summary: dict, parts: dict) -> str:
    facts_ = parts.get("facts", {})
    dry = facts_.get("dry_run")
    lines = ["# GPU check" + (" — CPU DRY RUN (no GPU: every figure below is the CPU's)" if dry else ""), ""]
    if facts_:
        lines += [f"- device: {facts_.get('gpu', 'CPU only')} (compute capability {facts_.get('compute_capability')}, "
                  f"{facts_.get('gpu_memory_gib')} GiB), driver {facts_.get('driver')}" if not dry else
                  "- device: the CPU (dry run)",
                  f"- torch {facts_.get('torch')}, CUDA {facts_.get('cuda')}, cuDNN {facts_.get('cudnn')}, Python "
                  f"{facts_.get('python')}",
                  f"- CPU: {facts_.get('cpu')}, {facts_.get('cores')} cores, load average {facts_.get('load_average')}"]
    peak_ = parts.get("peak")
    if peak_:
        lines.append(f"- same-run peaks: matmul {peak_['matmul_size']}³ bf16 {peak_['matmul_bf16_tflops']:.1f}, fp16 "
                     f"{peak_['matmul_fp16_tflops']:.1f}, fp32 (no TF32) {peak_['matmul_fp32_tflops']:.1f} TFLOP/s; "
                     f"pinned copies H2D {peak_['h2d_gb_s']:.1f}, D2H {peak_['d2h_gb_s']:.1f} GB/s")
    lines += ["", "## Steps", "", "| step | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['limit']} |" for s in summary["steps"]]
    cells = _cells(parts)
    if cells:
        specs = list(dict.fromkeys(spec for spec, _ in cells))
        batches = sorted({batch for _, batch in cells})
        lines += ["", "## In process (numpy in, numpy out: copies to and from the device included)", "",
                  "p50 ms per batch / images per second", "",
                  "| engine | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for spec in specs:
            row = [f"{cells[spec, b]['p50_ms']:.3f} / {cells[spec, b]['images_per_s']:,.0f}" if (spec, b) in cells
                   else "—" for b in batches]
            lines.append(f"| {spec} | " + " | ".join(row) + " |")
    served = parts.get("serve")
    if served:
        lines += ["", f"## Served ({served.get('served', {}).get('backend')} "
                      f"{served.get('served', {}).get('precision')}, --max-batch-size {SERVE_MAX_BATCH}; started in "
                      f"{served.get('startup_s', 0):.1f} s)", "",
                  f"auto's choice: {served.get('served', {}).get('choice')}", "",
                  "| API | images/request | concurrency | client processes | images/s | p50 ms | p99 ms | mean batch | "
                  "errors |", "|---|---|---|---|---|---|---|---|---|"]
        for c in served.get("cells", []):
            lines.append(f"| {c['api']} | {c['images_per_request']} | {c['concurrency']} | {c['client_processes']} | "
                         f"{_f(c['images_per_s'], ',.0f')} | {_f(c['p50_ms'], '.2f')} | {_f(c['p99_ms'], '.2f')} | "
                         f"{_f(c.get('mean_batch'), '.1f')} | {c['errors'] or ''} |")
    for name in ("aoti_export", "tests"):
        if name in parts:
            lines += ["", f"## {name}", "", "```", parts[name].get("tail", ""), "```"]
    analysis = {key: entry for key, entry in summary["analysis"].items() if isinstance(entry, dict)}
    if analysis or summary["targets"]:
        lines += ["", "## Targets", ""]
        lines += [f"- [{'met' if check['met'] else 'MISSED'}] {check['target']}: {check['measured']}"
                  for check in summary["targets"]]
        for key, entry in analysis.items():
            text = (f"- {key}: best {entry['best']} {entry['best_images_per_s']:,.0f} images/s "
                    f"(p50 {entry['best_p50_ms']:.3f} ms)")
            if "speedup_vs_public" in entry:
                text += f", {entry['speedup_vs_public']:.1f}x the public forward pass"
            if entry.get("share_of_matmul_peak") is not None:
                text += (f"; {entry['achieved_tflops']:.2f} TFLOP/s = {entry['share_of_matmul_peak']:.1%} of the "
                         f"same-run matmul peak; copies {entry['share_of_copy_bound']:.1%} of the copy bound")
            lines.append(text)
    return "\n".join(lines) + "\n"


def engines_markdown(part: dict) -> str:
    """The engines table (p50 ms device-resident / numpy, and images/s), the ratios, and the profiler tables."""
    measurements = part.get("measurements", [])
    if not measurements:
        return "\n## Engines\n\nnot measured" + (f": {part.get('failed')}" if part.get("failed") else "") + "\n"
    batches = sorted({row["batch"] for row in measurements})
    resident, numpy = cells(measurements, ON_DEVICE), cells(measurements, NUMPY)
    text = ("\n## Engines, one process, one GPU\n\np50 ms device-resident / numpy in and out (images/s numpy)\n\n"
            f"| engine | {' | '.join(f'batch {b}' for b in batches)} |\n|---|{'---|' * len(batches)}\n")
    for engine in dict.fromkeys(row["engine"] for row in measurements):
        row_cells = []
        for batch in batches:
            on_device, cell = resident.get((engine, batch)), numpy.get((engine, batch))
            row_cells.append("—" if cell is None else
                             f"{'—' if on_device is None else format(on_device['p50_ms'], '.3f')} / "
                             f"{cell['p50_ms']:.3f} ({cell['images_per_s']:,.0f}/s)")
        text += f"| {engine} | {' | '.join(row_cells)} |\n"
    text += "\n" + "\n".join(f"- {spec}: {info['description']}"
                             + (f"; self-check {'passed' if info['self_check']['passed'] else 'FAILED'}"
                                if info.get("self_check") else "")
                             for spec, info in part.get("engines", {}).items()) + "\n"
    for key, entry in ratios(part).items():
        versus = ", ".join(f"{value:.1f}x {name.removeprefix('vs_')}" for name, value in entry.items()
                           if name.startswith("vs_"))
        text += f"- {key.replace('_', ' ')}: {entry['best']} {entry['best_p50_ms']:.3f} ms ({versus})\n"
    for spec, failure in part.get("failed", {}).items():
        text += f"- {spec}: did not run: {failure}\n"
    splits = part.get("device_time_split", {})
    if splits:
        text += ("\n### Device time a call, by what the kernels do (from the profiles)\n\n"
                 "| engine | batch | fused routing kernels | convolutions | copies and fills | other |\n"
                 "|---|---|---|---|---|---|\n")
        for spec, by_batch in splits.items():
            for batch, split in by_batch.items():
                text += (f"| {spec} | {batch} | {split['fused_routing_ms']:.3f} ms | {split['convolutions_ms']:.3f} ms "
                         f"| {split['copies_ms']:.3f} ms | {split['other_ms']:.3f} ms |\n")
    for spec, tables in part.get("profiles", {}).items():
        for batch, table in tables.items():
            text += f"\n### Where {spec}'s time goes at batch {batch}\n\n```\n{table}\n```\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="the check's working folder (parts/ and steps.jsonl)")
    parser.add_argument("--out", required=True, help="the folder the JSON and markdown go to")
    report(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
