"""Helpers of the serving tests: an in-process server on a thread, `capsnet serve` as a subprocess,
and reading the Prometheus exposition. (A uniquely named module: every test folder has a conftest.)"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from capsnet.model_description.files import file_sha256
from capsnet.serving.config import ServerConfig
from capsnet.serving.transports.server import CapsNetServer
from capsnet.training.data import load_dataset


def copy_export(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of an export folder that a test may damage."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def rehash(model_dir: Path, name: str) -> None:
    """model.json's SHA-256 of `name` rewritten to match the file, as an exporter bug would leave it."""
    sidecar = json.loads((model_dir / "model.json").read_text())
    sidecar["sha256"][name] = file_sha256(model_dir / name)
    (model_dir / "model.json").write_text(json.dumps(sidecar))


def scale_int8_weights(model_dir: Path, factor: float) -> None:
    """Multiply the dequantisation scales of the INT8 convolution weights, i.e. the weights themselves."""
    path = model_dir / "model.int8.onnx"
    model = onnx.load(str(path))
    scales = {node.input[1] for node in model.graph.node
              if node.op_type == "DequantizeLinear" and node.input[0].endswith("weight_quantized")}
    for index, init in enumerate(model.graph.initializer):
        if init.name in scales:
            scaled = numpy_helper.from_array(numpy_helper.to_array(init) * factor, init.name)
            model.graph.initializer[index].CopyFrom(scaled)
    onnx.save(model, str(path))
    rehash(model_dir, "model.int8.onnx")



READY_LINE = re.compile(r"ready: .* grpcs?://[^:]+:(\d+) metrics http://[^:]+:(\d+)/metrics")


class ServerThread:
    """A CapsNetServer on its own event loop in a background thread, so tests use blocking clients."""

    def __init__(self, config: ServerConfig, tracing=None):
        """`tracing`: a observability.tracing.Tracing the server records its requests' spans with."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-server")
        self.thread.start()
        self.server = CapsNetServer(config, tracing=tracing)
        self.call(self.server.start())
        self.target = f"127.0.0.1:{self.server.grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    def call(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def server_config(model_dir: Path, **overrides) -> ServerConfig:
    values = {"model_dir": model_dir, "grpc_port": 0, "http_port": 0, "metrics_port": 0, "max_batch_size": 8,
              "max_queue_delay_us": 2000, "threads": 1, "drain_window_s": 0.0, "grace_period_s": 5.0}
    return ServerConfig(**{**values, **overrides})


@contextlib.contextmanager
def repository_server(repository: Path, **settings):
    """A ServerThread serving the model repository `repository` (--model-control explicit unless `settings` say
    otherwise), with a tritonclient gRPC client of it as `.triton`."""
    import tritonclient.grpc as grpcclient

    running = ServerThread(server_config(None, **{"model_repository": repository, "model_control": "explicit",
                                                  **settings}))
    running.triton = grpcclient.InferenceServerClient(url=running.target)
    try:
        yield running
    finally:
        running.triton.close()
        running.stop()


def onnxruntime_reference(model_dir: Path, images):
    """What the FP32 ONNX Runtime backend answers for `images` (N, C, H, W): the reference other backends match."""
    from capsnet.serving.engine.artifacts import load_artifacts
    from capsnet.serving.engine.backends import create_backend

    return create_backend("onnxruntime", "fp32", load_artifacts(model_dir), server_config(model_dir)).run(images)


def slow_down(backend, seconds: float) -> None:
    """Every later run of `backend` takes `seconds` more, so requests queue behind a batch or outlive deadlines."""
    run = backend.run

    def slow_run(images):
        time.sleep(seconds)
        return run(images)

    backend.run = slow_run


def assert_served_as_onnxruntime(model_dir: Path, backend: str, precision: str, images, *, described: str,
                                  **settings) -> None:
    """`backend` in `precision` serves `model_dir`: it passes its self-check, its description names `described`,
    and its answers (run directly, and through our API for the first 8 images) match ONNX Runtime's FP32: every
    output within 1e-4 in fp32, the probabilities within the self-check's bound in a reduced precision."""
    from capsnet.client.api import CapsNetClient

    served = ServerThread(server_config(model_dir, backend=backend, precision=precision, **settings))
    try:
        spec = served.server.service.spec
        assert (spec.backend, spec.precision) == (backend, precision) and spec.self_check.passed
        assert described in served.server.service.backend.description
        with CapsNetClient(served.target) as client:
            predictions = client.classify(list(images[:8]), reconstruction=True)
        direct = served.server.service.backend.run(images)
    finally:
        served.stop()
    expected = onnxruntime_reference(model_dir, images)
    bound = 1e-4 if precision == "fp32" else spec.self_check.tolerance
    for name in ("probabilities", "poses", "reconstruction") if precision == "fp32" else ("probabilities",):
        assert np.abs(direct[name] - expected[name]).max() <= bound, name
    served_probabilities = np.stack([p.probabilities for p in predictions])
    assert np.abs(served_probabilities - expected["probabilities"][:8]).max() <= bound


def graph_probabilities(model_dir: Path):
    """The exported FP32 graph run directly in ONNX Runtime, apart from the server's backends:
    (N, C, H, W) float32 -> (N, J) probabilities."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda images: session.run(["probabilities"], {"images": images})[0]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The exposition at `url` as {(sample name, sorted label items): value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    wanted = set(labels.items())
    return sum(value for (sample, items), value in samples.items() if sample == name and wanted <= set(items))


class ServeProcess:
    """`capsnet serve` as a subprocess, on free ports, ready once its ready line is printed."""

    def __init__(self, *args: str, timeout: float = 120, stderr: Path | None = None, env: dict | None = None):
        """`stderr`: a file the server's log goes to (a server that logs every request would fill a pipe no one
        reads); `env`: its environment."""
        command = [sys.executable, "-m", "capsnet", "serve", "--grpc-port", "0", "--http-port", "0", "--metrics-port",
                   "0", *args]
        self._log = None if stderr is None else open(stderr, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log or subprocess.PIPE, text=True,
                                        env=env)
        self.lines: list[str] = []
        reader = threading.Thread(target=self._read_stdout, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            match = next((READY_LINE.search(line) for line in self.lines if READY_LINE.search(line)), None)
            if match:
                self.grpc_port, self.metrics_port = int(match[1]), int(match[2])
                self.target = f"127.0.0.1:{self.grpc_port}"
                return
            time.sleep(0.05)
        self.process.kill()
        _, stderr = self.process.communicate(timeout=10)
        if self._log is not None:
            self._log.close()
            stderr = stderr or Path(self._log.name).read_text()
        raise AssertionError(f"capsnet serve did not become ready (exit {self.process.returncode}):\n{stderr[-3000:]}")

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self._log is not None:
            self._log.close()


def wait_until(condition, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def free_port() -> int:
    """A loopback port nothing listens on (free when asked)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_version(repository: Path, model: str, version: int | str, export: Path) -> Path:
    """REPOSITORY/MODEL/VERSION/ holding `export`'s files as hard links (cheap); the helpers below that damage a
    version replace the link first, so the export stays whole."""
    import os

    target = repository / model / str(version)
    target.mkdir(parents=True)
    for source in export.iterdir():
        os.link(source, target / source.name)
    return target


def corrupt_onnx(version: Path) -> None:
    """One byte of model.onnx changed: its digest no longer matches model.json's."""
    path = version / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))


def fail_self_check(version: Path) -> None:
    """reference.npz's recorded outputs shifted by one class, with model.json's digest updated to match: the files
    are whole, and the model disagrees with its reference (the self-check fails)."""
    import hashlib
    import json

    import numpy as np

    path = version / "reference.npz"
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["probabilities"] = np.roll(arrays["probabilities"], 1, axis=1)
    path.unlink()  # a hard link no more: the export it came from stays whole
    np.savez(path, **arrays)
    sidecar = json.loads((version / "model.json").read_text())
    sidecar["sha256"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (version / "model.json").unlink()
    (version / "model.json").write_text(json.dumps(sidecar))


def rss_bytes() -> int:
    """This process's resident memory once what it freed is given back: after a collection, and after glibc's
    malloc_trim (freed memory stays in malloc's arenas, a per-thread one for each thread that allocated, until
    trimmed: the RSS would follow what earlier tests and the host's load left there, not what is live)."""
    import ctypes
    import gc
    import os

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pairs(count: int, height: int = 28, width: int = 56, seed: int = 0) -> tuple[np.ndarray, list[set[int]]]:
    """`count` images of two test digits of different classes side by side, padded with black to height x width:
    (count, 1, H, W) float32 and each image's two classes."""
    test = load_dataset("embedded").test
    rng = np.random.default_rng(seed)
    images, classes = np.zeros((count, 1, height, width), dtype=np.float32), []
    for image in images:
        first = rng.integers(len(test.labels))
        second = rng.choice(np.flatnonzero(test.labels != test.labels[first]))
        image[0, :28, :56] = np.concatenate([test.images[first][0], test.images[second][0]], axis=1) / 255
        classes.append({int(test.labels[first]), int(test.labels[second])})
    return images, classes


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.round(image[0] * 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def rest(served, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A request to the REST port of `served` (a ServerThread): (HTTP status, JSON answer or {} for none)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{served.server.http_port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read()
            return response.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def rest_infer(server: ServerThread, images: np.ndarray, outputs: list[str] | None = None) -> tuple[int, dict]:
    """KServe v2 REST inference of FP32 `images`, asking for `outputs` by name (None: every output)."""
    body: dict = {"inputs": [{"name": "images", "datatype": "FP32", "shape": list(images.shape),
                              "data": images.ravel().tolist()}]}
    if outputs is not None:
        body["outputs"] = [{"name": name} for name in outputs]
    return rest(server, "POST", "/v2/models/capsnet/infer", body)
