"""The GPUs' metrics: Triton's nv_gpu_* families written from a GPU reader at scrape time, absent (not zero) where no
GPU reports them, the GPUs CUDA sees chosen as CUDA chooses them; and on a real GPU (skipped without one) read from
NVML beside the model's GPU time per batch, timed with CUDA events by the torch runners."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import ServerThread, metric, scrape, server_config, wait_until

from capsnet.client.api import CapsNetClient, image_message
from capsnet.serving.engine.backends import gpu_host
from capsnet.serving.observability.gpu_metrics import FAMILIES, GpuCollector, GpuReading, cuda_visible
from capsnet.v1 import capsnet_pb2 as pb

IMAGES = np.random.default_rng(11).random((3, 1, 28, 28), dtype=np.float32)  # (3, 1, 28, 28)
# Two GPUs as a reader gives them: one reporting every figure, one without power or energy readings (as some boards)
FULL = GpuReading("GPU-5d1c0a4e-8f3b-4c21-9a6e-0b7d2f1e3c4a", utilization=0.37, memory_used_bytes=3 * 2**30,
                  memory_total_bytes=80 * 2**30, power_usage_watts=412.5, power_limit_watts=700.0,
                  energy_joules=1234.5)
PARTIAL = GpuReading("GPU-9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b", utilization=0.0, memory_used_bytes=2**20,
                     memory_total_bytes=16 * 2**30, power_usage_watts=None, power_limit_watts=None, energy_joules=None)


class FixedReader:
    """A GpuReader giving the same readings at every scrape, counting its reads."""

    def __init__(self, readings: list[GpuReading]):
        self.readings = readings
        self.reads = 0

    def read(self) -> list[GpuReading]:
        self.reads += 1
        return self.readings


class LostGpuReader:
    """A GpuReader whose read fails as no NVML failure is expected to (NVML's own are caught per figure)."""

    def read(self) -> list[GpuReading]:
        raise RuntimeError("the GPU has fallen off the bus")


def exposition(*collectors) -> str:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


def test_each_gpu_reading_is_written_under_tritons_families_once_per_scrape():
    reader = FixedReader([FULL, PARTIAL])
    registry = CollectorRegistry()
    registry.register(GpuCollector(reader))
    assert reader.reads == 0  # registering reads no GPU
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert reader.reads == 1  # one read of every GPU per scrape, whatever the number of families
    assert set(families) == {name for name, _, _ in FAMILIES}
    for name, help_text, field in FAMILIES:
        family = families[name]
        assert (family.type, family.documentation) == ("gauge", help_text), name
        assert {sample.name for sample in family.samples} == {name}  # Triton's sample names, no _total
        expected = {r.uuid: getattr(r, field) for r in (FULL, PARTIAL) if getattr(r, field) is not None}
        assert {s.labels["gpu_uuid"]: s.value for s in family.samples} == expected, name
        assert all(set(s.labels) == {"gpu_uuid"} for s in family.samples), name


def test_figures_no_gpu_reports_are_absent_not_zero(caplog):
    without_power = {f.name for f in text_string_to_metric_families(exposition(GpuCollector(FixedReader([PARTIAL]))))}
    assert without_power == {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes"}
    assert exposition(GpuCollector(FixedReader([]))) == ""  # no GPU: not even a HELP line

    # a read that fails leaves the GPU families out of that scrape, and every other metric in it
    requests = Counter("capsnet_requests", "Requests", registry=None)
    requests.inc()
    with caplog.at_level(logging.ERROR, logger="capsnet.serving.observability.gpu_metrics"):
        text = exposition(GpuCollector(LostGpuReader()), requests)
    assert "capsnet_requests_total 1.0" in text and "nv_" not in text
    assert "reading the GPUs for /metrics failed" in caplog.text and "fallen off the bus" in caplog.text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) is not installed")
def test_gpu_families_pass_promtool():
    text = exposition(GpuCollector(FixedReader([FULL, PARTIAL]))).encode()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), (result.stdout + result.stderr).decode()


UUIDS = ["GPU-1111aaaa-0000-0000-0000-000000000000", "GPU-2222bbbb-0000-0000-0000-000000000000",
         "GPU-2233cccc-0000-0000-0000-000000000000"]


@pytest.mark.parametrize(("setting", "visible"), [
    (None, UUIDS),  # unset: every GPU
    ("", []),  # set empty: none, as CUDA has none
    ("1", [UUIDS[1]]),
    ("2,0", [UUIDS[2], UUIDS[0]]),  # CUDA's order is the variable's
    (" 1, 0", [UUIDS[1], UUIDS[0]]),
    ("0,7,1", [UUIDS[0]]),  # CUDA reads up to the first entry that names no GPU
    ("-1", []),
    ("GPU-2222", [UUIDS[1]]),  # a UUID's unique beginning
    ("GPU-22", []),  # a beginning that two UUIDs share names none
    (f"{UUIDS[2]},1", [UUIDS[2], UUIDS[1]]),
    ("1,GPU-2222", [UUIDS[1]]),  # the same GPU twice
    ("MIG-1111aaaa", []),
])
def test_the_gpus_read_are_those_cuda_visible_devices_leaves_to_cuda(setting, visible):
    assert cuda_visible(UUIDS, setting) == visible


def test_a_server_on_the_cpu_exports_no_gpu_family(server, stub):
    if server.server.service.backend.on_gpu:
        pytest.skip("the shared server serves on a GPU on this machine")
    stub.Classify(pb.ClassifyRequest(images=[image_message(i) for i in IMAGES]), timeout=30)
    wait_until(lambda: metric(scrape(server.metrics_url), "capsnet_compute_seconds_count") > 0)
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    # absent, not zero: no sample, and no HELP or TYPE line either
    assert "nv_" not in text and "capsnet_gpu_" not in text
    assert "capsnet_compute_seconds_count" in text


def test_the_gpu_metrics_import_no_torch_and_without_nvml_say_why():
    """What a server does once a version serves on a GPU, in a fresh process: NVML is tried without torch; where
    it cannot start (no driver, or no nvidia-ml-py) the families stay absent and one line says why."""
    script = ("import logging, sys; logging.basicConfig(); from capsnet.serving.observability.metrics import Metrics; "
              "from prometheus_client import generate_latest; metrics = Metrics(8); metrics.watch_gpus(); "
              "text = generate_latest(metrics.registry).decode(); "
              "print('torch' in sys.modules, 'nv_gpu_memory_total_bytes{gpu_uuid=' in text)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    torch_imported, exported = result.stdout.split()
    assert torch_imported == "False"
    if gpu_host() and importlib.util.find_spec("pynvml") is not None:
        assert exported == "True", result.stderr
    else:
        assert exported == "False"
        why = ("NVML does not start: " if importlib.util.find_spec("pynvml") else "nvidia-ml-py is not installed")
        assert f"no GPU metrics (nv_gpu_*) on /metrics: {why}" in result.stderr


# --- on a real GPU ------------------------------------------------------------------------------------------------

needs_nvml = pytest.mark.skipif(importlib.util.find_spec("pynvml") is None,
                                reason="nvidia-ml-py is not installed (pip install 'capsnet-serve[gpu]')")


def cuda_total_with_driver_reserve(index: int) -> int:
    """The memory of CUDA GPU `index` as nvidia-smi and Triton report it: CUDA's total, and what the driver keeps for
    itself, which CUDA does not count (NVML's v2 memory figures give it apart)."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:
        uuid = "GPU-" + str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        reserve = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved
    finally:
        pynvml.nvmlShutdown()
    return torch.cuda.mem_get_info(index)[1] + reserve


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_the_runner_times_each_bucketed_forward_pass_on_the_gpu(graphs):
    import torch

    from capsnet.runtime.torch_runner import Forward, TorchRunner

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 8, 9).cuda().eval()
    runner = TorchRunner(Forward(lambda images: (conv(images),), "the convolution", capturable=True),
                         torch.device("cuda", 0), (1, 28, 28), {"features": (8, 20, 20)}, max_batch=8, graphs=graphs)
    assert runner.gpu_timer is not None
    started = time.perf_counter()
    outputs = runner.run(IMAGES)
    wall = time.perf_counter() - started
    # the events lie inside the run: after it began, and complete once it returned (it synchronised its stream)
    assert 0 < runner.gpu_timer.seconds() <= wall
    with torch.inference_mode():
        expected = conv(torch.from_numpy(IMAGES).cuda()).cpu().numpy()
    np.testing.assert_allclose(outputs["features"], expected, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.slow
def test_the_runner_times_a_packages_work_on_its_stream(tmp_path):
    """A package runs on the current stream, the runner's, so the events around the call hold its work: a model of
    a few hundred microseconds of GPU time tells that apart from timing an empty stream (a few microseconds)."""
    import torch

    from capsnet.runtime.torch_runner import TorchRunner, package_forward

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(28 * 28, 4096)
            self.rest = torch.nn.ModuleList(torch.nn.Linear(4096, 4096) for _ in range(32))

        def forward(self, images):
            hidden = self.first(images.flatten(1))  # (B, 4096)
            for layer in self.rest:
                hidden = torch.tanh(layer(hidden))
            return (hidden,)

    torch.manual_seed(0)
    model = Chain().cuda().eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(model, (torch.zeros(8, 1, 28, 28, device="cuda"),), dynamic_shapes=({0: batch},))
    path = tmp_path / "chain.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    gpu = torch.device("cuda", 0)
    runner = TorchRunner(package_forward(path, gpu), gpu, (1, 28, 28), {"hidden": (4096,)}, max_batch=8)
    images = np.random.default_rng(5).random((8, 1, 28, 28), dtype=np.float32)  # (8, 1, 28, 28)
    runner.run(images)  # the first call loads the kernels
    outputs = runner.run(images)
    assert runner.gpu_timer is not None
    packaged = runner.gpu_timer.seconds()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        on_gpu = torch.from_numpy(images).cuda()
        model(on_gpu)
        torch.cuda.synchronize()
        start.record()
        (expected,) = model(on_gpu)
        end.record()
        end.synchronize()
    eager = start.elapsed_time(end) / 1e3
    # inductor runs the same matrix products (cuBLAS) with the tanh fused: close to eager, never 4x under it
    assert eager / 4 < packaged < 4 * eager, (packaged, eager)
    np.testing.assert_allclose(outputs["hidden"], expected.cpu().numpy(), rtol=0, atol=1e-4)


@pytest.mark.gpu
@needs_nvml
def test_a_server_on_a_gpu_exports_its_gpus_and_the_models_gpu_time(model_dir):
    import torch

    served = ServerThread(server_config(model_dir, backend="torch", precision="fp32", gpu=0, max_batch_size=8))
    try:
        assert served.server.service.backend.on_gpu
        with CapsNetClient(served.target) as client:
            for _ in range(5):
                client.classify(list(IMAGES))
        wait_until(lambda: metric(scrape(served.metrics_url), "capsnet_compute_seconds_count") >= 5)
        samples = scrape(served.metrics_url)
        reserved = torch.cuda.memory_reserved(0)  # what this process holds, the server's backend among it
    finally:
        served.stop()
    gpu = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)  # the GPU served on, as NVML names it
    reported = {dict(labels)["gpu_uuid"]
                for (name, labels), _ in samples.items() if name == "nv_gpu_memory_total_bytes"}
    assert gpu in reported and len(reported) == torch.cuda.device_count()
    total = metric(samples, "nv_gpu_memory_total_bytes", gpu_uuid=gpu)
    assert total == cuda_total_with_driver_reserve(0)
    assert reserved <= metric(samples, "nv_gpu_memory_used_bytes", gpu_uuid=gpu) <= total
    assert 0 <= metric(samples, "nv_gpu_utilization", gpu_uuid=gpu) <= 1
    if ("nv_gpu_power_usage", (("gpu_uuid", gpu),)) in samples:  # boards without power readings leave them out
        assert 0 < metric(samples, "nv_gpu_power_usage", gpu_uuid=gpu)
        assert 0 < metric(samples, "nv_gpu_power_limit", gpu_uuid=gpu)
    if ("nv_energy_consumption", (("gpu_uuid", gpu),)) in samples:
        assert metric(samples, "nv_energy_consumption", gpu_uuid=gpu) >= 0
    # every batch of the batcher timed on the GPU, each inside its run's wall time
    batches = metric(samples, "capsnet_compute_seconds_count")
    assert metric(samples, "capsnet_gpu_compute_seconds_count", model="capsnet", version="1") == batches >= 5
    assert 0 < metric(samples, "capsnet_gpu_compute_seconds_sum") <= metric(samples, "capsnet_compute_seconds_sum")


@pytest.mark.gpu
@needs_nvml
def test_nvml_reads_the_gpus_cuda_sees():
    """The reader the server registers, against torch's view of the same GPUs."""
    import torch

    from capsnet.serving.observability.gpu_metrics import open_nvml

    reader, what = open_nvml(os.environ)
    assert reader is not None, what
    readings = {r.uuid: r for r in reader.read()}
    cuda = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    assert sorted(readings) == sorted(cuda) and what == ", ".join(readings)
    for index, uuid in enumerate(cuda):
        assert readings[uuid].memory_total_bytes == cuda_total_with_driver_reserve(index)
