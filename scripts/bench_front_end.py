"""One-image KServe gRPC requests against the servers of one ONNX model, in one run: the bare `grpc.aio` floor with
and without the engine, `capsnet serve` with one process and with N front-end processes, Triton through PyTriton and
KServe's Python model server (the reference servers: scripts/front_end_servers.py).

- floor and floor+engine: what Python gRPC itself costs a request, and the least a Python gRPC server that runs the
  model costs, with no checks, batching, statistics or metrics;
- capsnet-1 and capsnet-N: `capsnet serve --workers 1|N` on the ONNX Runtime backend (FP32), N front ends beside one
  engine process (serving/processes/supervisor.py); on a GPU host also N = cores - 2; with --capsnet-threads T also
  capsnet-1-threads-T, one process on T intra-op threads instead of the server's default;
- pytriton (--pytriton-python: a Python with nvidia-pytriton and onnxruntime) and kserve (--kserve-python: a Python
  with kserve 0.21 and onnxruntime); each skipped without its Python.

perf_analyzer drives each at each concurrency (1-image requests, `--input-data zero`), read from its CSV: requests/s,
p50 and p99. The servers are measured in --rounds rounds (default 3), in turn, each started anew and every other round
in the reverse order, and each cell is its median round: these machines' speed drifts by a quarter within minutes, and a
server measured once, after another, would carry the drift as its own. perf_analyzer runs from tritonclient 2.41's wheel
in a venv of its own (docs/benchmarks/README.md); without --perf-analyzer, the project's load generator
(capsnet/bench/loadgen.py, tritonclient's asyncio client in this process) applies the load instead. Around each cell the
server's process tree's CPU time (user + system, every process of it) and its request count (its ModelStatistics, or
what KServe's model wrote) give the server CPU time per request, and its images over its backend runs the mean batch.
Behind N front ends, the engine process's CPU time per request, and 1 ÷ it: the requests/s one engine can take. Then the
first capsnet-N's engine alone: driven by this process over its link as a front end drives it (no gRPC, no request path
on the cores) at each concurrency, its CPU time per request is the engine's own cost at the batches it forms when front
ends do not limit them. The engine's in-process time is its p50 at batch 1, called directly, built and timed by the
project's in-process harness (capsnet/bench/engines.py), which also builds floor+engine's.

    python3 -m venv /opt/perf-analyzer && /opt/perf-analyzer/bin/pip install tritonclient==2.41.0 \\
        nvidia-cuda-runtime-cu12   # and apt-get install libb64-0d
    python3.10 -m venv /opt/pytriton && /opt/pytriton/bin/pip install nvidia-pytriton onnxruntime numpy
    python3 -m venv /opt/kserve && /opt/kserve/bin/pip install kserve==0.21.0 onnxruntime numpy
    .venv/bin/python scripts/bench_front_end.py --perf-analyzer /opt/perf-analyzer/bin/perf_analyzer \\
        --pytriton-python /opt/pytriton/bin/python --kserve-python /opt/kserve/bin/python --out OUT

PyTriton 0.7's Python 3.11 backend stub fails against a Python 3.11.7 standard library (its multiprocessing calls
RLock._recursion_count, which the stub's interpreter lacks), so its venv here is a Python 3.10's.

writes OUT.json and OUT.md. On a GPU host (scripts/gpu_check.sh, its front-end step) add `--gpu 0`: capsnet serves with
the fused engine in fp16 on the device (--engine), and PyTriton and KServe are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # serving_ab: the same checkpoint, ready line and machine facts, imported
# where used, as the floor, PyTriton and KServe run in Pythons without the project's dependencies
from front_end_servers import COUNTS, MODEL, floor, free_port, kserve_server, model_config_response, model_io, pytriton  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BATCH_SIZES = (1, 4, 16, 64)  # the engine's CPU time per image is measured at these
CPU_PARTS = ("total", "main thread", "gRPC threads", "engine process")
THREADS_ROW = "capsnet-1-threads-"  # --capsnet-threads T's rows: one process on T intra-op threads
ENGINE_ARGV = b"capsnet.serving.processes.supervisor\0engine\0"  # in the command line of `--workers N`'s engine process
ENGINE_ALONE = "engine_alone"  # the report's key of the engine process driven without its front ends


# -- the servers -------------------------------------------------------------------------------------------------

def _ticks(stat: Path) -> int:
    """utime + stime of a /proc stat file, in clock ticks."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Served:
    """A server process, ready once it prints `ready` (the floor, PyTriton) or capsnet's ready line."""

    def __init__(self, name: str, command: list[str], port: int | None = None, counts: Path | None = None):
        """`counts`: where a server without statistics (KServe) writes front_end_servers.COUNTS."""
        from serving_ab import wait_until_ready

        self.name, self.command, self.counts_file = name, command, counts
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        start_new_session=True)
        self.target, _ = wait_until_ready(self.process, name, port)

    def cpu_seconds(self) -> dict[str, float]:
        """User + system time of every process of the server's tree (its children: front ends, engine, Triton): in
        all, in the processes' main threads (a Python server's event loop), in gRPC's core threads, and in capsnet's
        engine process behind N front ends (the one process every request crosses)."""
        spent = dict.fromkeys(CPU_PARTS, 0.0)
        for pid, tasks in self.processes():
            try:
                ticks = _ticks(Path(f"/proc/{pid}/stat")) / CLK_TCK  # its threads, ended ones too
                spent["total"] += ticks
                if ENGINE_ARGV in Path(f"/proc/{pid}/cmdline").read_bytes():
                    spent["engine process"] += ticks
            except (FileNotFoundError, ProcessLookupError):
                continue
            for task in tasks:
                try:  # a thread that ends meanwhile is left out here alone (its time stays in its process's)
                    if task.name == str(pid):
                        spent["main thread"] += _ticks(task / "stat") / CLK_TCK
                    elif (task / "comm").read_text().startswith(("event_engine", "grpc")):
                        spent["gRPC threads"] += _ticks(task / "stat") / CLK_TCK
                except (FileNotFoundError, ProcessLookupError):
                    continue
        return spent

    def processes(self) -> Iterator[tuple[int, list[Path]]]:
        """(pid, its threads' /proc folders) of every process of the server's tree, the server's first; one that
        ends meanwhile is left out."""
        pids = [self.process.pid]
        while pids:
            pid = pids.pop()
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except (FileNotFoundError, ProcessLookupError):
                continue
            for task in tasks:
                try:
                    pids.extend(int(child) for child in (task / "children").read_text().split())
                except (FileNotFoundError, ProcessLookupError):
                    continue
            yield pid, tasks

    def counts(self) -> tuple[int, int, int]:
        """Requests answered, images inferred, backend runs (its ModelStatistics, through the project's own KServe
        stubs: a GPU host may have no tritonclient; or what a server without them wrote, one run a request)."""
        if self.counts_file is not None:
            data = self.counts_file.read_bytes() if self.counts_file.exists() else b""
            answered, images = COUNTS.unpack(data) if len(data) == COUNTS.size else (0, 0)
            return answered, images, answered
        import grpc

        from capsnet.kserve import grpc_service_pb2 as pb
        from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.target) as channel:
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name=MODEL), timeout=30).model_stats
        return (sum(model.inference_stats.success.count for model in stats),
                sum(model.inference_count for model in stats), sum(model.execution_count for model in stats))

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


# -- the load ------------------------------------------------------------------------------------------------------

def perf_analyzer(binary: Path, target: str, concurrency: int, seconds: float, scratch: Path) -> dict:
    """One cell: perf_analyzer's CSV (requests/s, p50, p99) over three windows of `seconds`, taken whatever their
    spread (on a shared machine its stability check would reject most cells)."""
    out = scratch / f"pa-{time.monotonic_ns()}.csv"
    command = [str(binary), "-m", MODEL, "-u", target, "-i", "grpc", "-b", "1", "--concurrency-range",
               str(concurrency), "--input-data", "zero", "--measurement-interval", str(int(seconds * 1000)),
               "--max-trials", "3", "--stability-percentage", "1000", "-f", str(out)]
    site = next(binary.resolve().parent.parent.glob("lib/python3*/site-packages"), None)
    env = dict(os.environ)
    if site is not None and (runtime := site / "nvidia/cuda_runtime/lib").is_dir():  # linked, not used, on a CPU
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(runtime), env.get("LD_LIBRARY_PATH")]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120 + 20 * seconds)
    if result.returncode != 0 or not out.exists():
        return {"error": (result.stdout + result.stderr)[-600:]}
    row = next(csv.DictReader(out.read_text().splitlines()))
    return {"requests_per_s": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3}


def loadgen(target: str, concurrency: int, seconds: float, image: list[int]) -> dict:
    from capsnet.bench.loadgen import random_images, run_load

    result = asyncio.run(run_load(target, random_images(64, tuple(image)), concurrency=concurrency,
                                  max_requests=10 ** 7, max_seconds=seconds, warmup_seconds=1.0, api="kserve",
                                  model_name=MODEL, input_name="images")).summary()
    return {key: result[key] for key in ("requests_per_s", "p50_ms", "p99_ms", "errors")}


def engine_in_process(model_dir: Path, seconds: float, engine: str, gpu: int | None) -> dict:
    """The engine called directly (numpy in, numpy out), timed by capsnet.bench.engines: its p50 ms at batch 1, and
    the CPU time it takes per image (this process's, its threads') at the batch sizes a server forms."""
    from capsnet.bench.engines import EngineUnavailable, engine_figures

    try:
        rows = engine_figures(model_dir, engine, BATCH_SIZES, seconds, gpu=gpu)
    except EngineUnavailable as err:  # a precision this host cannot run, an engine not exported: one line
        raise SystemExit(f"bench_front_end.py: --engine {engine}: {err}") from None
    figures = {row["batch"]: row["figures"] for row in rows}
    return {"cpu_ms_per_image": {size: figures[size]["cpu_ms_per_image"] for size in BATCH_SIZES},
            "images_per_s": {size: figures[size]["images_per_s"] for size in BATCH_SIZES},
            "p50_ms": figures[1]["p50_ms"], "threads": figures[1]["threads"]}


def _threads(engine: dict) -> str:
    """", on N intra-op threads (KServe's too)", where the report says (capsnet's default for this model)."""
    count = engine.get("threads")
    if count is None:
        return ""
    return f", on {count} intra-op thread{'s' if count > 1 else ''} (KServe's ONNX Runtime too)"


def nearest_batch(engine: dict, mean_batch: float):
    """The batch size the engine was measured at nearest `mean_batch` (a key of its figures)."""
    return min(engine["cpu_ms_per_image"], key=lambda size: abs(int(size) - mean_batch))


def backend_cpu_ms(engine: dict, mean_batch: float) -> float:
    """The backend's CPU time per image at the measured batch size nearest `mean_batch`."""
    return engine["cpu_ms_per_image"][nearest_batch(engine, mean_batch)]


def engine_socket(served: Served) -> str | None:
    """The Unix socket of the engine process behind a server's front ends (its command line names it), or None."""
    for pid, _ in served.processes():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ENGINE_ARGV in argv:
            words = argv.split(b"\0")  # ... engine INDEX SOCKET SLOTS READY_FD
            return words[words.index(b"engine") + 2].decode()
    return None


async def drive_engine(socket_path: str, model_dir: Path, max_batch_size: int, concurrency: int, seconds: float,
                       image: list[int]) -> tuple[int, float, int]:
    """`concurrency` one-image requests kept in flight straight to an engine process over its link, as a front end
    posts them (serving/processes/front_end.py's EngineLink, without gRPC or the request path): (answered, seconds)
    over a window of `seconds` after one of warm-up, and the requests answered in all."""
    import numpy as np

    from capsnet.serving.config import ServerConfig
    from capsnet.serving.processes.front_end import EngineLink

    link = await EngineLink.connect(socket_path, f"capsnet-bench-{os.getpid()}-{concurrency}",
                                    ServerConfig(model_dir=model_dir, max_batch_size=max_batch_size))
    version = next(index for index, spec in enumerate(link.specs) if spec.name == MODEL)
    images = np.random.default_rng(0).random((1, *image), dtype=np.float32)
    answered, stop = 0, time.monotonic() + 1.0 + seconds

    async def client() -> None:
        nonlocal answered
        while time.monotonic() < stop:
            await link.infer(version, [images], None)
            answered += 1

    clients = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(1.0)
        first, started = answered, time.monotonic()
        await asyncio.gather(*clients)
        return answered - first, time.monotonic() - started, answered
    finally:
        for task in clients:
            task.cancel()
        await link.close()


def engine_alone(served: Served, args, model_dir: Path, image: list[int]) -> dict:
    """One round of the engine process behind `served`'s front ends, driven at each concurrency over its link by this
    process: concurrency -> what engine_alone_cell() reads (answered, seconds, images, runs, CPU seconds), or
    {"error": why}. Without gRPC's and the request path's CPU on the same cores, this is the engine's own ceiling:
    what any number of front ends could reach through it."""
    socket_path = engine_socket(served)
    if socket_path is None:
        return {"error": "no engine process found"}
    samples = {}
    for concurrency in args.concurrency:
        cpu, runs_before = served.cpu_seconds()["engine process"], served.counts()[2]
        answered, elapsed, images = asyncio.run(drive_engine(socket_path, model_dir, args.max_batch_size, concurrency,
                                                             args.seconds, image))
        samples[concurrency] = {"answered": answered, "seconds": elapsed, "images": images,
                                # its batches (the link's requests are not in its statistics)
                                "runs": served.counts()[2] - runs_before,
                                "cpu_s": served.cpu_seconds()["engine process"] - cpu}
        print("engine alone", concurrency, samples[concurrency], flush=True)
    return samples


def median_round(samples: list[dict], rate) -> dict:
    """The round of the median requests/s (`rate(sample)`; of an even count, the slower middle one): whatever slowed
    or sped one round of a server alone (these machines' speed moves within minutes) is left out, and a cell's
    figures stay those of one measurement."""
    return sorted(samples, key=rate)[(len(samples) - 1) // 2]


def engine_alone_cell(samples: list[dict], engine: dict) -> dict:
    """The median round of one concurrency: requests/s, and the engine's CPU time per request (all of it, and less
    the backend's in-process CPU time per image at the measured batch nearest its mean batch) with the requests/s one
    engine takes at that CPU time. One image a request; the CPU time, the images and the runs count the warm-up's."""
    sample = median_round(samples, lambda sample: sample["answered"] / sample["seconds"])
    cell: dict = {"requests_per_s": sample["answered"] / sample["seconds"],
                  "requests_per_s_by_round": [other["answered"] / other["seconds"] for other in samples]}
    images, runs = sample["images"], sample["runs"]
    if images and runs:
        engine_ms = sample["cpu_s"] * 1e3 / images
        cell.update(mean_batch=images / runs, cpu_ms_per_request=engine_ms,
                    less_the_backend_ms=engine_ms - backend_cpu_ms(engine, images / runs),
                    requests_per_s_one_engine_takes=1e3 / engine_ms)
    return cell


def server_sample(served: Served, args, concurrency: int, image: list[int], scratch: Path) -> dict:
    """One cell of one round: the load's figures (or its error), and the server's requests, images, runs and CPU
    seconds over it."""
    cpu, before = served.cpu_seconds(), served.counts()
    if args.perf_analyzer:
        load = perf_analyzer(args.perf_analyzer, served.target, concurrency, args.seconds, scratch)
    else:
        load = loadgen(served.target, concurrency, args.seconds, image)
    spent = {part: value - cpu[part] for part, value in served.cpu_seconds().items()}
    done, images, runs = (after - first for after, first in zip(served.counts(), before))
    print(served.name, concurrency, load, flush=True)
    return {"load": load, "done": done, "images": images, "runs": runs, "cpu_s": spent}


def server_cell(name: str, samples: list[dict], engine: dict) -> dict:
    """The median round of one server at one concurrency (every round's requests/s kept beside it): its load's
    figures, and its CPU time per request and batches; the error of the last round if none ran."""
    ran = [sample for sample in samples if "error" not in sample["load"]]
    if not ran:
        return {"error": samples[-1]["load"]["error"]}
    sample = median_round(ran, lambda sample: sample["load"]["requests_per_s"])
    cell: dict = {**sample["load"], "requests_per_s_by_round": [other["load"]["requests_per_s"] for other in ran]}
    done, images, runs, spent = sample["done"], sample["images"], sample["runs"], sample["cpu_s"]
    cell["server_cpu_ms_per_request"] = spent["total"] * 1e3 / done if done else None
    if done:
        cell["cpu_ms_per_request_by_thread"] = {part: value * 1e3 / done for part, value in spent.items()}
    if runs and done and name != "floor":
        cell["mean_batch"] = images / runs
    if runs and done and name != "floor" and not name.startswith(THREADS_ROW):
        # the rest, once the backend's own CPU time (timed in process on the default threads) is taken away
        backend_ms = backend_cpu_ms(engine, images / runs) * images / done  # per request
        cell["request_path_cpu_ms"] = spent["total"] * 1e3 / done - backend_ms
        if spent["engine process"]:  # every request crosses it: 1 / its CPU per request bounds them
            engine_ms = spent["engine process"] * 1e3 / done
            cell["engine_process"] = {"cpu_ms_per_request": engine_ms, "less_the_backend_ms": engine_ms - backend_ms,
                                      "requests_per_s_one_engine_takes": 1e3 / engine_ms}
    return cell


# -- the run -------------------------------------------------------------------------------------------------------

def servers(args, model_dir: Path, workers: list[int], scratch: Path, threads: int | None) -> list[tuple]:
    """(name, command, plain port or None, counts file or None) of each server to measure; KServe's ONNX Runtime
    on `threads` intra-op threads, capsnet's own choice for this model (None: one)."""
    here = str(Path(__file__).resolve())
    port = free_port()
    name, precision = args.engine.split(":")
    device = [] if args.gpu is None else ["--gpu", str(args.gpu)]
    capsnet = [sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), "--backend", name, "--precision",
               precision, *device,
               "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", "--no-allow-client-shm",
               "--max-batch-size", str(args.max_batch_size)]
    engine_port = free_port()
    chosen = [("floor", [sys.executable, here, "--floor", str(port), "--model-dir", str(model_dir)], port, None),
              ("floor+engine", [sys.executable, here, "--floor", str(engine_port), "--model-dir", str(model_dir),
                                "--floor-engine", args.engine, "--max-batch-size", str(args.max_batch_size), *device],
               engine_port, None),
              ("capsnet-1", [*capsnet, "--workers", "1"], None, None)]
    chosen += [(f"{THREADS_ROW}{count}", [*capsnet, "--workers", "1", "--threads", str(count)], None, None)
               for count in args.capsnet_threads]
    chosen += [(f"capsnet-{count}", [*capsnet, "--workers", str(count)], None, None) for count in workers]
    if args.pytriton_python and args.gpu is None:
        triton_port = free_port()
        chosen.append(("pytriton", [args.pytriton_python, here, "--pytriton", str(triton_port), "--model-dir",
                                    str(model_dir), "--max-batch-size", str(args.max_batch_size)], triton_port, None))
    if args.kserve_python and args.gpu is None:
        kserve_port, counts = free_port(), scratch / "kserve-counts"
        counts.with_suffix(".config").write_bytes(model_config_response(model_dir))
        chosen.append(("kserve", [args.kserve_python, here, "--kserve", str(kserve_port), "--model-dir",
                                  str(model_dir), "--counts", str(counts), "--kserve-threads", str(threads or 1)],
                       kserve_port, counts))
    return [server for server in chosen if not args.servers or server[0] in args.servers]


def behind_front_ends(name: str) -> bool:
    """Whether the server of that row is `capsnet serve --workers N` with N > 1: front ends and an engine process."""
    return re.fullmatch(r"capsnet-\d+", name) is not None and name != "capsnet-1"


def front_end_counts(args) -> list[int]:
    """The `--workers N` rows: --workers, or one front end per 2 cores (at least 2); on a GPU host also cores - 2
    (two cores left for the engine process and the load generator)."""
    cores = len(os.sched_getaffinity(0))
    counts = [args.workers or max(2, cores // 2)]
    if args.gpu is not None and cores - 2 > counts[0]:
        counts.append(cores - 2)
    return counts


def measure(args, model_dir: Path, scratch: Path) -> dict:
    """Every server at every concurrency, in `args.rounds` rounds that take the servers in turn (each started anew,
    every other round in the reverse order), so that a machine whose speed drifts during the run weighs on every
    server alike, with the first capsnet-N's engine alone in each of its rounds; each cell its median round."""
    from capsnet.bench.results import portable_command

    image, _ = model_io(model_dir)
    engine = engine_in_process(model_dir, args.seconds, args.engine, args.gpu)
    report: dict = {"engine_p50_ms": engine["p50_ms"], "engine": engine, "servers": {}, "rounds": args.rounds}
    chosen = servers(args, model_dir, front_end_counts(args), scratch, engine["threads"])
    alone_of = next((name for name, *_ in chosen if behind_front_ends(name)), None)
    samples: dict[str, dict[int, list[dict]]] = {name: {} for name, *_ in chosen}
    alone: dict[int, list[dict]] = {}
    for round_index in range(args.rounds):
        for name, command, port, counts in (chosen if round_index % 2 == 0 else chosen[::-1]):
            if "error" in report["servers"].get(name, {}):
                continue
            try:
                served = Served(name, command, port, counts)
            except SystemExit as err:  # its earlier rounds, if any, still count
                report["servers"].setdefault(name, {"error": str(err)})
                continue
            try:
                for concurrency in args.concurrency:
                    samples[name].setdefault(concurrency, []).append(
                        server_sample(served, args, concurrency, image, scratch))
                if name == alone_of:
                    driven = engine_alone(served, args, model_dir, image)
                    if "error" in driven:
                        report[ENGINE_ALONE] = driven
                    else:
                        for concurrency, sample in driven.items():
                            alone.setdefault(concurrency, []).append(sample)
            finally:
                served.stop()
            report["servers"][name] = {"command": portable_command(command, REPO), "cells": {}}
    for name, levels in samples.items():
        if "cells" in report["servers"].get(name, {}):
            report["servers"][name]["cells"] = {level: server_cell(name, rounds, engine)
                                                for level, rounds in levels.items()}
    if alone and ENGINE_ALONE not in report:
        report[ENGINE_ALONE] = {"front_ends_of": alone_of, "cells": {
            level: engine_alone_cell(rounds, engine) for level, rounds in alone.items()}}
    return report


def markdown(report: dict) -> list[str]:
    engine = report["engine"]
    lines = ["# One-image KServe gRPC requests: the floor, capsnet serve, Triton, KServe", "",
             f"`{report['command']}`", "",
             f"Measured {report['when']} on {report['cpu']} ({report['cores']} cores; load average before "
             f"{', '.join(f'{x:.2f}' for x in report['load_before'])}, after "
             f"{', '.join(f'{x:.2f}' for x in report['load_after'])}). The load generator shares its cores with the "
             "servers, and timings on these machines move by up to a quarter between runs: compare figures within "
             f"this run only. {_rounds(report)}", "",
             f"Load: {report['load_by']}, 1-image requests; model: the `{report['preset']}` preset; capsnet's engine: "
             f"{report['engine_spec']}{report['device']}{_threads(engine)}. The engine in process (called "
             f"directly): p50 **{engine['p50_ms']:.3f} ms** at batch 1; CPU "
             "time per image " + ", ".join(f"{value:.3f} ms at batch {size}"
                                           for size, value in engine["cpu_ms_per_image"].items()) + ".", "",
             "Server CPU: user + system time of the server's whole process tree over the cell, over the requests its "
             "statistics counted; of it, the processes' main threads (a Python server's event loop: its request "
             "path, and capsnet's batches that run on the loop) and gRPC's core threads (the rest: backend threads, "
             "Triton's own); and, behind N front ends, capsnet's engine process, which every request crosses: its "
             "CPU time a request bounds the requests/s that more front ends can reach. Less the backend's: minus "
             "the engine's in-process CPU time per image at the batch size nearest the server's mean batch (the cost "
             "of the request path itself).", "",
             "| server | concurrency | requests/s | p50 ms | p99 ms | server CPU ms/request | of it: main threads / "
             "gRPC's threads / engine process | mean batch | less the backend's CPU ms/request |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, server in report["servers"].items():
        if "error" in server:
            lines.append(f"| {name} | not run: {server['error']} | | | | | | | |")
            continue
        for level, cell in server["cells"].items():
            if "error" in cell:
                error = cell["error"][-120:].replace("|", "/").replace("\n", " ")
                lines.append(f"| {name} | {level} | perf_analyzer failed: {error} | | | | | | |")
                continue
            cpu, path = cell.get("server_cpu_ms_per_request"), cell.get("request_path_cpu_ms")
            row = [name, str(level), _rate(cell), f"{cell['p50_ms']:.3f}", f"{cell['p99_ms']:.3f}",
                   "" if cpu is None else f"{cpu:.3f}", _by_thread(cell.get("cpu_ms_per_request_by_thread")),
                   f"{cell['mean_batch']:.1f}" if "mean_batch" in cell else "",
                   "" if path is None else f"{path:.3f}"]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", *ratios(report), "", *engine_process(report), "", *targets(report)]
    return lines


def _rounds(report: dict) -> str:
    rounds = report.get("rounds", 1)
    if rounds == 1:
        return "Each server was measured once."
    return (f"Each server was measured in {rounds} rounds that took the servers in turn, each started anew and every "
            "other round in the reverse order, so that the machine's drift weighs on all alike; a cell gives the "
            "round of the median requests/s (each round's in brackets), its CPU time and batches too.")


def _rate(cell: dict) -> str:
    rounds = cell.get("requests_per_s_by_round", [])
    spread = f" ({' / '.join(f'{rate:,.0f}' for rate in rounds)})" if len(rounds) > 1 else ""
    return f"{cell['requests_per_s']:,.0f}{spread}"


def _cell(server: dict, level) -> dict:
    """A server's cell at `level`, keyed by int in a run and by str once read back from its JSON."""
    cells = server.get("cells", {})
    return cells.get(str(level)) or cells.get(int(level)) or {}


def engine_process(report: dict) -> list[str]:
    """Behind N front ends: the engine process's CPU per request, of it what is not the backend's own run (its
    bookkeeping: messages, slots, the batcher), and the requests/s one engine takes at that cost."""
    rows = [(name, level, cell["engine_process"]) for name, server in report["servers"].items()
            for level in report["concurrency"] if "engine_process" in (cell := _cell(server, level))]
    if not rows:
        return []
    lines = ["The engine process behind N front ends (its CPU time over the requests counted): every request "
             "crosses it, so one engine takes at most 1 ÷ its CPU per request.", "",
             "| server | concurrency | engine CPU ms/request | of it not the backend's run | "
             "requests/s one engine takes |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {level} | {part['cpu_ms_per_request']:.3f} | {part['less_the_backend_ms']:.3f} | "
              f"{part['requests_per_s_one_engine_takes']:,.0f} |" for name, level, part in rows]
    return lines + engine_alone_rows(report)


def engine_alone_rows(report: dict) -> list[str]:
    """The engine process driven straight over its link: its own ceiling, with no front end on its cores."""
    alone = report.get(ENGINE_ALONE)
    if not alone:
        return []
    if "error" in alone:
        return ["", f"The engine process alone: not measured ({alone['error']})."]
    lines = ["", f"The engine process alone: {alone['front_ends_of']}'s engine, driven by the benchmark's own process "
             "over the engine's link (one-image requests posted as a front end posts them, kept in flight at each "
             "concurrency; no gRPC and no request path on the cores), so that its CPU time per request is the "
             "engine's own, at the batches it forms when nothing else limits them.", "",
             "| concurrency | requests/s | mean batch | engine CPU ms/request | of it not the backend's run | "
             "requests/s one engine takes |", "|---|---|---|---|---|---|"]
    for level in report["concurrency"]:
        cell = _cell(alone, level)
        if "cpu_ms_per_request" in cell:
            lines.append(f"| {level} | {cell['requests_per_s']:,.0f} | {cell['mean_batch']:.1f} | "
                         f"{cell['cpu_ms_per_request']:.3f} | {cell['less_the_backend_ms']:.3f} | "
                         f"{cell['requests_per_s_one_engine_takes']:,.0f} |")
    return lines


def ratios(report: dict) -> list[str]:
    """Each server's CPU per request as a multiple of the floor's and of floor+engine's, level by level: the floor
    is what gRPC costs, floor+engine what gRPC and the model cost together, the least a Python server pays."""
    servers = report["servers"]
    bases = [servers.get(name, {}).get("cells", {}) for name in ("floor", "floor+engine")]
    levels = list(report["concurrency"])
    lines = ["Server CPU per request as a multiple of the floor's / of floor+engine's:", "",
             "| server | " + " | ".join(f"c{level}" for level in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, server in servers.items():
        if name == "floor" or "cells" not in server:
            continue
        row = [name]
        for level in levels:
            mine = server["cells"].get(str(level), server["cells"].get(level, {})).get("server_cpu_ms_per_request")
            parts = []
            for base in bases:
                theirs = base.get(str(level), base.get(level, {})).get("server_cpu_ms_per_request")
                parts.append(f"{mine / theirs:.2f}×" if mine and theirs else "–")
            row.append(" / ".join(parts))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _by_thread(parts: dict | None) -> str:
    if parts is None:
        return ""
    engine = parts.get("engine process")
    return (f"{parts['main thread']:.3f} / {parts['gRPC threads']:.3f} / "
            + (f"{engine:.3f}" if engine else "–"))


def _met(line: str, ok: bool) -> str:
    return f"{line} | {'yes' if ok else '**no**'} |"


def targets(report: dict) -> list[str]:
    """The targets: one process's batches, requests/s and c1 CPU against floor+engine's; the engine process's CPU
    per request; one process against KServe's Python server; on a GPU host, the requests/s of N front ends."""
    servers, levels = report["servers"], [str(level) for level in report["concurrency"]]
    mine, base, kserve = (servers.get(name, {}) for name in ("capsnet-1", "floor+engine", "kserve"))
    lines = ["| target | server | measured | met |", "|---|---|---|---|"]
    for level, least in (("16", 3), ("64", 6)):
        if level in levels and "mean_batch" in _cell(mine, level):
            batch = _cell(mine, level)["mean_batch"]
            lines.append(_met(f"| mean batch ≥ {least} at c{level} | capsnet-1 | {batch:.1f}", batch >= least))
    ours, theirs = (_cell(mine, "64").get("requests_per_s"), _cell(base, "64").get("requests_per_s"))
    if ours and theirs:
        lines.append(_met(f"| requests/s at c64 ≥ floor+engine's | capsnet-1 | {ours:,.0f} against {theirs:,.0f} "
                          f"({ours / theirs:.2f}×)", ours >= theirs))
    ours, theirs = (_cell(server, "1").get("server_cpu_ms_per_request") for server in (mine, base))
    if ours and theirs:
        lines.append(_met(f"| CPU per request at c1 ≤ 1.3× floor+engine's | capsnet-1 | {ours:.3f} against "
                          f"{theirs:.3f} ms ({ours / theirs:.2f}×)", ours <= 1.3 * theirs))
    for level, least in (("1", 1.0), ("16", 1.3), ("64", 1.3)):
        ours, theirs = _cell(mine, level).get("requests_per_s"), _cell(kserve, level).get("requests_per_s")
        if ours and theirs:
            lines.append(_met(f"| requests/s at c{level} ≥ {least:g}× KServe's | capsnet-1 | {ours:,.0f} against "
                              f"{theirs:,.0f} ({ours / theirs:.2f}×)", ours >= least * theirs))
    cell = _cell(mine, "64")
    if report.get("preset") == "paper" and cell.get("mean_batch") and "images_per_s" in report["engine"]:
        # a model whose compute dominates: served one-image requests against the engine's own images/s at the batch
        # the server formed, where the request path should cost next to nothing
        batch = nearest_batch(report["engine"], cell["mean_batch"])
        alone = report["engine"]["images_per_s"][batch]
        served = cell["requests_per_s"]
        lines.append(_met(f"| requests/s at c64 ≥ 0.95× the engine in process at the mean batch "
                          f"({cell['mean_batch']:.1f}; measured at {batch}) | capsnet-1 | {served:,.0f} against "
                          f"{alone:,.0f} ({served / alone:.2f}×)", served >= 0.95 * alone))
    engines = [(name, _cell(server, "64").get("engine_process")) for name, server in servers.items()]
    engines.append(("the engine alone", _cell(report.get(ENGINE_ALONE) or {}, "64")))
    for name, part in engines:
        if part and "cpu_ms_per_request" in part:
            lines.append(_met(f"| engine process CPU per request at c64 ≤ 0.05 ms | {name} | "
                              f"{part['cpu_ms_per_request']:.3f} ms ({part['less_the_backend_ms']:.3f} not the "
                              "backend's run)", part["cpu_ms_per_request"] <= 0.05))
    for name, server in servers.items():
        rate = _cell(server, "64").get("requests_per_s")
        if report["device"] and behind_front_ends(name) and rate:  # a GPU host
            lines.append(_met(f"| ≥ 20,000 requests/s at c64 ({report['cores']} cores) | {name} | {rate:,.0f}",
                              rate >= 20000))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement window")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each server is measured, the servers in turn; each cell is its median round")
    parser.add_argument("--workers", type=int, help="front ends of capsnet-N (default: one per 2 cores, at least 2)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--gpu", type=int, help="serve capsnet on this CUDA device")
    parser.add_argument("--engine", metavar="BACKEND:PRECISION",
                        help="capsnet's backend (default onnxruntime:fp32; with --gpu fused:fp16)")
    parser.add_argument("--perf-analyzer", type=Path, metavar="PATH", help="perf_analyzer's binary")
    parser.add_argument("--pytriton-python", metavar="PATH", help="a Python with nvidia-pytriton and onnxruntime")
    parser.add_argument("--kserve-python", metavar="PATH", help="a Python with kserve 0.21 and onnxruntime")
    parser.add_argument("--model-dir", type=Path, help="an export folder (default: the preset, exported now)")
    parser.add_argument("--servers", nargs="+", metavar="NAME", help="only these servers (default: every one)")
    parser.add_argument("--capsnet-threads", type=int, nargs="+", default=[], metavar="T",
                        help="also capsnet-1-threads-T: one process with --threads T")
    parser.add_argument("--floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--floor-engine", metavar="BACKEND:PRECISION", help=argparse.SUPPRESS)
    parser.add_argument("--pytriton", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--kserve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--kserve-threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--counts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.floor is not None:
        floor(args.model_dir, args.floor, args.floor_engine, args.gpu, args.max_batch_size)
        return 0
    if args.pytriton is not None:
        pytriton(args.model_dir, args.pytriton, args.max_batch_size)
        return 0
    if args.kserve is not None:
        kserve_server(args.model_dir, args.kserve, args.counts, args.kserve_threads)
        return 0
    if not args.out:
        parser.error("--out is required")
    args.engine = args.engine or ("onnxruntime:fp32" if args.gpu is None else "fused:fp16")
    from measure_shared_memory import export  # the preset's seeded checkpoint, exported
    from serving_ab import cpu_kind

    from capsnet.bench.results import portable_command  # here: the reference servers run without the project

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or export(args.preset, Path(scratch))
        report = measure(args, model_dir, Path(scratch))
    report.update({
        "command": portable_command(["python", "scripts/bench_front_end.py", *(argv or sys.argv[1:])], REPO),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_kind(),
        "cores": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg(),
        "preset": args.preset, "concurrency": args.concurrency, "engine_spec": args.engine,
        "device": "" if args.gpu is None else f" on CUDA device {args.gpu}",
        "load_by": "perf_analyzer (tritonclient 2.41.0's build)" if args.perf_analyzer
        else "capsnet/bench/loadgen.py (tritonclient's asyncio client, in the benchmark's process)"})
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(markdown(report)) + "\n")
    print("\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
