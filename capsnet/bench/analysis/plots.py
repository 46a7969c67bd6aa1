"""The PNG plots of a benchmark's README: throughput and latency in process, by engine and batch size, and over gRPC,
by API, batching and concurrency."""

from __future__ import annotations

from pathlib import Path

from capsnet.bench.report_files import ordered_rows

PLOTS = {"inprocess": "inprocess.png", "grpc": "grpc.png"}


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
    """engine -> (batch sizes, values of the figure `key`), in engine order."""
    series: dict[str, tuple[list, list]] = {}
    for row in ordered_rows(rows):
        xs, ys = series.setdefault(row["engine"], ([], []))
        xs.append(row["batch"])
        ys.append(row["figures"][key])
    return series


def _plot_inprocess(plt, results: dict, out_dir: Path) -> Path:
    rows = results["inprocess"]["measurements"]
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
        _log_ticks(axis, sorted({row["batch"] for row in rows}))
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
                    linestyle="--", label=f"in-process {results['grpc']['server']['engine']}, batch = concurrency "
                                          "(mean of the rows' references)")
    throughput.set(xscale="log", ylim=(0, None), xlabel="concurrent requests", ylabel="images/s",
                   title="gRPC throughput")
    latency.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms per request", title="gRPC latency")
    for axis in (throughput, latency):
        _log_ticks(axis, sorted({row["concurrency"] for row in rows}))
        axis.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / PLOTS["grpc"]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
