"""Backend and precision choice: `--backend auto` takes the fastest backend that can run here,
`--precision auto` the fastest precision whose self-check passes on this machine; both log why.

What auto may race on each device is the backend table's (capsnet/model_description/backend_table.py): on a GPU host
without a usable TensorRT plan, the fused routing kernels, torch with CUDA graphs and ONNX Runtime's GPU providers; on
the CPU, ONNX Runtime's and OpenVINO's FP32 and INT8 graphs, where installed. Every candidate is loaded, self-checked
and timed at the batch sizes the batcher cuts (`race_batch_sizes`); the fastest passing one serves, and a reduced
precision only when AUTO_MIN_SPEEDUP faster than the fastest FP32 (`pick`). One line says what won and by how much.

Every backend is self-checked on the export's reference images before the server reports SERVING
(serving/engine/self_check.py): a backend that fails is refused with one line, never served.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.model_description.backend_table import BACKEND_TABLE, auto_candidates
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backend_registry import backend_class
from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.self_check import SelfCheck, best_times, refusal, self_check

log = logging.getLogger(__name__)

# --precision auto serves a reduced precision only when it is at least this much faster than FP32 at warm-up:
# the margin keeps timing noise from flipping the choice between runs.
AUTO_MIN_SPEEDUP = 1.1
AUTO_TIMING_ROUNDS = 5
# a burst of concurrent clients, between a lone request and the largest batch the batcher cuts
RACE_MIDDLE_BATCH = 16
# A CPU backend whose runs take at least this long an image (wall time at a burst's batch, on all cores but the one
# kept for the event loop) gets that core too: a request's path on the loop costs 0.3-0.6 ms of CPU on the 2-core
# hosts measured, so beside such runs the loop's core mostly idles. On 2 cores the `paper` preset (about 5 ms an
# image) then serves 1.4-1.7x the requests/s; the `tiny` preset (0.1 ms) keeps the loop its core (docs/serving.md,
# "Intra-op threads").
EVERY_CORE_RUN_S = 0.001


@dataclass
class LoadedBackend:
    backend: Backend
    check: SelfCheck  # the self-check it passed
    why: str  # why this backend and precision
    race: list[Entrant] = field(default_factory=list)  # auto's: every candidate that passed, as timed


def gpu_host() -> bool:
    """Whether an NVIDIA driver is there (its /proc entry, or in a container its device node); only then is torch
    asked about CUDA, so that a server on a CPU host that serves ONNX Runtime never imports torch."""
    return any(os.path.exists(path) for path in ("/proc/driver/nvidia/version", "/dev/nvidiactl"))


def choose_backend(artifacts: ModelArtifacts, config: ServerConfig) -> tuple[str | None, str]:
    """(backend name, why): "tensorrt" for a TensorRT plan on its GPU, else None on a host with a CUDA GPU (the
    fastest of the GPU candidates is measured next), else "onnxruntime" (on its GPU providers if any; on the CPU,
    raced against the table's other CPU candidates)."""
    from capsnet.runtime.tensorrt_runner import unavailable_reason
    from capsnet.serving.engine.backends.onnxruntime_backend import gpu_providers_installed

    no_trt: str | None
    if artifacts.tensorrt_plan is None or artifacts.tensorrt_info is None:  # both or neither: see load_artifacts
        no_trt = "no TensorRT plan in the model directory"
    elif config.precision not in ("auto", artifacts.tensorrt_info["precision"]):
        no_trt = (f"the TensorRT plan is {artifacts.tensorrt_info['precision']}, --precision {config.precision} "
                  "was asked")
    else:
        no_trt = unavailable_reason(config.gpu_or_first)
        if no_trt is None:
            return "tensorrt", "a TensorRT plan and a CUDA GPU are present"
    if gpu_host():
        from capsnet.runtime.torch_runner import cuda_unavailable_reason

        no_cuda = cuda_unavailable_reason(config.gpu_or_first)
        if no_cuda is None:
            return None, f"not tensorrt: {no_trt}"
        no_trt += f"; no GPU backend: {no_cuda}"
    gpu = gpu_providers_installed()
    where = f"with {' and '.join(gpu)}" if gpu else "on the CPU (onnxruntime-gpu not installed)"
    return "onnxruntime", f"{where}; not tensorrt: {no_trt}"


def create_backend(name: str, precision: str, artifacts: ModelArtifacts, config: ServerConfig) -> Backend:
    return backend_class(name).create(artifacts, precision, config)


def checked(backend: Backend, artifacts: ModelArtifacts, config: ServerConfig) -> SelfCheck:
    check = self_check(backend, artifacts.reference, config.max_batch_size, artifacts)
    log.info("self-check %s: %s", "passed" if check.passed else "FAILED", check.describe())
    return check


def unavailable(name: str, precision: str, artifacts: ModelArtifacts, device: str) -> str | None:
    """Why the table's row `name` cannot be raced at `precision` on `device` ("cpu" or "gpu") for this export, before
    anything is loaded; None where it can."""
    row = BACKEND_TABLE[name]
    if row.requires is not None and importlib.util.find_spec(row.requires) is None:
        return f"{row.requires} is not installed (pip install 'capsnet-serve[{row.extra}]')"
    if row.reads == "onnx" and precision not in artifacts.onnx:
        return f"no {precision} ONNX model in the export"
    if row.routing_engine is not None and artifacts.routing.get("gpu_engine") != row.routing_engine:
        return (f"model.json: its routing does not run in the {row.routing_engine} engine "
                f"({artifacts.routing.get('gpu_engine')})")
    return backend_class(name).unavailable_reason(device)


def candidates(device: str, artifacts: ModelArtifacts, config: ServerConfig,
               backend: str | None = None) -> list[tuple[str, str]]:
    """(backend, precision) pairs auto races on `device` for this export: the table's, those that can run here, of
    --precision (all of the row's for auto), of `backend` alone where one was named."""
    return [(name, precision) for name, precision in auto_candidates(device, config.precision)
            if backend in (None, name) and unavailable(name, precision, artifacts, device) is None]


def load_backend(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    """The backend to serve with, self-checked, on every core where its runs are long (every_core); CapsNetError if
    it cannot load or fails its self-check."""
    loaded = _load_backend(artifacts, config)
    backend = loaded.backend
    raced = next((entrant.seconds for entrant in loaded.race
                  if (entrant.name, entrant.precision) == (backend.name, backend.precision)), None)
    widened = every_core(backend, artifacts, config, raced)
    if widened is None:
        return loaded
    threads, per_image = widened
    log.info("runs of %.2g ms an image: %d intra-op threads, every core (the event loop's share is small beside "
             "them; --threads sets the count)%s", per_image * 1e3, threads,
             ": raced again there" if loaded.race else "")
    try:  # the whole choice again: a race's order on all cores but one need not hold on every core
        again = _load_backend(artifacts, replace(config, threads=threads))
    except CapsNetError as err:  # nothing passed on every core: served on the threads it passed with
        log.warning("on every core: %s; kept on all cores but one (%d)", err, config.intra_op_threads)
        return loaded
    backend.close()
    return replace(again, why=f"{again.why}; every core ({threads} threads): {per_image * 1e3:.2g} ms an image")


def every_core(backend: Backend, artifacts: ModelArtifacts, config: ServerConfig,
               raced: Mapping[int, float] | None = None) -> tuple[int, float] | None:
    """(every core, its run's seconds an image) where `backend`, loaded on --threads 0's all-but-one core, runs on the
    CPU and takes EVERY_CORE_RUN_S or longer an image at a burst's batch (RACE_MIDDLE_BATCH); None to keep it as
    it is. `raced`: its seconds by batch size where the auto race timed it (race_batch_sizes holds that batch), else
    it is timed here as the race times its entrants."""
    if config.threads or config.cores < 2 or backend.on_gpu:
        return None
    batch = min(RACE_MIDDLE_BATCH, config.max_batch_size)
    if raced is None:
        raced = time_entrants([backend], artifacts.input_shape, (batch,))[0].seconds
    per_image = raced[batch] / batch
    return (config.cores, per_image) if per_image >= EVERY_CORE_RUN_S else None


def _load_backend(artifacts: ModelArtifacts, config: ServerConfig) -> LoadedBackend:
    name, why = config.backend, "asked for"
    if name == "auto":
        chosen, why = choose_backend(artifacts, config)
        if chosen is None:
            gpu_config = replace(config, gpu=config.gpu_or_first)
            loaded, _ = race(candidates("gpu", artifacts, gpu_config), artifacts, gpu_config, why,
                             f" on GPU {gpu_config.gpu}")
            if loaded is not None:
                return loaded
            chosen, why = "onnxruntime", "on the CPU: no GPU backend passed its self-check (logged above)"
        if chosen == "onnxruntime" and config.precision in ("auto", "fp32", "int8"):
            # the CPU (or ONNX Runtime's GPU providers): the table's CPU candidates raced
            return _race_or_refuse(candidates("cpu", artifacts, config), artifacts, config, why)
        log.info("backend auto: %s %s", chosen, why)
        name = chosen
    if config.precision == "auto" and BACKEND_TABLE[name].auto_cpu:
        return _race_or_refuse(candidates("cpu", artifacts, config, backend=name), artifacts, config, why)
    return _served(create_backend(name, config.precision, artifacts, config), artifacts, config, f"{name}: {why}")


def _served(backend: Backend, artifacts: ModelArtifacts, config: ServerConfig, why: str) -> LoadedBackend:
    check = checked(backend, artifacts, config)
    if not check.passed:
        backend.close()
        raise refusal(check)
    return LoadedBackend(backend, check, why)


def _race_or_refuse(pairs: list[tuple[str, str]], artifacts: ModelArtifacts, config: ServerConfig,
                    why: str) -> LoadedBackend:
    """The CPU race, or CapsNetError naming every refusal."""
    if not pairs:  # nothing can run it here: the backend asked for says why (no such ONNX model, not installed)
        name = "onnxruntime" if config.backend == "auto" else config.backend
        precision = "fp32" if config.precision == "auto" else config.precision
        return _served(create_backend(name, precision, artifacts, config), artifacts, config, f"{name}: {why}")
    loaded, refused = race(pairs, artifacts, config, why)
    if loaded is None:
        raise CapsNetError("; ".join(refused))
    return loaded


@dataclass(frozen=True)
class Entrant:
    """A candidate that passed its self-check, timed: its best time at each race batch size (seconds)."""

    name: str
    precision: str
    seconds: dict[int, float]

    @property
    def score(self) -> float:
        """The geometric mean of its times over the race's batch sizes: each size counts alike, whatever its
        length, and a ratio of two scores is the geometric mean of their ratios at each size."""
        return math.exp(sum(map(math.log, self.seconds.values())) / len(self.seconds))

    def label(self) -> str:
        return f"{self.name} {self.precision}"


def race_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """A lone request, a burst of concurrent clients, and the largest batch the batcher cuts."""
    return tuple(sorted({1, min(RACE_MIDDLE_BATCH, max_batch_size), max_batch_size}))


def pick(entrants: list[Entrant], min_speedup: float = AUTO_MIN_SPEEDUP) -> int:
    """The index of the entrant to serve: the best score, except that a reduced precision serves only when
    `min_speedup` faster than the best FP32 entrant (one not clearly faster changes answers for nothing); among
    equal scores, the earlier (the table's order)."""
    order = sorted(range(len(entrants)), key=lambda index: entrants[index].score)
    best = order[0]
    fp32 = [index for index in order if entrants[index].precision == "fp32"]
    if fp32 and entrants[best].precision != "fp32" and entrants[best].score * min_speedup > entrants[fp32[0]].score:
        best = fp32[0]
    return best


def describe_choice(entrants: list[Entrant], best: int) -> str:
    """"<precision> on <backend>, at batch 1/16/32: 0.41/2.9/5.6 ms, 1.14/1.35/1.36x onnxruntime int8, ..." (each
    other entrant's time over the winner's, at each race batch size; its geometric mean beside it)."""
    winner = entrants[best]
    sizes = list(winner.seconds)
    ms = "/".join(f"{1e3 * winner.seconds[size]:.3g}" for size in sizes)
    text = f"{winner.precision} on {winner.name}, at batch {'/'.join(map(str, sizes))}: {ms} ms"
    for other in sorted((e for e in entrants if e is not winner), key=lambda e: e.score):
        ratios = "/".join(f"{other.seconds[size] / winner.seconds[size]:.2f}" for size in sizes)
        text += f", {ratios}x {other.label()} ({other.score / winner.score:.2f}x)"
    fp32 = [e for e in entrants if e.precision == "fp32"]
    if winner.precision == "fp32" and len(fp32) < len(entrants):
        fastest = min((e for e in entrants if e.precision != "fp32"), key=lambda e: e.score)
        text += (f"; {fastest.label()} runs at {winner.score / fastest.score:.2f}x fp32's speed here, short of "
                 f"{AUTO_MIN_SPEEDUP:g}x")
    return text


def race(pairs: list[tuple[str, str]], artifacts: ModelArtifacts, config: ServerConfig, why: str,
         where: str = "") -> tuple[LoadedBackend | None, list[str]]:
    """Every (backend, precision) of `pairs` made and self-checked, those passing timed at race_batch_sizes and the
    one `pick` names served, and why each other was refused. None where none passes, or where under --precision auto
    no FP32 candidate does (a reduced precision's gate is relative to FP32's answers)."""
    passed: list[tuple[Backend, SelfCheck]] = []
    refused = []
    for name, precision in pairs:
        try:
            backend = create_backend(name, precision, artifacts, config)
            check = checked(backend, artifacts, config)
        except Exception as err:  # CapsNetError, or the runtime's own (a failed graph capture): the next candidate
            refused.append(f"{name} {precision}: {err if isinstance(err, CapsNetError) else repr(err)[:300]}")
            continue
        if check.passed:
            passed.append((backend, check))
        else:
            refused.append(f"{name} {precision}: {refusal(check)}")
            backend.close()
    for reason in refused:
        log.warning("backend auto: candidate refused%s: %s", where, reason)
    if not passed or (config.precision == "auto" and all(check.precision != "fp32" for _, check in passed)):
        for backend, _ in passed:
            backend.close()
        return None, refused
    backends = [backend for backend, _ in passed]
    entrants = time_entrants(backends, artifacts.input_shape, race_batch_sizes(config.max_batch_size))
    best = pick(entrants)
    for index, backend in enumerate(backends):
        if index != best:
            backend.close()
    choice = describe_choice(entrants, best) + where + (f"; refused: {'; '.join(refused)}" if refused else "")
    log.log(logging.WARNING if refused else logging.INFO, "precision auto: %s", choice)
    backend, check = passed[best]
    return LoadedBackend(backend, check, f"{backend.name}, auto: {choice}; {why}", entrants), refused


def time_entrants(backends: list[Backend], input_shape: tuple[int, int, int],
                  sizes: tuple[int, ...]) -> list[Entrant]:
    """Each backend's best of AUTO_TIMING_ROUNDS at each of `sizes`, after one untimed run each (allocations and
    kernel choices); the backends take turns (best_times), so a burst of other work slows them alike."""
    seconds: list[dict[int, float]] = [{} for _ in backends]
    for size in sizes:
        images = np.zeros((size, *input_shape), dtype=np.float32)  # (B, C, H, W)
        for backend in backends:
            backend.run(images)
        for timed, best in zip(seconds, best_times(backends, images, AUTO_TIMING_ROUNDS)):
            timed[size] = best
    return [Entrant(backend.name, backend.precision, timed) for backend, timed in zip(backends, seconds)]
