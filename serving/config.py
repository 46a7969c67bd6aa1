"""Every setting of `capsnet serve` in one dataclass, filled from flags, then environment, then defaults."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from capsnet.errors import CapsNetError
from capsnet.model_description.backend_table import BACKEND_TABLE
from capsnet.serving.version_policy import VersionPolicy

# --backend: a row of the backend table, or auto
BACKENDS = ("auto", *BACKEND_TABLE)

# Who may change the models served: nobody (as loaded at start), clients of the repository extension, or a rescan of
# the repository every poll interval (Triton's --model-control-mode none, explicit, poll). SIGHUP rescans in the last
# two.
MODEL_CONTROLS = ("none", "explicit", "poll")
LOG_FORMATS = ("text", "json")
# Triton's --repository-poll-secs default: a new version is noticed within this long, and a scan (a few stat calls
# and a small read per version) costs nothing at that rate.
DEFAULT_POLL_S = 15.0
PRECISIONS = ("auto", "fp32", "fp16", "int8", "bf16")  # bf16: torch and aoti (on the CPU, torch with native bf16)

# gRPC takes its size and count options as C ints: larger values raise OverflowError inside grpcio.
GRPC_INT_MAX = 2 ** 31 - 1
# The longest --drain-window: ample for any load balancer to notice NOT_SERVING (Kubernetes allows the
# whole shutdown 30 s by default), and short enough that a stopped server does stop.
MAX_DRAIN_WINDOW_S = 300.0

# Settings an operator may also give as environment variables (container images, Kubernetes).
ENV_VARS = {"host": "CAPSNET_HOST", "grpc_port": "CAPSNET_GRPC_PORT", "http_port": "CAPSNET_HTTP_PORT",
            "metrics_port": "CAPSNET_METRICS_PORT"}


@dataclass(frozen=True)
class ServerConfig:
    # What to serve: one export folder (--model), or a repository of models and versions (--model-repository).
    model_dir: Path | None = None
    model_repository: Path | None = None
    # The versions each model of a repository serves, unless its config.json says: the newest, as Triton's default.
    version_policy: str = "latest:1"
    # none: a server's models never change while it runs (rollouts replace servers, as on KServe); explicit or poll
    # switch on changes in place (MODEL_CONTROLS).
    model_control: str = "none"
    poll_seconds: float | None = None  # --model-control poll: seconds between rescans (None: DEFAULT_POLL_S)
    log_format: str = "text"  # json: every log line as JSON, and one access line per request
    # traces over OTLP/gRPC there (serving/observability/tracing.py); None: the OTEL_* variables'
    otlp_endpoint: str | None = None
    # Loopback by default, so a server started for a try-out is not exposed; 0.0.0.0 only when asked.
    host: str = "127.0.0.1"
    grpc_port: int = 8001  # Triton's ports, so KServe tooling finds us where it looks
    http_port: int = 8000  # KServe v2 REST
    metrics_port: int = 8002
    http: bool = True  # whether to serve KServe v2 REST at all
    # A page at / of the REST port to draw or drop images and see each class's capsule length: a static file that
    # only calls the infer endpoint any client calls, so it opens nothing new. Off (--no-ui) for a port that
    # should answer the protocol alone.
    ui: bool = True
    backend: str = "auto"
    # auto: INT8 where exported, self-checked and faster on this CPU, else FP32 (TensorRT: the plan's)
    precision: str = "auto"
    # CUDA device, as CUDA_VISIBLE_DEVICES numbers them. None: torch and aoti run on the CPU; tensorrt, ONNX Runtime's
    # GPU providers and auto's GPU candidates use device 0, so that a GPU host serves on its GPU without the flag
    gpu: int | None = None
    # dynamic batching
    max_batch_size: int = 32  # images per backend run, and per request
    # How long the oldest request waits for batch-mates. 0, as Triton: batches still form from the
    # requests that queue while the previous batch computes, and a lone request never waits.
    max_queue_delay_us: int = 0
    max_queue_size: int = 256  # requests waiting; beyond it: UNAVAILABLE "queue full"
    # Run the batch sizes dynamic batching makes most before a version serves, so that its first requests do not pay
    # for allocations and kernel choices. Off (--no-warmup, as a Triton model without model_warmup) where a quick
    # start matters more: a slow backend (the fused kernels in Triton's CPU interpreter), a development loop. The
    # self-check still runs the model before it serves.
    warmup: bool = True
    # Calls gRPC holds before the server's event loop takes them (its default, 1000 to 3000, cuts calls of a
    # burst with CANCELLED before the server sees them). Far above max_queue_size, so that under a burst the
    # batcher's "queue full" answers the excess, which the server counts.
    max_pending_rpcs: int = 4096
    threads: int = 0  # backend intra-op threads; 0: one fewer than the CPU cores available (at least 1)
    # Largest request or response. None: derived from the model, a full batch of its largest accepted
    # images (serving/transports/server.py: message_limit), so a request cannot make the server hold much more.
    max_message_bytes: int | None = None
    # Encoded images may be at most this many times the model's height and width (refused from the header).
    max_image_scale: int = 8
    # Triton's shared-memory extensions (serving/protocol/shared_memory.py): clients on this host may register POSIX
    # shared-memory objects (and, where a GPU serves, CUDA buffers) for tensors to be read from and written to, within
    # these limits; off (--no-allow-client-shm, Triton's --allow-client-shm=false), every register call is refused.
    allow_client_shm: bool = True
    max_shm_regions: int = 64
    max_shm_bytes: int = 4 * 2 ** 30  # registered bytes of all regions together
    # TLS: server certificate and key; with tls_client_ca, clients must present a certificate it signed.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # On SIGTERM: health turns NOT_SERVING and requests are still served for drain_window_s, so load
    # balancers stop sending first; then new requests get UNAVAILABLE and in-flight ones grace_period_s.
    drain_window_s: float = 1.0
    grace_period_s: float = 10.0
    # Front-end processes (serving/processes/supervisor.py): None, the host's default (one per 2 cores where the server
    # needs neither model control nor clients' shared memory, else 1); 1 is a single process, as without the flag.
    workers: int | None = None

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.model_repository is None):
            raise CapsNetError("give one of --model DIR (one export folder) or --model-repository DIR (models and "
                               "versions)")
        if self.model_control not in MODEL_CONTROLS:
            raise CapsNetError(f"--model-control must be one of {', '.join(MODEL_CONTROLS)}, got "
                               f"{self.model_control!r}")
        if self.model_control != "none" and self.model_repository is None:
            raise CapsNetError(f"--model-control {self.model_control} changes the models of a repository: serve one "
                               "with --model-repository DIR (--model serves one export folder, loaded at start)")
        if self.poll_seconds is not None and self.model_control != "poll":
            raise CapsNetError("--poll-seconds sets how often --model-control poll rescans the repository: add "
                               "--model-control poll")
        if self.poll_seconds is not None and not (math.isfinite(self.poll_seconds) and self.poll_seconds > 0):
            raise CapsNetError(f"--poll-seconds must be > 0, got {self.poll_seconds}")
        if self.log_format not in LOG_FORMATS:
            raise CapsNetError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        VersionPolicy.parse(self.version_policy)
        if self.backend not in BACKENDS:
            raise CapsNetError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise CapsNetError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        runs = [kind.name for kind in BACKEND_TABLE.values() if self.precision in kind.precisions]
        if self.precision == "bf16" and self.backend not in runs:
            raise CapsNetError("--precision bf16 runs the checkpoint's convolutions in bf16 on the "
                               f"{either(runs)} backend: add --backend {either(runs)}")
        if self.precision == "int8" and self.backend not in ("auto", *runs):
            raise CapsNetError(f"--precision int8 is an ONNX model: the {self.backend} backend runs "
                               f"{either(BACKEND_TABLE[self.backend].precisions)} (int8: --backend {either(runs)})")
        for name in ("grpc_port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise CapsNetError(f"{name.replace('_', '-')} must be in 0..65535 (0: any free port), got "
                                   f"{getattr(self, name)}")
        for name in ("max_batch_size", "max_queue_size", "max_pending_rpcs", "max_message_bytes", "max_image_scale",
                     "max_shm_regions", "max_shm_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise CapsNetError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_pending_rpcs", "max_message_bytes"):  # given to gRPC as they are
            if getattr(self, name) is not None and getattr(self, name) > GRPC_INT_MAX:
                raise CapsNetError(f"--{name.replace('_', '-')} must be <= {GRPC_INT_MAX} (gRPC's limit), "
                                   f"got {getattr(self, name)}")
        if self.max_pending_rpcs < self.max_queue_size:
            raise CapsNetError(f"--max-pending-rpcs ({self.max_pending_rpcs}) must be >= --max-queue-size "
                               f"({self.max_queue_size}), so that gRPC does not cut calls the queue would take")
        for name in ("max_queue_delay_us", "threads", "drain_window_s", "grace_period_s", "gpu"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:  # `not >=`: NaN fails it too
                raise CapsNetError(f"--{name.removesuffix('_s').replace('_', '-')} must be >= 0, got "
                                   f"{getattr(self, name)}")
        if not math.isfinite(self.grace_period_s):
            raise CapsNetError(f"--grace-period must be a number of seconds, got {self.grace_period_s}")
        if self.drain_window_s > MAX_DRAIN_WINDOW_S:
            raise CapsNetError(f"--drain-window must be <= {MAX_DRAIN_WINDOW_S:g} seconds, got {self.drain_window_s:g}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise CapsNetError("--tls-cert and --tls-key go together")
        if self.workers is not None and self.workers < 1:
            raise CapsNetError(f"--workers must be >= 1, got {self.workers}")
        if self.workers is not None and self.workers > 1:
            if self.model_control != "none":
                raise CapsNetError(f"--model-control {self.model_control} is served by one process: with --workers "
                                   f"{self.workers} the models are the engine's as loaded at start (leave out "
                                   "--model-control, or serve with --workers 1)")
            if self.allow_client_shm:
                raise CapsNetError(f"clients' shared memory is served by one process: with --workers {self.workers} "
                                   "add --no-allow-client-shm (a region registered on one front end would be unknown "
                                   "to the others), or serve with --workers 1")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise CapsNetError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def poll_interval_s(self) -> float:
        return self.poll_seconds or DEFAULT_POLL_S

    @property
    def gpu_or_first(self) -> int:
        """The CUDA device of the backends that use one whether or not --gpu is given."""
        return self.gpu or 0

    @property
    def cores(self) -> int:
        """The CPU cores this process may use (its affinity mask)."""
        return len(os.sched_getaffinity(0))

    @property
    def intra_op_threads(self) -> int:
        # The event loop receives, checks and answers requests while a batch runs, and makes lone batch-1 runs
        # itself: a core of its own keeps intra-op threads from taking turns with it (on 2 cores, one thread costs
        # less CPU per image at every batch size and no throughput; docs/serving.md, "Intra-op threads"). A model
        # whose runs are long gets that core back once loaded (serving/engine/backends/__init__.py, every_core).
        return self.threads or max(1, self.cores - 1)

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in fields(cls) if f.name not in ("model_dir", "model_repository")}

    @classmethod
    def from_sources(cls, flags: dict, env: Mapping[str, str] | None = None) -> "ServerConfig":
        """Flags (None: not given) win over the environment variables of ENV_VARS, which win over defaults."""
        env = os.environ if env is None else env
        values = {name: value for name, value in flags.items() if value is not None}
        for name, var in ENV_VARS.items():
            if name not in values and env.get(var):
                raw = env[var]
                try:
                    values[name] = raw if name == "host" else int(raw)
                except ValueError:
                    raise CapsNetError(f"{var} must be an integer, got {raw!r}") from None
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise CapsNetError(f"unknown server settings: {', '.join(unknown)}")
        paths = {"model_dir", "model_repository", "tls_cert", "tls_key", "tls_client_ca"}
        settings: dict[str, Any] = {name: Path(value) if name in paths else value for name, value in values.items()}
        return cls(**settings)


def either(names) -> str:
    """"a", "a or b", "a, b or c"."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last
