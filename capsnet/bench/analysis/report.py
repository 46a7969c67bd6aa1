"""The analysis' parts of a benchmark's README (the CPU's limit, ONNX Runtime's profile, the public reference, the
targets) and its PNG plots; capsnet.bench.report places them among the measurements' tables."""

from __future__ import annotations

from pathlib import Path

from capsnet.bench.analysis.ortprofile import CONV_OP_TYPES
from capsnet.bench.report import QUICK_VERDICT, ordered_rows, table

PLOTS = {"inprocess": "inprocess.png", "grpc": "grpc.png"}


def sections(results: dict) -> dict[str, list[str]]:
    """Markdown lines by where they go (capsnet.bench.report.SECTIONS)."""
    found = {
        "backends": [
            "",
            "`pytorch-public` is not our model: it is `capsnet/bench/analysis/public_reference.py`, a "
            "re-implementation of how the most-used public PyTorch CapsNet (XifengGuo/CapsNet-Pytorch) computes a "
            "forward pass, run eagerly: PrimaryCaps as one convolution; W as a (J, I, D, P) parameter, (10, 1152, 16, "
            "8) in the paper model; û by a broadcast `torch.matmul` of W with u[:, None, :, :, None]; logits (B, 10, "
            "1152) with a softmax over the classes in every iteration; sums over û as elementwise products then sums; "
            "the masked decoder. It is loaded with our weights (capsules grouped as ours, its one deviation), so it "
            "computes the same outputs.",
        ],
        "limit": _limit_section(results),
        "targets": ["## Targets", "", table(["target", "measured", "met", "short by", "what bounds it"], [
            [t["target"], t["measured"], QUICK_VERDICT, "", ""] if results["quick"] else
            [t["target"], t["measured"], "yes" if t["met"] else "**no**", t.get("short_by", ""), t.get("bound", "")]
            for t in results["targets"]
        ])],
    }
    if results.get("profiles"):
        found["profile"] = _profile_section(results["profiles"], results["ceiling"]["gflops"])
    return found


def _limit_section(results: dict) -> list[str]:
    flops, peak, ceiling = results["flops"], results["peak"], results["ceiling"]
    largest = max(flops["nodes"], key=lambda node: node["flops"])
    conv = peak["conv"]
    return [
        "## The CPU's limit",
        "",
        f"- FLOPs per image, counted from the exported graph (Conv/MatMul/Gemm/Einsum shapes, 2 per multiply-add): "
        f"**{flops['flops_per_image'] / 1e6:.1f} MFLOP**; the largest node, `{largest['name']}` ({largest['op_type']}), "
        f"is {largest['share'] * 100:.1f}% of it.",
        f"- fp32 peak on {peak['threads']} threads (the median of {len(peak.get('runs', [peak]))} measurements, one after "
        f"each interleaved round of the in-process backends, so under the load they ran under; the PrimaryCaps-shaped "
        f"conv ranged {_range(peak, 'gflops')} GFLOP/s over them): {peak['matmul']['gflops']:.0f} GFLOP/s on a "
        f"{'×'.join(map(str, peak['matmul']['shape']))} matmul; {conv['gflops_torch']:.0f} (PyTorch) and "
        f"{conv['gflops_onnxruntime']:.0f} (ONNX Runtime) GFLOP/s on a PrimaryCaps-shaped conv "
        f"({'×'.join(map(str, conv['input_shape']))} input, {'×'.join(map(str, conv['weight_shape']))} weights, "
        f"stride {conv['stride']}).",
        f"- Ceiling: {conv['gflops']:.0f} GFLOP/s ÷ {flops['flops_per_image'] / 1e6:.1f} MFLOP = "
        f"**{ceiling['images_per_s']:.0f} images/s**.",
    ]


def _range(peak: dict, key: str) -> str:
    values = [run["conv"][key] for run in peak.get("runs", [peak])]
    return f"{min(values):.0f}–{max(values):.0f}"


def _profile_section(profiles: dict, peak_gflops: float) -> list[str]:
    lines = ["## Where ONNX Runtime spends its time", "",
             "From ONNX Runtime's profiler (node time by operator type, after graph optimisation), then the "
             "convolutions' speed inside the model: their FLOPs over their share of the measured time per image at "
             "that batch size.", ""]
    for name, profile in profiles.items():
        top = ", ".join(f"{op['op_type']} {op['share'] * 100:.1f}%" for op in profile["op_types"][:6])
        kernels = "; ".join(f"{op['op_type']}: {', '.join(op['kernels'])}" for op in profile["op_types"]
                            if op["op_type"] in CONV_OP_TYPES)
        lines.append(f"- `{name}` at batch {profile['batch_size']} ({profile['runs']} profiled runs): {top}. "
                     f"Convolutions: {profile['conv_share'] * 100:.1f}% of the time, at "
                     f"{profile['conv_gops_in_model']:.0f} GOP/s ({profile['conv_gops_in_model'] / peak_gflops * 100:.0f}% "
                     f"of the fp32 conv peak); kernels {kernels}.")
    return lines


def plots(results: dict, out_dir: Path) -> list[Path]:
    """The in-process and the gRPC plots (PNG), written into `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [_plot_inprocess(plt, results, out_dir)]
    if results.get("grpc"):
        paths.append(_plot_grpc(plt, results, out_dir))
    return paths


def _series(rows: list[dict], key: str) -> dict[str, tuple[list, list]]:
    """backend -> (batch sizes, values of `key`), in backend order."""
    series: dict[str, tuple[list, list]] = {}
    for row in ordered_rows(rows):
        xs, ys = series.setdefault(row["backend"], ([], []))
        xs.append(row["batch_size"])
        ys.append(row[key])
    return series


def _plot_inprocess(plt, results: dict, out_dir: Path) -> Path:
    rows = results["inprocess"]["results"]
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (xs, ys) in _series(rows, "images_per_s").items():
        throughput.plot(xs, ys, marker="o", label=name)
    throughput.axhline(results["ceiling"]["images_per_s"], color="black", linestyle="--", label="fp32 ceiling")
    throughput.set(xscale="log", ylim=(0, None), xlabel="batch size", ylabel="images/s", title="In-process throughput")
    throughput.legend(fontsize=8)
    for (name, (xs, p50)), (_, (_, p99)) in zip(_series(rows, "p50_ms").items(), _series(rows, "p99_ms").items()):
        line, = latency.plot(xs, p50, marker="o", label=f"{name} p50")
        latency.plot(xs, p99, marker="x", linestyle=":", color=line.get_color(), label=f"{name} p99")
    latency.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per call", title="In-process latency")
    latency.legend(fontsize=7, ncol=2)
    for axis in (throughput, latency):
        _log_ticks(axis, sorted({row["batch_size"] for row in rows}))
    fig.tight_layout()
    path = out_dir / PLOTS["inprocess"]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_ticks(axis, values: list[int]) -> None:
    """A log x axis labelled at the measured points only."""
    axis.set_xticks(values, labels=[str(v) for v in values])
    axis.minorticks_off()
    axis.grid(True, alpha=0.3)


def _plot_grpc(plt, results: dict, out_dir: Path) -> Path:
    rows = results["grpc"]["results"]
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines: dict[str, list[dict]] = {}
    for row in rows:
        label = f"{row['api']}, batching {'on' if row['dynamic_batching'] else 'off'}"
        lines.setdefault(label, []).append(row)
    for label, series in lines.items():
        xs = [row["concurrency"] for row in series]
        line, = throughput.plot(xs, [row["images_per_s"] for row in series], marker="o", label=label)
        latency.plot(xs, [row["p50_ms"] for row in series], marker="o", color=line.get_color(), label=f"{label} p50")
        latency.plot(xs, [row["p99_ms"] for row in series], marker="x", linestyle=":", color=line.get_color(),
                     label=f"{label} p99")
    reference: dict[int, list[float]] = {}
    for row in rows:
        reference.setdefault(row["concurrency"], []).append(row["inprocess"]["images_per_s"])
    batch_sizes = sorted(reference)
    throughput.plot(batch_sizes, [sum(reference[b]) / len(reference[b]) for b in batch_sizes], color="black",
                    linestyle="--", label=f"in-process {results['grpc']['server']['backend']}, batch = concurrency "
                                          "(mean of the rows' references)")
    throughput.set(xscale="log", ylim=(0, None), xlabel="concurrent requests", ylabel="images/s", title="gRPC throughput")
    latency.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms per request", title="gRPC latency")
    for axis in (throughput, latency):
        _log_ticks(axis, sorted({row["concurrency"] for row in rows}))
        axis.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / PLOTS["grpc"]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
