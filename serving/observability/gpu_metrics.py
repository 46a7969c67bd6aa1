"""The GPUs' own metrics under Triton's names (nv_gpu_utilization, nv_gpu_memory_*_bytes, nv_gpu_power_*,
nv_energy_consumption, labelled `gpu_uuid`), so dashboards made for Triton read them from this server too.

They are read from NVML (nvidia-ml-py, the `gpu` extra: a ctypes binding to the driver's libnvidia-ml.so) when
Prometheus scrapes, once per GPU per scrape, by a collector: nothing runs between scrapes. The GPUs are those CUDA
sees, as Triton's are: every GPU NVML knows, less those CUDA_VISIBLE_DEVICES hides. The server registers the
collector when its first model version serves on a GPU (serving/observability/metrics.py); on a host without a GPU
engine, the NVIDIA driver or nvidia-ml-py the families are absent, never zero, and nothing of NVML is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LABEL = "gpu_uuid"


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one scrape, in the families' units; None for what this GPU does not report (power on some boards,
    utilisation of a MIG instance), whose sample is then left out."""

    uuid: str  # NVML's, "GPU-..."
    utilization: float | None  # 0.0 to 1.0: the share of the driver's last sample period a kernel ran
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_usage_watts: float | None
    power_limit_watts: float | None
    energy_joules: float | None  # since the reader opened the GPU


# (family, help, GpuReading field). nv_energy_consumption is Triton's counter, exported as a gauge: prometheus-client
# writes a counter's samples as NAME_total, which is not Triton's name; its value only grows all the same, so rate()
# and increase() read it as they read Triton's.
FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate (0.0 - 1.0)", "utilization"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "memory_total_bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "memory_used_bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "power_usage_watts"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "power_limit_watts"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the server started reading the GPU",
     "energy_joules"),
)


class GpuReader(Protocol):
    def read(self) -> list[GpuReading]:
        """Every GPU's reading now."""
        ...


class GpuCollector(Collector):
    """The families of FAMILIES from one read of `reader` per scrape; a family no GPU reports is left out."""

    def __init__(self, reader: GpuReader):
        self.reader = reader

    def describe(self) -> list[GaugeMetricFamily]:
        """The families' names, so registering the collector reads no GPU."""
        return [GaugeMetricFamily(name, text, labels=[LABEL]) for name, text, _ in FAMILIES]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        readings = self._read()
        for name, text, field in FAMILIES:
            family = GaugeMetricFamily(name, text, labels=[LABEL])
            for reading in readings:
                value = getattr(reading, field)
                if value is not None:
                    family.add_metric([reading.uuid], value)
            if family.samples:
                yield family

    def _read(self) -> list[GpuReading]:
        try:
            return self.reader.read()
        except Exception:  # a failing GPU read must not fail the scrape of every other metric
            log.exception("reading the GPUs for /metrics failed")
            return []


def cuda_visible(uuids: list[str], setting: str | None) -> list[str]:
    """The UUIDs, of `uuids` (NVML's GPUs in its index order), that CUDA_VISIBLE_DEVICES=`setting` leaves visible: all
    when it is unset; else its entries as CUDA reads them, up to the first that names no GPU: an index (as NVML
    numbers GPUs, in PCI bus order; CUDA numbers them so with CUDA_DEVICE_ORDER=PCI_BUS_ID), or a GPU's UUID or its
    unique beginning ("GPU-8f3c"). MIG instances are not read."""
    if setting is None:
        return list(uuids)
    chosen: list[str] = []
    for entry in (entry.strip() for entry in setting.split(",")):
        if entry.isdigit():
            named = [uuids[int(entry)]] if int(entry) < len(uuids) else []
        else:
            named = [uuid for uuid in uuids if entry.startswith("GPU-") and uuid.startswith(entry)]
        if len(named) != 1 or named[0] in chosen:
            break
        chosen.append(named[0])
    return chosen


class NvmlReader:
    """Reads GPUs through NVML (`nvml`: the pynvml module, initialised), one call per figure."""

    def __init__(self, nvml, devices: list[tuple[str, object]]):
        """`devices`: (UUID, NVML handle) of each GPU to read."""
        self._nvml = nvml
        self._devices = devices
        self._reported: set[tuple[str, str, str]] = set()  # (GPU, figure, error) already logged
        # NVML counts energy since the driver loaded; Triton's family counts it since the server started
        self._energy_start = {uuid: self._figure(uuid, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
                              for uuid, handle in devices}

    def read(self) -> list[GpuReading]:
        nvml, readings = self._nvml, []
        for uuid, handle in self._devices:
            rates = self._figure(uuid, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._figure(uuid, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._figure(uuid, "power usage", nvml.nvmlDeviceGetPowerUsage, handle)  # mW
            limit = self._figure(uuid, "power limit", nvml.nvmlDeviceGetPowerManagementLimit, handle)  # mW
            energy = self._figure(uuid, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # mJ
            start = self._energy_start[uuid]
            readings.append(GpuReading(
                uuid=uuid,
                utilization=None if rates is None else rates.gpu / 100,
                memory_used_bytes=None if memory is None else memory.used,
                memory_total_bytes=None if memory is None else memory.total,
                power_usage_watts=None if power is None else power / 1e3,
                power_limit_watts=None if limit is None else limit / 1e3,
                energy_joules=None if energy is None or start is None else (energy - start) / 1e3))
        return readings

    def _figure(self, uuid: str, what: str, call, handle):
        """call(handle), or None where NVML cannot give it: a figure this GPU does not have, silently; any other
        failure (a GPU lost from the bus) logged once, and the sample left out of each scrape while it lasts."""
        try:
            return call(handle)
        except self._nvml.NVMLError as err:
            if not isinstance(err, self._nvml.NVMLError_NotSupported) and (uuid, what, str(err)) not in self._reported:
                self._reported.add((uuid, what, str(err)))
                log.warning("NVML cannot read the %s of GPU %s: %s; its sample is left out of /metrics", what, uuid,
                            err)
            return None


def open_nvml(environ: Mapping[str, str]) -> tuple[NvmlReader | None, str]:
    """(a reader of the GPUs CUDA sees under `environ`, their UUIDs), or (None, why there is none)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'capsnet-serve[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:  # no libnvidia-ml.so (no driver), or a driver that is not loaded
        return None, f"NVML does not start: {err}"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(pynvml.nvmlDeviceGetCount())]
        uuids = [pynvml.nvmlDeviceGetUUID(handle) for handle in handles]
    except pynvml.NVMLError as err:
        pynvml.nvmlShutdown()
        return None, f"NVML does not list the GPUs: {err}"
    visible = cuda_visible(uuids, environ.get("CUDA_VISIBLE_DEVICES"))
    if not visible:
        pynvml.nvmlShutdown()
        return None, (f"none of NVML's {len(uuids)} GPUs is visible to CUDA (CUDA_VISIBLE_DEVICES="
                      f"{environ.get('CUDA_VISIBLE_DEVICES')!r})")
    reader = NvmlReader(pynvml, [(uuid, handles[uuids.index(uuid)]) for uuid in visible])
    return reader, ", ".join(visible)
