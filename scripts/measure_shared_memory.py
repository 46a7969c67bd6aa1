"""What Triton's system shared memory buys a client on the server's host: KServe v2 gRPC throughput and latency with
tensors in the request (`none`) and in POSIX shared memory (`system`), beside ONNX Runtime in process, in one run.

The load is perf_analyzer's, closed loop (`--concurrency-range`, `--shared-memory none|system`, every output asked
for, raw tensors). With `--perf-analyzer PATH` perf_analyzer itself drives it. PyPI's perf-analyzer wheels need
glibc 2.38, so where the host has less, the build inside tritonclient 2.41's wheel runs instead, in a venv of its own:

    apt-get install libb64-0d
    python3 -m venv /opt/perf-analyzer
    /opt/perf-analyzer/bin/pip install tritonclient==2.41.0 nvidia-cuda-runtime-cu12  # libcudart, loaded, not used
    .venv/bin/python scripts/measure_shared_memory.py --perf-analyzer /opt/perf-analyzer/bin/perf_analyzer --out OUT

Without it, tritonclient's own gRPC client and shared_memory utilities apply the same load: one thread and one
client per concurrent request, each with its own input and output regions as perf_analyzer registers them.

The model is a preset (default `paper`) with seeded random weights exported in FP32 (CapsNet's cost does not depend on
its weights), served by `capsnet serve --backend onnxruntime --precision fp32` with --max-batch-size at the largest
batch; in process, the server's own ONNX Runtime backend (the same session options and threads, one per core) runs
the same batches back to back, before and after the server's cells (both runs reported, their mean compared).

    .venv/bin/python scripts/measure_shared_memory.py --out docs/benchmarks/shared-memory-cpu

writes OUT.json (every cell) and OUT.md (the command, the machine and its load, the table, the ratios).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from serving_ab import CHECKPOINT, cpu_kind, wait_until_ready  # noqa: E402 (the same checkpoint and machine facts)


def export(preset: str, scratch: Path) -> Path:
    checkpoint, out = scratch / "model.ckpt", scratch / "model"
    for args in (["-c", CHECKPOINT, str(checkpoint), preset],
                 ["-m", "capsnet", "export", str(checkpoint), "--out", str(out), "--data", "embedded"]):
        subprocess.run([sys.executable, *args], check=True, capture_output=True, timeout=1800)
    return out


def engine(gpu: int | None, precision: str) -> list[str]:
    """The backend's flags: ONNX Runtime on the CPU, or the torch backend (CUDA graphs) on a GPU."""
    if gpu is None:
        return ["--backend", "onnxruntime", "--precision", precision]
    return ["--backend", "torch", "--precision", precision, "--gpu", str(gpu)]


class Server:
    def __init__(self, model_dir: Path, max_batch_size: int, flags: list[str]):
        command = [sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), *flags, "--grpc-port", "0",
                   "--http-port", "0", "--metrics-port", "0", "--max-batch-size", str(max_batch_size)]
        self.command = command
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.target, _ = wait_until_ready(self.process, "capsnet serve")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def in_process(model_dir: Path, batch: int, seconds: float, gpu: int | None, precision: str) -> dict:
    """The server's own backend (its settings, one thread per core), called directly: numpy in, numpy out."""
    from capsnet.serving.engine.artifacts import load_artifacts

    artifacts, threads = load_artifacts(model_dir), len(os.sched_getaffinity(0))
    if gpu is None:
        from capsnet.serving.engine.backends.onnxruntime_backend import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(artifacts, precision, threads, batch)
    else:
        from capsnet.serving.engine.backends.torch_backend import TorchBackend

        backend = TorchBackend(artifacts, precision, threads, gpu, max_batch_size=batch)
    images = np.random.default_rng(0).random((batch, 1, 28, 28), dtype=np.float32)
    backend.run(images)
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(times) < 3:
        started = time.perf_counter()
        backend.run(images)
        times.append(time.perf_counter() - started)
    return {"batch": batch, "calls": len(times), "p50_ms": statistics.median(times) * 1e3,
            "images_per_s": batch * len(times) / sum(times)}


class Worker:
    """One concurrent request of the closed loop: its own client, and in `system` mode its own regions."""

    def __init__(self, target: str, mode: str, batch: int, index: int, outputs: dict[str, tuple[int, ...]]):
        import tritonclient.grpc as grpcclient
        import tritonclient.utils.shared_memory as shm

        self.client = grpcclient.InferenceServerClient(target)
        images = np.random.default_rng(index).random((batch, 1, 28, 28), dtype=np.float32)
        self.input = grpcclient.InferInput("images", list(images.shape), "FP32")
        self.outputs = [grpcclient.InferRequestedOutput(name) for name in outputs]
        self.handles: list = []
        self.mode = mode
        if mode == "none":
            self.input.set_data_from_numpy(images)
            return
        if mode == "cuda":
            self._cuda_regions(images, index, outputs)
            return
        key = f"/capsnet-measure-{os.getpid()}-{index}"
        sizes = {name: batch * int(np.prod(shape)) * 4 for name, shape in outputs.items()}
        handle = shm.create_shared_memory_region(f"in{index}", key + "-in", images.nbytes)
        shm.set_shared_memory_region(handle, [images])
        self.client.register_system_shared_memory(f"in{index}", key + "-in", images.nbytes)
        self.input.set_shared_memory(f"in{index}", images.nbytes)
        out = shm.create_shared_memory_region(f"out{index}", key + "-out", sum(sizes.values()))
        self.client.register_system_shared_memory(f"out{index}", key + "-out", sum(sizes.values()))
        offset = 0
        for output, name in zip(self.outputs, outputs):
            output.set_shared_memory(f"out{index}", sizes[name], offset=offset)
            offset += sizes[name]
        self.handles = [handle, out]

    def _cuda_regions(self, images: np.ndarray, index: int, outputs: dict[str, tuple[int, ...]]) -> None:
        """Input and outputs in CUDA regions of device 0, as perf_analyzer's --shared-memory cuda makes them."""
        import tritonclient.utils.cuda_shared_memory as cudashm

        handle = cudashm.create_shared_memory_region(f"in{index}", images.nbytes, 0)
        cudashm.set_shared_memory_region(handle, [images])
        self.client.register_cuda_shared_memory(f"in{index}", cudashm.get_raw_handle(handle), 0, images.nbytes)
        self.input.set_shared_memory(f"in{index}", images.nbytes)
        self.handles.append(handle)
        for output, name in zip(self.outputs, outputs):
            size = len(images) * int(np.prod(outputs[name])) * 4
            region = cudashm.create_shared_memory_region(f"{name}{index}", size, 0)
            self.client.register_cuda_shared_memory(f"{name}{index}", cudashm.get_raw_handle(region), 0, size)
            output.set_shared_memory(f"{name}{index}", size)
            self.handles.append(region)

    def infer(self) -> None:
        self.client.infer("capsnet", [self.input], outputs=self.outputs, client_timeout=120)

    def close(self) -> None:
        if self.mode == "cuda":
            import tritonclient.utils.cuda_shared_memory as regions
        else:
            import tritonclient.utils.shared_memory as regions
        if self.handles:
            self.client.unregister_system_shared_memory()
            self.client.unregister_cuda_shared_memory()
        for handle in self.handles:
            regions.destroy_shared_memory_region(handle)
        self.client.close()


def served(target: str, mode: str, batch: int, concurrency: int, seconds: float,
           outputs: dict[str, tuple[int, ...]]) -> dict:
    workers = [Worker(target, mode, batch, index, outputs) for index in range(concurrency)]
    for worker in workers:
        worker.infer()  # warm: connections, the batch size
    latencies: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop(worker: Worker) -> None:
        done = 0
        while time.monotonic() < end or done < 2:
            started = time.perf_counter()
            worker.infer()
            with lock:
                latencies.append(time.perf_counter() - started)
            done += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(worker,)) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for worker in workers:
        worker.close()
    return {"mode": mode, "batch": batch, "concurrency": concurrency, "requests": len(latencies),
            "p50_ms": statistics.median(latencies) * 1e3, "images_per_s": batch * len(latencies) / wall}


def perf_analyzer_data(scratch: Path) -> Path:
    """perf_analyzer's input data file: one image random in [0, 1] (its own `random` data is not: the server refuses
    NaN and Inf)."""
    data = scratch / "images.json"
    image = np.random.default_rng(0).random((1, 28, 28), dtype=np.float32)
    data.write_text(json.dumps({"data": [{"images": {"content": image.ravel().tolist(), "shape": [1, 28, 28]}}]}))
    return data


def perf_analyzer(binary: Path, data: Path, target: str, mode: str, batch: int, concurrency: int, seconds: float,
                  outputs: dict[str, tuple[int, ...]]) -> dict:
    """One cell measured by perf_analyzer: its CSV's throughput and p50 latency, after its own stabilisation (windows
    of `seconds` until three agree within 20%, at most 10)."""
    csv = data.parent / f"{mode}-{batch}-{concurrency}.csv"
    largest = batch * max(int(np.prod(shape)) for shape in outputs.values()) * 4
    command = [str(binary), "-m", "capsnet", "-u", target, "-i", "grpc", "--shared-memory", mode,
               "--output-shared-memory-size", str(largest), "-b", str(batch), "--concurrency-range", str(concurrency),
               "--measurement-interval", str(int(seconds * 1000)), "--max-trials", "10", "--stability-percentage", "20",
               "--input-data", str(data), "-f", str(csv)]
    site = venv_site_packages(binary)
    runtime = site / "nvidia/cuda_runtime/lib" if site else None
    env = dict(os.environ)
    if runtime is not None and runtime.is_dir():  # its libcudart, which the binary links against even without a GPU
        env["LD_LIBRARY_PATH"] = f"{runtime}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(runtime)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60 + 20 * seconds)
    if result.returncode != 0 or not csv.exists():
        raise SystemExit(f"perf_analyzer failed ({result.returncode}): {(result.stdout + result.stderr)[-2000:]}")
    header, row = csv.read_text().splitlines()[:2]
    values = dict(zip(header.split(","), row.split(",")))
    throughput = float(values["Inferences/Second"])  # images: perf_analyzer counts each of a batch's inferences
    return {"mode": mode, "batch": batch, "concurrency": concurrency, "requests": None, "tool": "perf_analyzer",
            "p50_ms": float(values["p50 latency"]) / 1e3, "images_per_s": throughput}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--seconds", type=float, default=8.0, help="per cell")
    parser.add_argument("--gpu", type=int,
                        help="serve on this CUDA device (torch backend) and add --shared-memory cuda")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--perf-analyzer", type=Path, metavar="PATH",
                        help="perf_analyzer's binary, to apply the load (default: tritonclient's client)")
    parser.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = parser.parse_args(argv)
    batches = [int(size) for size in args.batches.split(",")]
    levels = [int(level) for level in args.concurrency.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = export(args.preset, Path(scratch))
        outputs = {output["name"]: tuple(output["shape"])
                   for output in json.loads((model_dir / "model.json").read_text())["outputs"]}
        modes = ("none", "system") if args.gpu is None else ("none", "system", "cuda")
        local = [in_process(model_dir, batch, args.seconds, args.gpu, args.precision) for batch in batches]
        server = Server(model_dir, max(batches), engine(args.gpu, args.precision))
        try:
            measure = served if args.perf_analyzer is None else functools.partial(
                perf_analyzer, args.perf_analyzer, perf_analyzer_data(Path(scratch)))
            cells = [measure(server.target, mode, batch, level, args.seconds, outputs)
                     for batch in batches for level in levels for mode in modes]
        finally:
            server.stop()
        local_after = [in_process(model_dir, batch, args.seconds, args.gpu, args.precision) for batch in batches]
    report = {"command": shlex.join(["python", "scripts/measure_shared_memory.py", *(argv or sys.argv[1:])]),
              "server": shlex.join(["capsnet", "serve", "--model", "MODEL", *server.command[6:]]),
              "device": gpu_name(args.gpu), "cpu": cpu_kind(), "cores": len(os.sched_getaffinity(0)),
              "load_before": load_before, "load_after": os.getloadavg(), "preset": args.preset,
              "precision": args.precision,
              "load_by": perf_analyzer_version(args.perf_analyzer) if args.perf_analyzer else "tritonclient's client",
              "in_process": [local, local_after], "served": cells}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(markdown(report)) + "\n")
    print("\n".join(markdown(report)))
    return 0


def venv_site_packages(binary: Path) -> Path | None:
    """The site-packages of the venv whose bin/ holds `binary`, if it is in one."""
    return next(binary.resolve().parent.parent.glob("lib/python3*/site-packages"), None)


def perf_analyzer_version(binary: Path) -> str:
    """"perf_analyzer" and the version of the tritonclient or perf-analyzer distribution in its venv."""
    site = venv_site_packages(binary)
    found = sorted(site.glob("*.dist-info")) if site else []
    names = [path.name.removesuffix(".dist-info") for path in found
             if path.name.startswith(("tritonclient-", "perf_analyzer-"))]
    return f"perf_analyzer ({', '.join(names)})" if names else "perf_analyzer"


def gpu_name(gpu: int | None) -> str:
    if gpu is None:
        return ""
    import torch

    return f"{torch.cuda.get_device_name(gpu)} (torch {torch.__version__}) beside "


def markdown(report: dict) -> list[str]:
    before, after = report["in_process"]
    reference = {row["batch"]: (row["images_per_s"] + later["images_per_s"]) / 2 for row, later in zip(before, after)}
    lines = [f"`{report['command']}` on {report['device']}{report['cpu']}, {report['cores']} cores, load average "
             f"{report['load_before'][0]:.2f} before and {report['load_after'][0]:.2f} after; "
             f"the {report['preset']} model in {report['precision']}, served as `{report['server']}`; the load "
             f"applied by {report['load_by']}.", "",
             "| batch | concurrency | tensors | requests | p50 ms | images/s | of in process |",
             "|---|---|---|---|---|---|---|"]
    for cell in report["served"]:
        lines.append(f"| {cell['batch']} | {cell['concurrency']} | {cell['mode']} | {cell['requests'] or '—'} | "
                     f"{cell['p50_ms']:.2f} | {cell['images_per_s']:.1f} | "
                     f"{cell['images_per_s'] / reference[cell['batch']]:.0%} |")
    lines += ["", "In process (the server's backend, called directly), before and after the served cells:", ""]
    for row, later in zip(before, after):
        lines.append(f"- batch {row['batch']}: {row['images_per_s']:.1f} and {later['images_per_s']:.1f} images/s "
                     f"(p50 {row['p50_ms']:.2f} and {later['p50_ms']:.2f} ms)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
