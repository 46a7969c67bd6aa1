"""Running a model with torch on the CPU or a CUDA GPU, numpy in and numpy out: one runner (padded batch buckets,
CUDA graphs on a GPU) for each forward the server has — the checkpoint eager, its routing in the fused kernels, an
AOTInductor package. The server's torch, fused and aoti backends serve with it, and export checks its packages with
the same runner, so the gate checks the code that serves.

On a GPU, images go up and outputs come back through pinned host buffers sized once for the largest batch, as
asynchronous copies on the runner's own stream: nothing is allocated per batch but the arrays handed back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.gpu_timing import GpuTimer, timed

Outputs = dict[str, np.ndarray]


def cuda_unavailable_reason(gpu: int) -> str | None:
    """Why CUDA device `gpu` cannot run (or compile for) torch here, or None."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"no CUDA GPU is visible to torch {torch.__version__} ({build})"
    count = torch.cuda.device_count()
    if not 0 <= gpu < count:
        return f"no CUDA GPU {gpu}: this machine has {count} (0 to {count - 1})"
    return None


def gpu_facts(gpu: int | None) -> tuple[str, str]:
    """(name, compute capability "major.minor") of CUDA device `gpu` (None: the current one)."""
    major, minor = torch.cuda.get_device_capability(gpu)
    return torch.cuda.get_device_name(gpu), f"{major}.{minor}"


def use_threads(count: int) -> None:
    """torch's intra-op threads, a setting of the whole process: set only when it is another count, so loading a
    model version does not rebuild the pool that the versions already serving run their batches on."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def is_device_error(err: BaseException) -> bool:
    """Whether a failure under a CUDA run is the device's (out of memory, a CUDA error), not the caller's."""
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8 raises it for CUDA errors
    return isinstance(err, (torch.OutOfMemoryError, *((accelerator_error,) if accelerator_error else ()))) or (
        isinstance(err, RuntimeError) and "CUDA" in str(err))


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes: powers of two below `max_batch`, and `max_batch` itself."""
    return tuple(sorted({2 ** i for i in range(max_batch.bit_length()) if 2 ** i < max_batch} | {max_batch}))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `batch` images."""
    for size in buckets:
        if size >= batch:
            return size
    raise CapsNetError(f"a batch of {batch} images is more than the largest bucket, {buckets[-1]}")


class StagedIO:
    """Pinned host buffers for one input and the outputs, sized for `max_batch`, and the stream the copies and the
    computation run on. On the CPU there is nothing to stage: tensors are views of the caller's arrays."""

    def __init__(self, device: torch.device, row_shape: tuple[int, ...], output_rows: dict[str, tuple[int, ...]],
                 max_batch: int):
        self.device = device
        self.max_batch = max_batch
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:
            self.host_input = torch.empty((max_batch, *row_shape), dtype=torch.float32, pin_memory=True)
            self.host_outputs = {name: torch.empty((max_batch, *rows), dtype=torch.float32, pin_memory=True)
                                 for name, rows in output_rows.items()}

    def upload(self, images: np.ndarray, target: torch.Tensor | None = None) -> torch.Tensor:
        """images (N, ...) -> the same on the device: into `target`'s first N rows where given (enqueued on the
        stream), else a new device tensor (CPU: a view of `images`)."""
        batch = len(images)
        if not self.cuda:
            with warnings.catch_warnings():
                # a batch of one request views the request's read-only bytes; the forwards only read their input
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                tensor = torch.from_numpy(images)
            if target is None:
                return tensor
            target[:batch].copy_(tensor)
            return target[:batch]
        self.host_input[:batch].numpy()[...] = images  # pinned, so the copy below is a true asynchronous DMA
        with torch.cuda.stream(self.stream):
            if target is None:
                target = torch.empty_like(self.host_input[:batch], device=self.device)
            target[:batch].copy_(self.host_input[:batch], non_blocking=True)
        return target[:batch]

    def download(self, outputs: dict[str, torch.Tensor], batch: int) -> Outputs:
        """The first `batch` rows of each device output as float32 arrays, the caller's to keep."""
        if not self.cuda:
            return {name: output[:batch].float().numpy().copy() for name, output in outputs.items()}
        with torch.cuda.stream(self.stream):
            for name, output in outputs.items():
                self.host_outputs[name][:batch].copy_(output[:batch], non_blocking=True)
        assert self.stream is not None  # made with self.cuda
        self.stream.synchronize()
        return {name: self.host_outputs[name][:batch].numpy().copy() for name in outputs}

    def on_stream(self):
        """The context that makes the runner's stream current (a no-op on the CPU)."""
        return torch.cuda.stream(self.stream) if self.cuda else _nothing()


@contextlib.contextmanager
def strict_fp32(enabled: bool = True) -> Iterator[None]:
    """No TF32 for the convolutions (cuDNN) and products (cuBLAS) launched or captured inside: TF32 rounds their
    inputs to 10 bits, which the FP32 parity bound (1e-4) does not allow. torch's switches are process-wide, so
    they are set around an engine's own calls and restored, not left off for every other engine in the process;
    a CUDA graph keeps the kernels chosen while it was captured."""
    if not enabled:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextlib.contextmanager
def timed_convolutions() -> Iterator[None]:
    """cuDNN times its convolution algorithms for each shape first met inside, and keeps the fastest for that shape:
    its heuristics alone (torch's default) chose slow bf16 convolutions (docs/experiments/README.md, "What the
    server's settings rest on"). Scoped like `strict_fp32`: graphs captured inside keep the kernels chosen."""
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@dataclass(frozen=True)
class Forward:
    """What a runner runs: `call` takes images (B, C, H, W) float32 on the runner's device and gives the outputs in
    the runner's order. `capturable`: the call may be captured in a CUDA graph."""

    call: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    what: str  # what runs, for a refused batch: "the model", "the package"
    capturable: bool


def module_forward(model: Callable, output_names: tuple[str, ...]) -> Forward:
    """A torch module (or anything called like one) whose output holds each name as an attribute: the checkpoint's
    model eager, or with its routing in the fused kernels."""
    def call(images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = model(images)  # once: a generator calling it per name would run the model once per output
        return tuple(getattr(outputs, name) for name in output_names)

    return Forward(call, "the model", True)


def package_forward(path, device: torch.device) -> Forward:
    """An AOTInductor package (torch._inductor.aoti_load_package) on `device`, run at each batch's own size and never
    captured: a package's runtime refuses a capturing stream unless loaded single-threaded (pytorch/pytorch#148601),
    which has not been measured here. Its outputs come from the caching allocator: reused, not cudaMalloc'd."""
    try:
        package = torch._inductor.aoti_load_package(
            str(path), device_index=device.index if device.type == "cuda" else -1)
    except Exception as err:  # a damaged archive, a shared object for another machine
        raise CapsNetError(f"{path} cannot be loaded: {type(err).__name__}: "
                           f"{(str(err).strip().splitlines() or [''])[0][:300]}") from None
    return Forward(package, "the package", False)


class TorchRunner:
    """A `forward` on the CPU or a CUDA GPU, numpy in and numpy out, for batches of 1 to `max_batch` images.

    With `buckets` (default: on a GPU, for a forward that can be captured) each batch runs at the smallest padded
    bucket that holds it, from static input and output tensors allocated once per bucket; on a GPU with `graphs`,
    each bucket's forward pass is a CUDA graph captured at start-up and replayed per batch (one launch instead of a
    few hundred), otherwise the forward runs on the bucket's static tensors as it is. Without buckets each batch runs
    at its own size (on a GPU from a staging input sized for `max_batch`)."""

    def __init__(self, forward: Forward, device: torch.device, row_shape: tuple[int, ...],
                 output_rows: dict[str, tuple[int, ...]], max_batch: int, buckets: bool | None = None,
                 graphs: bool = True, fp32: bool = False):
        """`fp32`: the forward's convolutions and products run in strict fp32 (`strict_fp32`)."""
        self.forward, self.device, self.output_names = forward, device, tuple(output_rows)
        cuda = device.type == "cuda"
        self.max_batch, self.fp32 = max_batch, fp32 and cuda  # TF32 is a CUDA matter
        bucketed = cuda and forward.capturable if buckets is None else buckets
        self.buckets = bucket_sizes(max_batch) if bucketed else ()
        self.io = StagedIO(device, row_shape, output_rows, max_batch)
        self.graphs = bucketed and graphs and cuda and forward.capturable
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # each batch's forward pass, timed on the GPU
        self.gpu_timer = GpuTimer(self.io.stream) if self.io.stream is not None else None
        # the static tensors outside inference mode: each batch is copied into them (inference tensors refuse that)
        for size in self.buckets:
            self.inputs[size] = torch.zeros((size, *row_shape), dtype=torch.float32, device=device)
            if not self.graphs:
                self.outputs[size] = {name: torch.empty((size, *rows), dtype=torch.float32, device=device)
                                      for name, rows in output_rows.items()}
        # unbucketed on a GPU: the pinned staging copies each batch up into this
        self._input = (torch.empty((max_batch, *row_shape), dtype=torch.float32, device=device)
                       if cuda and not self.buckets else None)
        if self.graphs:
            self._capture(torch.cuda.graph_pool_handle())

    def describe(self) -> str:
        """How batches run, for a backend's description ("" unbucketed)."""
        if not self.buckets:
            return ""
        return f"{'CUDA graphs' if self.graphs else 'eager'} for batch buckets {'/'.join(map(str, self.buckets))}"

    def _capture(self, pool) -> None:
        with torch.inference_mode(), self.io.on_stream(), strict_fp32(self.fp32), timed_convolutions():
            # largest first: the shared memory pool is sized by it, and the smaller captures fit in what it left
            for size in reversed(self.buckets):
                for _ in range(2):  # cuDNN/cuBLAS pick and allocate their kernels outside the capture
                    self.forward.call(self.inputs[size])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.io.stream):
                    self.outputs[size] = self._named(self.forward.call(self.inputs[size]))
                self._graphs[size] = graph
        assert self.io.stream is not None  # graphs are captured on a GPU only
        self.io.stream.synchronize()

    def _named(self, outputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.output_names, outputs))

    def _checked(self, batch: int) -> None:
        if not 1 <= batch <= self.max_batch:
            raise CapsNetError(f"{self.forward.what} runs 1 to {self.max_batch} images at a time, got {batch}")

    def run(self, images: np.ndarray) -> Outputs:
        batch = len(images)
        if not self.buckets:
            self._checked(batch)
            return self.io.download(self._call(self.io.upload(images, self._input)), batch)
        size = bucket_for(batch, self.buckets)
        # rows past `batch` keep earlier images (or zeros): every image is computed on its own, so they change
        # nothing in the rows returned
        self.io.upload(images, self.inputs[size])
        self._replay(size)
        return self.io.download(self.outputs[size], batch)

    def run_on_device(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """images already on the device (N, ...) -> the outputs' first N rows on the device (bucketed: views of the
        bucket's static outputs, which the next run overwrites): the engine's time without the host's copies."""
        batch = len(images)
        if not self.buckets:
            self._checked(batch)
            return self._call(images)
        size = bucket_for(batch, self.buckets)
        with self.io.on_stream():
            self.inputs[size][:batch].copy_(images, non_blocking=True)
        self._replay(size)
        return {name: output[:batch] for name, output in self.outputs[size].items()}

    def _call(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward on a batch at its own size: its outputs come from the caching allocator, fresh each call."""
        with torch.inference_mode(), self.io.on_stream(), timed(self.gpu_timer), strict_fp32(self.fp32):
            return self._named(self.forward.call(images))

    def _replay(self, size: int) -> None:
        with torch.inference_mode(), self.io.on_stream(), timed(self.gpu_timer):
            if self.graphs:
                self._graphs[size].replay()
                return
            with strict_fp32(self.fp32):
                for name, output in self._named(self.forward.call(self.inputs[size])).items():
                    self.outputs[size][name].copy_(output)
