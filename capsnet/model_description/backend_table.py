"""Every engine that runs an exported model, in one table at the bottom of the layers: what `--backend` names, what it
reads from the export, the precisions it serves on a GPU and on the CPU, which of them `--backend auto` races where,
the precision-gate entries its reduced precisions answer to, and what it takes from CUDA shared memory. Serving makes
backends from it (serving/engine/backend_registry.py), export measures the gate's families from it, bench enumerates it.

Nothing here imports a runtime: a row names its serving class by module and class name, imported only when a server
makes that backend, so a CPU server never imports torch, TensorRT or OpenVINO.
"""

from __future__ import annotations

from dataclasses import dataclass

from capsnet.model_description.files import AOTI_PRECISIONS

DEVICES = ("cpu", "gpu")


@dataclass(frozen=True)
class GateFamily:
    """A family of precision-gate entries ("<name>_<precision>" in model.json): the reduced precisions of one way
    of computing the model, measured once at export and answered to by every backend that computes it that way."""

    name: str
    precisions: tuple[str, ...]
    computed_by: str  # "onnx": measured on the export's graph by ONNX Runtime; "checkpoint": by emulation in torch
    rounded: str  # what the reduced precision rounds, for the entry's `computed_by` text
    routing_rounded: bool = False  # the routing products' inputs are rounded too (the fused kernels)


GATE_FAMILIES: dict[str, GateFamily] = {family.name: family for family in (
    GateFamily("onnx", ("int8", "fp16"), "onnx", "the export's ONNX graph"),
    GateFamily("torch", ("fp16", "bf16"), "checkpoint", "convolutions"),
    GateFamily("fused", ("fp16", "bf16"), "checkpoint", "convolutions and routing products' inputs",
               routing_rounded=True),
)}
GATE_VARIANTS = tuple(f"{family.name}_{precision}" for family in GATE_FAMILIES.values()
                      for precision in family.precisions)


@dataclass(frozen=True)
class BackendRow:
    name: str
    module: str  # the serving module of its class, imported only when one is made
    class_name: str
    platform: str  # Triton's model configuration `platform`
    reads: str  # what it runs from the export: "onnx" (model[.int8|.fp16].onnx), "checkpoint", "plan", "aoti"
    precisions: tuple[str, ...]  # every precision it serves: all of them on a GPU, where it serves on one
    cpu_precisions: tuple[str, ...]  # on the CPU; none: a GPU only
    gate_family: str  # a GATE_FAMILIES name: its reduced precisions answer to "<gate_family>_<precision>"
    # the precisions `--backend auto` loads, self-checks and times on each device (where the row can run: see
    # serving/engine/backends/__init__.py); none: served only when asked for by name
    auto_gpu: tuple[str, ...] = ()
    auto_cpu: tuple[str, ...] = ()
    requires: str | None = None  # a module outside the base install it needs, and the extra that installs it
    extra: str | None = None
    routing_engine: str | None = None  # raced only where model.json's `routing.gpu_engine` names this engine
    # Serving on a GPU, it takes images from CUDA regions: the server then offers Triton's cuda_shared_memory
    # extension. Not ONNX Runtime's GPU providers: a server of them need not hold torch's CUDA, which opens the
    # regions (serving/engine/cuda_ipc.py).
    cuda_shared_memory: bool = True
    # Serving on a GPU, it runs a batch already there (cuda_ipc.DeviceInput's run_device) instead of one copied to
    # host memory and back
    device_input: bool = False
    on_gpu: bool = True  # serves on a GPU at all

    @property
    def gpu_precisions(self) -> tuple[str, ...]:
        return self.precisions if self.on_gpu else ()

    def serves(self, precision: str, device: str) -> bool:
        return precision in (self.gpu_precisions if device == "gpu" else self.cpu_precisions)


BACKEND_TABLE: dict[str, BackendRow] = {row.name: row for row in (
    # the default: the export's graphs, CPU everywhere, GPU providers where onnxruntime-gpu is installed
    BackendRow("onnxruntime", "capsnet.serving.engine.backends.onnxruntime_backend", "OnnxRuntimeBackend",
               "onnxruntime_onnx", "onnx", ("fp32", "fp16", "int8"), ("fp32", "fp16", "int8"), "onnx",
               auto_gpu=("fp32", "fp16", "int8"), auto_cpu=("fp32", "int8"), cuda_shared_memory=False),
    # the same graphs compiled by Intel's runtime for the CPU: faster than ONNX Runtime on some CPU kinds and
    # precisions, slower on others, hence raced (docs/serving.md)
    BackendRow("openvino", "capsnet.serving.engine.backends.openvino_backend", "OpenVinoBackend", "openvino", "onnx",
               ("fp32", "int8"), ("fp32", "int8"), "onnx", auto_cpu=("fp32", "int8"), requires="openvino",
               extra="openvino", cuda_shared_memory=False, on_gpu=False),
    # chosen before any race wherever its plan and GPU are present (serving/engine/backends/__init__.py)
    BackendRow("tensorrt", "capsnet.serving.engine.backends.tensorrt_backend", "TensorRTBackend", "tensorrt_plan",
               "plan", ("fp32", "fp16", "int8"), (), "onnx", requires="tensorrt", extra="gpu"),
    # eager PyTorch with a CUDA graph per batch bucket: "pytorch", not TorchScript ("pytorch_libtorch"); bf16 on a
    # CPU with native bf16 only (serving/engine/backends/runner_backend.py)
    BackendRow("torch", "capsnet.serving.engine.backends.torch_backend", "TorchBackend", "pytorch", "checkpoint",
               ("fp32", "fp16", "bf16"), ("fp32", "bf16"), "torch", auto_gpu=("fp32", "fp16", "bf16"),
               device_input=True),
    # the packages export compiles for each device. Not raced: one loaded in the process that had captured the
    # torch backend's CUDA graphs died of a segmentation fault on an H100 (torch 2.11)
    BackendRow("aoti", "capsnet.serving.engine.backends.aoti_backend", "AotiBackend", "pytorch_aoti", "aoti",
               AOTI_PRECISIONS["cuda"], AOTI_PRECISIONS["cpu"], "torch", device_input=True),
    # cuDNN convolutions and the fused routing kernels (capsnet/runtime/fused_routing.py), CUDA graphs per bucket;
    # on the CPU its kernels run only in Triton's interpreter (TRITON_INTERPRET=1), for tests. Raced where
    # model.json says the model's routing runs in them.
    BackendRow("fused", "capsnet.serving.engine.backends.fused_backend", "FusedBackend", "pytorch", "checkpoint",
               ("fp32", "fp16", "bf16"), ("fp32", "bf16"), "fused", auto_gpu=("fp32", "fp16", "bf16"),
               requires="triton", extra="gpu", routing_engine="fused", device_input=True),
)}

# The decoder served beside a model (model.json's `decoder`) runs on this row at this precision, on the CPU: a few
# small matrix products, which no accelerator or reduced precision speeds up enough to pay for a second engine.
DECODER_BACKEND = "onnxruntime"
DECODER_PRECISION = "fp32"


def auto_candidates(device: str, precision: str = "auto") -> list[tuple[str, str]]:
    """(row, precision) pairs that `--backend auto` races on `device` ("cpu" or "gpu"), in the table's order (a tie
    goes to the earlier); `precision` other than "auto" keeps those of that precision."""
    return [(row.name, candidate) for row in BACKEND_TABLE.values()
            for candidate in (row.auto_gpu if device == "gpu" else row.auto_cpu)
            if precision in ("auto", candidate)]


def gate_variant(backend: str, precision: str) -> str | None:
    """The gate entry that a backend serving `precision` answers to (None: fp32, held to the FP32 parity)."""
    if precision == "fp32":
        return None
    return f"{BACKEND_TABLE[backend].gate_family}_{precision}"
