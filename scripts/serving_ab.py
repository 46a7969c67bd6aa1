"""Same-run A/B of two capsnet-serve source trees: KServe v2 gRPC latency and throughput of the paper model.

Each tree serves the `paper` preset (or --preset's; random weights seeded with 0: CapsNet's cost does not depend on
them) exported in FP32 by its own exporter, from its own Python environment, on the onnxruntime backend with the
server's defaults.
Both servers run side by side and take turns under the same closed-loop load from tritonclient's asyncio gRPC client
(1 image per request): round after round, the order alternating, so that other work on the machine slows both alike.
Around each run the server's own histograms are read, which splits a request's latency into the backend's compute,
the batch queue, and the rest: the request path (gRPC, decoding, checks, batcher hand-off, encoding) and the client.

    git worktree add "$TMPDIR/base" d907b92 && (cd "$TMPDIR/base" && bash scripts/setup-env.sh)
    .venv/bin/python scripts/serving_ab.py --baseline "$TMPDIR/base" --out docs/benchmarks/serving-ab

writes OUT.json (every run) and OUT.md (the command, the machine, the table), their paths relative to the repository
root, the temporary folder written $TMPDIR (capsnet.bench.results.portable). Needs the dev extra (tritonclient).
`--candidate-env NAME=VALUE` sets a variable for the candidate's server only: with the same tree as baseline, an
A/B of a setting (OTEL_EXPORTER_OTLP_ENDPOINT: the cost of tracing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from capsnet.bench.loadgen import random_images, run_load
from capsnet.bench.results import portable, portable_command
from capsnet.bench.server_process import scrape

REPO = Path(__file__).resolve().parents[1]
READY_LINE = re.compile(r"ready: .* grpcs?://[^:]+:(\d+) metrics http://[^:]+:(\d+)/metrics")
# Run in each tree's own environment: a seeded, untrained checkpoint of a preset (the API both trees share).
CHECKPOINT = """
import sys, torch
from capsnet.models.checkpoint import Checkpoint, create_model
from capsnet.training.checkpoint import save_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import DIGIT_NAMES
torch.manual_seed(0)
config = preset(sys.argv[2])
save_checkpoint(Checkpoint(config=config, state_dict=create_model(config).state_dict(),
                           class_names=list(DIGIT_NAMES)), sys.argv[1])
"""
# The server's histograms that split a request's latency: (sum, count) of each.
HISTOGRAMS = ("capsnet_compute_seconds", "capsnet_queue_wait_seconds")
STARTUP_TIMEOUT_S = 600.0


def wait_until_ready(process: subprocess.Popen, name: str, plain_port: int | None = None) -> tuple[str, str | None]:
    """Read `process`'s stdout until capsnet's ready line: its gRPC target and metrics URL. A server given
    `plain_port` (the bare floor, PyTriton) may print a line starting "ready" instead: that port, no metrics URL.
    SystemExit naming `name` if the process exits or STARTUP_TIMEOUT_S passes first."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if match := next(filter(None, map(READY_LINE.search, lines)), None):
            return f"127.0.0.1:{match[1]}", f"http://127.0.0.1:{match[2]}/metrics"
        if plain_port is not None and any(line.startswith("ready") for line in lines):
            return f"127.0.0.1:{plain_port}", None
        time.sleep(0.1)
    raise SystemExit(f"{name} did not become ready (exit {process.poll()})")


@dataclass
class Server:
    label: str
    tree: Path
    python: Path
    process: subprocess.Popen | None = None
    target: str = ""
    metrics_url: str = ""
    model: dict = field(default_factory=dict)  # model.json of its export
    commit: str = ""
    env: dict[str, str] = field(default_factory=dict)  # set for its server only

    def run(self, *args: str, timeout: float = 900) -> None:
        result = subprocess.run([str(self.python), *args], cwd=self.tree, capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise SystemExit(f"{self.label}: {' '.join(args[:3])} failed:\n{result.stderr[-3000:]}")

    def export(self, directory: Path, preset: str) -> Path:
        """The preset's model exported in FP32 by this tree, from its own checkpoint format."""
        checkpoint, out = directory / f"{self.label}.ckpt", directory / self.label
        self.run("-c", CHECKPOINT, str(checkpoint), preset)
        self.run("-m", "capsnet", "export", str(checkpoint), "--out", str(out), "--data", "embedded")
        self.model = json.loads((out / "model.json").read_text())
        return out

    def start(self, model_dir: Path) -> None:
        serve = [str(self.python), "-m", "capsnet", "serve", "--model", str(model_dir), "--backend", "onnxruntime",
                 "--precision", "fp32", "--grpc-port", "0", "--metrics-port", "0"]
        help_text = subprocess.run([*serve[:4], "--help"], cwd=self.tree, capture_output=True, text=True).stdout
        if "--http-port" in help_text:  # a tree that serves REST: any free port, not 8000
            serve += ["--http-port", "0"]
        self.process = subprocess.Popen(serve, cwd=self.tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env={**os.environ, **self.env})
        self.target, self.metrics_url = wait_until_ready(self.process, f"{self.label}: capsnet serve")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def histograms(self) -> dict[str, tuple[float, float]]:
        """(_sum, _count) of each of HISTOGRAMS, over the model versions."""
        samples = scrape(self.metrics_url)
        return {name: (samples.get(f"{name}_sum", 0.0), samples.get(f"{name}_count", 0.0)) for name in HISTOGRAMS}


def git_commit(tree: Path) -> str:
    result = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def cpu_kind() -> str:
    """The CPU's model name and the vector extensions its kernels choose by (capsnet.runtime.cpu.CpuKind)."""
    from capsnet.runtime.cpu import CpuKind

    return CpuKind.this_host().describe()


def mean_ms(before: dict, after: dict, name: str) -> float:
    (sum_before, count_before), (sum_after, count_after) = before[name], after[name]
    count = count_after - count_before
    return (sum_after - sum_before) / count * 1e3 if count else float("nan")


def measure(servers: list[Server], args) -> list[dict]:
    images = random_images(256, tuple(servers[0].model["input"]["shape"]))
    runs = []
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for server in order:
            for concurrency in args.concurrency:
                before, load = server.histograms(), os.getloadavg()[0]
                result = asyncio.run(run_load(
                    server.target, images, concurrency=concurrency, max_requests=args.requests,
                    max_seconds=args.seconds, warmup_requests=50, api="tritonclient",
                    model_name=server.model["name"], input_name=server.model["input"]["name"]))
                after = server.histograms()
                row = {"round": round_index, "server": server.label, **result.summary(),
                       "mean_ms": statistics.fmean(result.latencies_s) * 1e3 if result.latencies_s else float("nan"),
                       "compute_ms": mean_ms(before, after, "capsnet_compute_seconds"),
                       "queue_wait_ms": mean_ms(before, after, "capsnet_queue_wait_seconds"),
                       "load_average_1min": load}
                runs.append(row)
                print(f"round {round_index} {server.label:>9} c={concurrency:<3} p50 {row['p50_ms']:6.2f} ms "
                      f"p99 {row['p99_ms']:6.2f} ms {row['images_per_s']:7.1f} images/s  compute "
                      f"{row['compute_ms']:6.2f} ms  queue {row['queue_wait_ms']:5.2f} ms  load {load:.1f}  "
                      f"errors {row['errors'] or 0}", flush=True)
    return runs


def summary_table(servers: list[Server], runs: list[dict], concurrency: list[int]) -> list[str]:
    """Per server and concurrency, medians over the rounds: the p50 (and its range), p99, images/s (and range), and
    the mean latency split into the backend's compute, the queue wait and the rest (request path and client)."""
    lines = ["| server | concurrency | p50 ms: median (range) | p99 ms | images/s: median (range) | mean ms | "
             "backend compute ms | queue wait ms | mean − compute − queue ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for server in servers:
        for c in concurrency:
            rows = [row for row in runs if row["server"] == server.label and row["concurrency"] == c]
            p50 = [row["p50_ms"] for row in rows]
            ips = [row["images_per_s"] for row in rows]
            median = {key: statistics.median(row[key] for row in rows)
                      for key in ("p99_ms", "mean_ms", "compute_ms", "queue_wait_ms")}
            lines.append(f"| {server.label} ({server.commit}) | {c} | {statistics.median(p50):.2f} "
                         f"({min(p50):.2f}–{max(p50):.2f}) | {median['p99_ms']:.2f} | {statistics.median(ips):.1f} "
                         f"({min(ips):.1f}–{max(ips):.1f}) | {median['mean_ms']:.2f} | {median['compute_ms']:.2f} | "
                         f"{median['queue_wait_ms']:.2f} | "
                         f"{statistics.median(rest(row) for row in rows):.2f} |")
    return lines


def rest(row: dict) -> float:
    """A run's mean latency less the backend's compute and the queue wait: the request path and the client."""
    return row["mean_ms"] - row["compute_ms"] - row["queue_wait_ms"]


def paired_lines(servers: list[Server], runs: list[dict], concurrency: list[int]) -> list[str]:
    """Candidate minus baseline within each round (the two ran minutes apart at most)."""
    base, cand = servers[0].label, servers[1].label
    lines = []
    for c in concurrency:
        pairs = {}
        for row in runs:
            if row["concurrency"] == c:
                pairs.setdefault(row["round"], {})[row["server"]] = row
        p50 = [pair[cand]["p50_ms"] - pair[base]["p50_ms"] for pair in pairs.values()]
        path = [rest(pair[cand]) - rest(pair[base]) for pair in pairs.values()]
        lines.append(f"- concurrency {c}: {cand} − {base} p50 per round: "
                     f"{', '.join(f'{d:+.2f}' for d in p50)} ms (median {statistics.median(p50):+.2f}); "
                     f"mean less compute and queue: {', '.join(f'{d:+.2f}' for d in path)} ms "
                     f"(median {statistics.median(path):+.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, metavar="TREE", help="source tree of the baseline")
    parser.add_argument("--baseline-python", type=Path, metavar="PYTHON",
                        help="its environment's python (default TREE/.venv/bin/python)")
    parser.add_argument("--candidate", type=Path, default=REPO, metavar="TREE", help="default: this repository")
    parser.add_argument("--candidate-python", type=Path, metavar="PYTHON",
                        help="default TREE/.venv/bin/python")
    parser.add_argument("--preset", default="paper",
                        help="the model (default paper; tiny: the request path dominates, not the compute)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both servers, in alternating order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=1000, help="most requests per run")
    parser.add_argument("--seconds", type=float, default=20.0, help="longest run")
    parser.add_argument("--candidate-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable for the candidate's server only (repeatable)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if bad := [item for item in args.candidate_env if "=" not in item]:
        parser.error(f"--candidate-env takes NAME=VALUE, got {bad[0]!r}")
    trees = [("baseline", args.baseline, args.baseline_python), ("candidate", args.candidate, args.candidate_python)]
    servers = [Server(label, tree.resolve(), python or tree / ".venv/bin/python") for label, tree, python in trees]
    servers[1].env = dict(item.split("=", 1) for item in args.candidate_env)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="capsnet-ab-") as scratch:
        try:
            for server in servers:
                server.commit = git_commit(server.tree)
                print(f"{server.label}: {server.tree} at {server.commit}: exporting and starting", flush=True)
                server.start(server.export(Path(scratch), args.preset))
            runs = measure(servers, args)
        finally:
            for server in servers:
                server.stop()
    load_after = os.getloadavg()
    command = portable_command([sys.executable, *sys.argv], REPO)
    report = [
        f"# KServe gRPC A/B: {servers[0].commit} vs {servers[1].commit}", "",
        f"Measured {started} by:", "", "```", command, "```", "",
        f"CPU: {cpu_kind()}, {os.cpu_count()} cores. Load average (1, 5, 15 min) before → after: "
        f"{', '.join(f'{x:.2f}' for x in load_before)} → {', '.join(f'{x:.2f}' for x in load_after)}; "
        "each run's own is in the JSON.", "",
        f"The {args.preset} model in FP32 (each tree's own export of the same seeded weights), onnxruntime backend, "
        f"server defaults; tritonclient.grpc.aio, 1 image per request; {args.rounds} rounds, each running both "
        f"servers in turn (order alternating), each run at most {args.requests} requests or {args.seconds:g} s after "
        "50 warm-up requests. Compute and queue wait are the means of the server's own histograms over the run; "
        "what remains of the mean latency is the request path (gRPC, decoding, checks, batcher hand-off, encoding) "
        "and the client."
        + (f" The candidate's server ran with {', '.join(args.candidate_env)}." if args.candidate_env else ""), "",
        *summary_table(servers, runs, args.concurrency), "",
        "Paired within each round:", "",
        *paired_lines(servers, runs, args.concurrency), "",
    ]
    print("\n".join(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text("\n".join(report))
        args.out.with_suffix(".json").write_text(json.dumps({
            "command": command, "started": started, "cpu": cpu_kind(), "cores": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after,
            "servers": {server.label: {"tree": portable(str(server.tree), REPO), "commit": server.commit,
                                       "env": server.env}
                        for server in servers},
            "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
