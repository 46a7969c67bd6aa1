"""One served model version and the request path every API takes to it (docs/artifacts.md): check that the request
may be served, validate its images, infer them through the version's batcher.

Servicers stay thin: they parse their protocol's message into a float32 (N, C, H, W) array and
`await infer`, which validates it. Errors are the transport-neutral ones of `serving/errors.py`. Whether a request
may be served is the server's phase (`serving/lifecycle.py`), which the model reads.

A version is opened (loaded and self-checked off the event loop), warmed up, then served; the model manager
(`serving/engine/model_manager.py`) decides which versions serve. Requests hold the version they were given (use())
until answered, so close() first waits for them, then for its queue, then frees the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.decoder import CLASSIFIER_PART, DECODER_PART
from capsnet.model_description.schema import ModelDescription
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts, load_artifacts
from capsnet.serving.engine.backend_registry import BACKEND_KINDS
from capsnet.serving.engine.backends import LoadedBackend, load_backend
from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.batcher import Batcher, BatcherConfig, BatchOutput, BatchRun, ImageSource, OutputSink
from capsnet.serving.engine.decoder import CHOICE as DECODER_CHOICE
from capsnet.serving.engine.decoder import check_rows, decoder_spec_fields, load_decoder
from capsnet.serving.engine.self_check import SelfCheck
from capsnet.serving.errors import InvalidInput
from capsnet.serving.lifecycle import Lifecycle
from capsnet.serving.observability.metrics import Metrics, VersionMetrics
from capsnet.serving.observability.observe import CURRENT
from capsnet.serving.observability.statistics import PHASES, ModelStatistics

log = logging.getLogger(__name__)

# KServe ModelMetadata platform of each backend, named as Triton names them



@dataclass(frozen=True, kw_only=True)
class ModelSpec(ModelDescription):
    """The served model: its description (model.json) and how this server runs it."""

    max_batch_size: int  # per backend run and per request
    backend: str
    precision: str
    platform: str
    self_check: SelfCheck  # the reference images through this backend, before SERVING
    choice: str  # why this backend and precision
    part: str = CLASSIFIER_PART  # images in, or DECODER_PART: poses and a class index in


@dataclass
class InferenceResult:
    # the backend's outputs by their model.json names, (N, ...) float32: probabilities, poses (not for a model without
    # them, a CNN baseline), reconstruction (only when asked)
    outputs: dict[str, np.ndarray]
    queue_seconds: float  # waiting for a batch
    compute_seconds: float  # backend runs that included these images
    runs: list[BatchRun] = dataclasses.field(default_factory=list)  # those runs


@contextlib.contextmanager
def _startup_step(what: str, max_batch_size: int):
    """A backend failing before SERVING is one line (capsnet serve exits 2), not a traceback: most often a batch of
    --max-batch-size images that does not fit in memory, which the backends report each in their own way."""
    try:
        yield
    except CapsNetError:
        raise
    except Exception as err:  # numpy's MemoryError, onnxruntime's RuntimeException, torch's OutOfMemoryError, ...
        log.debug("%s failed", what, exc_info=True)  # the traceback, for --log-level DEBUG
        raise CapsNetError(f"{what} failed: {type(err).__name__}: {first_line(err)} (--max-batch-size "
                           f"{max_batch_size}: a smaller one needs less memory)") from None


def check_image_shape(spec: ModelDescription, shape: list[int], field: str) -> None:
    """`shape` [N, C, H, W] is of images the model takes: its one size, or for a model of any size a height and
    width in its range; InvalidInput naming the valid sizes otherwise. Every API's request path comes here before
    any data is decoded."""
    sizes = spec.sizes
    if sizes.fixed:
        expected = f"[N, {', '.join(map(str, spec.input_shape))}]"
    else:
        expected = f"[N, {sizes.channels}, H, W] ({sizes.describe()})"
    if len(shape) != 4 or tuple(shape[1:]) not in sizes:
        raise InvalidInput(f"{field}: expected shape {expected}, got {shape}")


def check_values(images: np.ndarray, field: str, first: int = 0) -> None:
    """Every value of `images` (N, C, H, W) float32 is finite and in [0, 1]; InvalidInput naming the first image that
    is not, counting from `first`."""
    if 0 <= images.min() and images.max() <= 1:  # the common case, in two reductions (False with NaN)
        return
    rows = images.reshape(len(images), -1)  # (N, C*H*W)
    finite = np.isfinite(rows).all(axis=1)  # (N,)
    if not finite.all():
        raise InvalidInput(f"{field}: image {first + int(np.argmin(finite))} contains NaN or Inf; expected finite "
                           "values in [0, 1]")
    in_range = ((rows >= 0) & (rows <= 1)).all(axis=1)  # (N,)
    if not in_range.all():
        index = int(np.argmin(in_range))
        raise InvalidInput(f"{field}: image {first + index} has values in [{rows[index].min():g}, "
                           f"{rows[index].max():g}]; expected [0, 1] (divide 8-bit pixels by 255, or send them as "
                           "uint8)")


def batcher_config(spec: ModelSpec, config: ServerConfig) -> BatcherConfig:
    """A version's batching as the server's settings ask, wherever its batcher runs (this process, or an engine
    process beside front ends): batches of up to its spec's max_batch_size (a decoder's may exceed the server's)."""
    return BatcherConfig(spec.max_batch_size, config.max_queue_delay_us / 1e6, config.max_queue_size)


def _load(folder: Path, config: ServerConfig) -> tuple[ModelArtifacts, LoadedBackend]:
    """An export folder's files, checked, and its backend, self-checked (blocking: run in a worker thread)."""
    artifacts = load_artifacts(folder)
    with _startup_step("loading the backend", config.max_batch_size):
        return artifacts, load_backend(artifacts, config)


class VersionQueue(Protocol):
    """The engine core's one interface for a version: validated images in, outputs out (or into sinks). Two clients
    keep this contract: the version's Batcher itself, in process, and a front end's queue to the engine process
    (serving/processes/front_end.py), whose Batcher is the same code."""

    config: BatcherConfig

    async def submit(self, images: np.ndarray | ImageSource, deadline: float | None = None,
                     sinks: dict[str, OutputSink] | None = None) -> BatchOutput:
        """One group of images of one size."""

    async def submit_sizes(self, groups: list, deadline: float | None = None,
                           sinks: dict[str, OutputSink] | None = None) -> list[BatchOutput]:
        """One request's groups of several sizes, side by side."""

    async def drain(self) -> None:
        """Until every request it holds is answered."""


class InferenceService:
    """One model version as served: its description, its queue to the engine core, statistics and metrics; it serves
    while the server's lifecycle allows."""

    def __init__(self, spec: ModelSpec, backend: Backend | None, batcher: VersionQueue, lifecycle: Lifecycle,
                 metrics: VersionMetrics, stats: ModelStatistics):
        """`backend`: the version's, where this process runs it; None in a front end, whose engine process runs it."""
        self.spec = spec
        self.backend = backend
        self.batcher = batcher
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.stats = stats
        # what its requests' headers were checked to be, by what they declare (serving/protocol/kserve.py): the check of
        # a header against this version does not change while it serves
        self.accepted_inputs: dict[tuple, Any] = {}  # kserve.InputTensor
        self.accepted_outputs: dict[tuple, Any] = {}  # [kserve.OutputPlan]
        self._users = 0  # requests holding this version (use())
        self._unused = asyncio.Event()  # set while none does
        self._unused.set()

    @classmethod
    async def open(cls, folder: Path, name: str, version: str, config: ServerConfig, metrics: Metrics,
                   lifecycle: Lifecycle, part: str = CLASSIFIER_PART) -> "InferenceService":
        """Export folder -> backend (loaded and self-checked in a worker thread) -> the version `name` `version`,
        not yet warmed up; CapsNetError if the folder or backend is unusable. `part`: the folder's classifier, or
        its decoder alone.

        Called inside the server's event loop (the batcher's scheduler is a task of it). A backend that becomes
        unusable (errors.BackendUnusable) fails the lifecycle.
        """
        fields: dict = {"name": name, "version": version}
        if part == DECODER_PART:
            artifacts, decoder, check = await asyncio.to_thread(load_decoder, folder, config)
            loaded = LoadedBackend(decoder, check, DECODER_CHOICE)
            fields.update(decoder_spec_fields(artifacts, config.max_batch_size))
        else:
            artifacts, loaded = await asyncio.to_thread(_load, folder, config)
        backend = loaded.backend
        log.info("loaded %s %s from %s with %s (%s): %s", name, version, folder, backend.name, backend.precision,
                 backend.description)
        spec = ModelSpec(
            **{**artifacts.description_fields(), "max_batch_size": config.max_batch_size, **fields},
            backend=backend.name,
            precision=backend.precision,
            platform=BACKEND_KINDS[backend.name].platform,
            self_check=loaded.check,
            choice=loaded.why,
        )
        series, stats = metrics.for_version(name, version), ModelStatistics(name, version)
        batcher = Batcher(backend, batcher_config(spec, config), series, stats, on_unusable=lifecycle.fail)
        return cls(spec, backend, batcher, lifecycle, series, stats)

    async def warmup(self) -> None:
        """Run the batch sizes dynamic batching makes most: powers of two up to the max, and the max."""
        started = time.monotonic()
        limit = self.spec.max_batch_size
        sizes = sorted({2 ** i for i in range(limit.bit_length())} | {limit})
        assert self.backend is not None  # a front end's versions are warmed up by the engine process
        with _startup_step(f"warming up batch sizes {sizes}", limit):
            await asyncio.to_thread(self.backend.warmup, sizes, self.spec.input_shape)
        log.info("warmed up batch sizes %s in %.2f s", sizes, time.monotonic() - started)

    def record_serving(self) -> None:
        """Its metrics' serving series; a front end's version (no backend here) leaves the GPU's to the engine
        process."""
        backend = self.backend
        self.metrics.record_serving(self.spec, on_gpu=backend is not None and backend.on_gpu,
                                    gpu_timed=backend is not None and backend.gpu_timer is not None)

    def use(self) -> "InferenceService":
        """Held by a request (`with version.use():`) from when it is given this version until it is answered; close()
        waits for it."""
        return self

    def __enter__(self) -> "InferenceService":
        self._users += 1
        self._unused.clear()
        return self

    def __exit__(self, *exc) -> None:
        self._users -= 1
        if not self._users:
            self._unused.set()

    async def close(self) -> None:
        """Once no request holds this version and its queue is empty, free the backend."""
        await self._unused.wait()
        await self.batcher.drain()
        if self.backend is not None:
            self.backend.close()

    def check_batch_size(self, count: int, field: str) -> None:
        """Servicers call it before decoding anything, so an oversized batch costs no decoding."""
        if count == 0:
            raise InvalidInput(f"{field}: empty batch; expected 1 to {self.spec.max_batch_size} images")
        if count > self.spec.max_batch_size:
            raise InvalidInput(f"{field}: {count} images exceed the maximum of {self.spec.max_batch_size} per request; "
                               "split them over several requests")

    def validate_values(self, images: np.ndarray | ImageSource, field: str) -> None:
        """Images in memory: float32, finite, in [0, 1]; those still in a region (ImageSource) are checked as the
        batcher reads them."""
        if isinstance(images, np.ndarray):
            if images.dtype != np.float32:
                raise InvalidInput(f"{field}: expected float32 values, got {images.dtype}")
            if self.spec.decoder is not None and self.spec.part == DECODER_PART:
                check_rows(images, self.spec.decoder)
            else:
                check_values(images, field)

    def check_arrival(self, arrival: float) -> None:
        """ServerNotReady for a request that arrived (time.monotonic()) when it cannot be served."""
        self.lifecycle.check_arrival(arrival)

    async def infer(self, images: np.ndarray | ImageSource, *, field: str = "images", reconstruction: bool = False,
                    deadline: float | None = None, arrival: float | None = None,
                    sinks: dict[str, OutputSink] | None = None) -> InferenceResult:
        """Infer `images` (N, C, H, W), in memory or still in a shared-memory region, through the batcher, once their
        values are checked.

        The protocol adapters admit a request before decoding its data, each once: check_arrival(), the image shape
        (check_image_shape, or the image decoder), check_batch_size(); `arrival` (time.monotonic()): when the request
        reached the server, for its statistics. Outputs of `sinks` are written there, not answered.
        """
        (result,) = await self._infer_request([images], field, reconstruction, deadline, arrival, sinks)
        return result

    async def infer_sizes(self, groups: list[np.ndarray], *, field: str = "images", reconstruction: bool = False,
                          deadline: float | None = None, arrival: float | None = None) -> list[InferenceResult]:
        """One request's images of several sizes, a (N_k, C, H_k, W_k) array each, inferred side by side (a model of
        any size) and counted as one request: in the statistics, the metrics and the access log."""
        return await self._infer_request(groups, field, reconstruction, deadline, arrival, None)

    async def _infer_request(self, groups: list, field: str, reconstruction: bool, deadline: float | None,
                             arrival: float | None, sinks: dict[str, OutputSink] | None) -> list[InferenceResult]:
        arrival = time.monotonic() if arrival is None else arrival
        if reconstruction and "reconstruction" not in self.spec.output_names:
            raise InvalidInput("reconstruction: this model was exported without the reconstruction output "
                               "(re-export with `capsnet export --reconstruction`)")
        for images in groups:
            self.validate_values(images, field)
        try:
            if len(groups) == 1:  # the common case, without a gather's tasks
                outputs = [await self.batcher.submit(groups[0], deadline, sinks)]
            else:
                outputs = await self.batcher.submit_sizes(groups, deadline, sinks)
        except BaseException:  # queue full, past its deadline, a backend failure, cancelled: failed at the model
            self.stats.record_request(False, time.monotonic() - arrival)
            raise
        images_count = sum(len(images) for images in groups)
        for output in outputs:
            self.metrics.queue_wait.observe(output.queue_wait)
        runs = [run for output in outputs for run in output.runs]
        queue_wait = max(output.queue_wait for output in outputs)  # the sizes waited side by side
        phases = runs[0].phases() if len(runs) == 1 else {name: sum(run.phases()[name] for run in runs)
                                                           for name in PHASES}
        self.stats.record_request(True, time.monotonic() - arrival, images_count, queue_wait, phases)
        if (record := CURRENT.get()) is not None:
            record.answered(images_count, outputs[0] if len(outputs) == 1 else BatchOutput(
                {}, queue_wait, sorted(runs, key=lambda run: run.cut), min(output.submitted for output in outputs)))
        return [InferenceResult({name: array for name, array in output.outputs.items()
                                 if reconstruction or name != "reconstruction"},
                                queue_seconds=output.queue_wait, compute_seconds=output.compute, runs=output.runs)
                for output in outputs]
