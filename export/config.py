"""Every export option in dataclasses, checked on construction; no heavy imports, so the CLI can
show the defaults in `capsnet export --help` without loading onnx or torch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from capsnet.errors import CapsNetError

# The PyTorch (dynamo) exporter writes opset 18 at the lowest; 24 is the newest that both
# ONNX Runtime and TensorRT's ONNX parser (10.15: opsets 9-24) read.
MIN_OPSET, MAX_OPSET = 18, 24
DEFAULT_OPSET = 18
# ONNX Runtime (1.32) cannot load our QDQ graph at opset 21+: its optimiser's QDQ propagation inserts a
# QuantizeLinear whose output_dtype contradicts its zero point (microsoft/onnxruntime#25526's error).
MAX_INT8_OPSET = 20
PRECISIONS = ("fp32", "fp16", "int8")
AOTI_DEVICES = ("cpu", "cuda")
AOTI_CUDA_PRECISIONS = ("fp32", "fp16", "bf16")
TRITON_MAX_BATCH_SIZE = 2**31 - 1  # model_config.proto's max_batch_size is an int32


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise CapsNetError(
            f"unsupported opset {opset}: capsnet export writes ONNX opset {MIN_OPSET} to {MAX_OPSET} "
            f"(the PyTorch exporter starts at {MIN_OPSET})"
        )


def default_timing_cache() -> Path:
    """One TensorRT timing cache per user, reused by every build (TensorRT rejects a foreign GPU's)."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "capsnet" / "tensorrt.timing-cache"


@dataclass(frozen=True)
class EngineConfig:
    precision: str = "fp32"
    min_batch: int = 1
    opt_batch: int = 32
    max_batch: int = 256
    workspace_mib: int = 1024
    timing_cache: Path | None = None  # None: default_timing_cache()
    gpu: int = 0  # CUDA device to build and check the engine on

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise CapsNetError(f"TensorRT precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise CapsNetError(
                "batch sizes must satisfy 1 <= --min-batch <= --opt-batch <= --max-batch, got "
                f"{self.min_batch}/{self.opt_batch}/{self.max_batch}"
            )
        if self.workspace_mib < 1:
            raise CapsNetError(f"--workspace-mib must be at least 1, got {self.workspace_mib}")
        if self.gpu < 0:
            raise CapsNetError(f"--gpu must be a CUDA device index >= 0, got {self.gpu}")

    @property
    def timing_cache_path(self) -> Path:
        return self.timing_cache or default_timing_cache()


@dataclass(frozen=True)
class TritonConfig:
    max_batch_size: int = 256
    preferred_batch_sizes: tuple[int, ...] = (32, 256)
    max_queue_delay_us: int = 100

    def __post_init__(self) -> None:
        if self.max_batch_size > TRITON_MAX_BATCH_SIZE:  # Triton would refuse the config.pbtxt
            raise CapsNetError(f"--max-batch must be at most {TRITON_MAX_BATCH_SIZE} (Triton's max_batch_size is a "
                               f"32-bit integer), got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise CapsNetError(f"--max-queue-delay-us must be >= 0, got {self.max_queue_delay_us}")


@dataclass(frozen=True)
class ExportConfig:
    """Every option of `capsnet export`; the field names are the CLI flags'."""

    reconstruction: bool = False
    int8: bool = False
    fp16: bool = False
    tensorrt: bool = False
    triton_repo: str | Path | None = None
    # real images: test split for parity, INT8 accuracy and the self-check set, train split for calibration;
    # None: the data the checkpoint was trained on
    data: str | None = None
    opset: int = DEFAULT_OPSET
    # accuracy points a reduced precision (INT8, FP16, BF16) may lose on the test split: the precision gate's export
    # half
    max_accuracy_drop: float = 1.0
    calibration_images: int = 200
    tensorrt_precision: str = "fp32"
    min_batch: int = 1
    opt_batch: int | None = None  # None: 32, or --max-batch where that is smaller
    max_batch: int = 256
    workspace_mib: int = 1024
    timing_cache: str | Path | None = None
    gpu: int | None = None  # CUDA device of the TensorRT engine and the CUDA packages; None: 0
    # AOTInductor packages: "cpu", "cuda" or "cpu,cuda" (None: none), CUDA ones in each of aoti_precision
    aoti: str | None = None
    aoti_precision: str = "fp32"
    max_queue_delay_us: int = 100

    def __post_init__(self) -> None:
        if self.triton_repo is not None and not str(self.triton_repo):  # `--triton "$UNSET"` wrote no repository
            raise CapsNetError("--triton needs a directory, got an empty path")
        check_opset(self.opset)
        if not (math.isfinite(self.max_accuracy_drop) and self.max_accuracy_drop >= 0):  # nan turned the gate off
            raise CapsNetError("--max-accuracy-drop must be finite and >= 0 accuracy points, "
                               f"got {self.max_accuracy_drop}")
        if self.aoti is not None:
            unknown = [device for device in self.aoti_devices if device not in AOTI_DEVICES] or (
                [] if self.aoti_devices else ["nothing"])
            if unknown:
                raise CapsNetError(f"--aoti takes {' and/or '.join(AOTI_DEVICES)} (e.g. cpu,cuda), got {self.aoti!r}")
        wrong = [p for p in self.aoti_precisions if p not in AOTI_CUDA_PRECISIONS] or (
            [] if self.aoti_precisions else ["nothing"])
        if wrong:
            raise CapsNetError(f"--aoti-precision takes {', '.join(AOTI_CUDA_PRECISIONS)} (e.g. fp32,bf16), "
                               f"got {self.aoti_precision!r}")

        if self.calibration_images < 1:
            raise CapsNetError(f"--calibration-images must be at least 1, got {self.calibration_images}")
        if self.wants_int8 and self.opset > MAX_INT8_OPSET:
            raise CapsNetError(f"INT8 needs --opset {MAX_INT8_OPSET} or lower: ONNX Runtime cannot load the quantised "
                               f"graph at opset {self.opset}")
        self.engine()  # checks the TensorRT and Triton options even when neither is written
        self.triton()
        if self.tensorrt and self.triton_repo is not None and self.min_batch != 1:
            # Triton's dynamic batcher sends batches from 1 image, which an engine's profile refuses below its minimum
            raise CapsNetError(f"--triton serves the engine batches from 1 image: --min-batch must be 1, got "
                               f"{self.min_batch}")

    def engine(self) -> EngineConfig:
        return EngineConfig(
            precision=self.tensorrt_precision,
            min_batch=self.min_batch,
            opt_batch=self.optimal_batch,
            max_batch=self.max_batch,
            workspace_mib=self.workspace_mib,
            timing_cache=Path(self.timing_cache) if self.timing_cache else None,
            gpu=self.gpu or 0,
        )

    def triton(self) -> TritonConfig:
        return TritonConfig(
            max_batch_size=self.max_batch,
            preferred_batch_sizes=(self.optimal_batch, self.max_batch),
            max_queue_delay_us=self.max_queue_delay_us,
        )

    @property
    def optimal_batch(self) -> int:
        return self.opt_batch if self.opt_batch is not None else min(EngineConfig.opt_batch, self.max_batch)

    @property
    def aoti_devices(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in (self.aoti or "").split(",") if part.strip())

    @property
    def aoti_precisions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(part.strip() for part in self.aoti_precision.split(",") if part.strip()))

    def aoti_targets(self) -> list[tuple[str, str]]:
        """(device, precision) of every AOTInductor package to compile: CPU fp32, CUDA in each --aoti-precision."""
        return [(device, precision) for device in self.aoti_devices
                for precision in (("fp32",) if device == "cpu" else self.aoti_precisions)]

    @property
    def wants_int8(self) -> bool:
        return self.int8 or (self.tensorrt and self.tensorrt_precision == "int8")

    @property
    def wants_fp16(self) -> bool:
        return self.fp16 or (self.tensorrt and self.tensorrt_precision == "fp16")
