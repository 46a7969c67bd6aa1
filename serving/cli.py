"""`capsnet serve`. grpc, onnxruntime and torch are imported inside the handler; the client commands
(`capsnet predict`, `capsnet health`) are capsnet/client/cli.py's."""

from __future__ import annotations

import argparse
import dataclasses


def register(subparsers) -> None:
    from capsnet.serving.config import (BACKENDS, DEFAULT_POLL_S, ENV_VARS, LOG_FORMATS, MODEL_CONTROLS, PRECISIONS,
                                        ServerConfig)

    defaults = ServerConfig.defaults()
    serve = subparsers.add_parser("serve", help="serve exported models over gRPC (CapsNet API + KServe v2) and REST "
                                                 "(KServe v2)",
                                  description="Serve an export directory, or a repository of models and versions, "
                                              "over gRPC: the CapsNet API, KServe v2, health and reflection on one "
                                              "port; KServe v2 over HTTP/REST on a second; Prometheus /metrics on a "
                                              "third.")
    what = serve.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", dest="model_dir", metavar="DIR", help="export directory (capsnet export): one model")
    what.add_argument("--model-repository", metavar="DIR",
                      help="a model repository: DIR/<model>/<version>/ export folders, versions numbered 1, 2, ...; "
                           "several models, each with its version policy (docs/serving.md)")
    serve.add_argument("--version-policy", metavar="POLICY",
                       help="versions a repository's model serves unless its config.json says: latest:N, "
                            f"specific:V1,V2,... or all (default {defaults['version_policy']}: the newest)")
    serve.add_argument("--model-control", choices=MODEL_CONTROLS,
                       help="who may change the models while serving: none (default: as loaded at start), explicit "
                            "(the KServe repository API's load and unload, and SIGHUP), poll (a rescan every "
                            "--poll-seconds, and SIGHUP); explicit and poll need --model-repository")
    serve.add_argument("--poll-seconds", type=float, metavar="SECONDS",
                       help=f"--model-control poll: seconds between rescans of the repository (default "
                            f"{DEFAULT_POLL_S:g})")
    serve.add_argument("--log-format", choices=LOG_FORMATS,
                       help="text (default), or json: every log line a JSON object, and one access line per request "
                            "(time, API, model, version, status, duration, batch size, trace id, peer)")
    serve.add_argument("--otlp-endpoint", metavar="URL",
                       help="export OpenTelemetry traces of every request over OTLP/gRPC to URL, e.g. "
                            "http://127.0.0.1:4317 (also on when OTEL_EXPORTER_OTLP_ENDPOINT is set; needs the otel "
                            "extra: pip install 'capsnet-serve[otel]')")
    serve.add_argument("--host", help=f"address to bind (default {defaults['host']}, loopback only; 0.0.0.0 for every "
                                      f"interface; env {ENV_VARS['host']})")
    serve.add_argument("--grpc-port", type=int, metavar="PORT",
                       help=f"gRPC port (default {defaults['grpc_port']}; 0: any free port; env "
                            f"{ENV_VARS['grpc_port']})")
    serve.add_argument("--http-port", type=int, metavar="PORT",
                       help=f"KServe v2 HTTP/REST port (default {defaults['http_port']}; 0: any free port; env "
                            f"{ENV_VARS['http_port']})")
    serve.add_argument("--no-http", dest="http", action="store_false", default=None,
                       help="serve no HTTP/REST: gRPC and /metrics only")
    serve.add_argument("--no-ui", dest="ui", action="store_false", default=None,
                       help="serve no page at / of the REST port (it draws or takes images and shows each class's "
                            "capsule length, through the REST infer endpoint)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help=f"Prometheus /metrics port (default {defaults['metrics_port']}; env "
                            f"{ENV_VARS['metrics_port']})")
    serve.add_argument("--backend", choices=BACKENDS,
                       help="inference backend (default auto: a TensorRT plan on its GPU, else on a GPU host the "
                            "fastest GPU backend that passes its self-check, else ONNX Runtime on the CPU)")
    serve.add_argument("--precision", choices=PRECISIONS,
                       help="model precision (default auto: INT8 where the export has it, it passes its self-check "
                            "and is faster on this CPU, else FP32; tensorrt: the plan's; on a GPU the fastest that "
                            "passes); int8 and onnxruntime fp16 need those exports; torch and aoti: fp16/bf16 on a "
                            "GPU, bf16 also on a CPU with native bf16 (AVX512_BF16 or AMX)")
    serve.add_argument("--gpu", type=int, metavar="N",
                       help="CUDA device to serve on: torch, aoti and fused run there (default: the CPU); tensorrt, "
                            "ONNX Runtime's GPU providers and auto use it (default: 0)")
    serve.add_argument("--max-batch-size", type=int, metavar="N",
                       help=f"images per backend run and per request (default {defaults['max_batch_size']})")
    serve.add_argument("--max-queue-delay-us", type=int, metavar="US",
                       help="how long a request may wait for batch-mates, in µs "
                            f"(default {defaults['max_queue_delay_us']})")
    serve.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                       help="serve without first running each batch size dynamic batching makes most (powers of two "
                            "up to --max-batch-size): a quicker start, slower first batches of each size")
    serve.add_argument("--max-queue-size", type=int, metavar="N",
                       help="requests that may wait; more get UNAVAILABLE 'queue full' "
                            f"(default {defaults['max_queue_size']})")
    serve.add_argument("--max-pending-rpcs", type=int, metavar="N",
                       help="calls gRPC may hold before the server takes them; more are cut by gRPC with CANCELLED "
                            f"(default {defaults['max_pending_rpcs']}; at least --max-queue-size)")
    serve.add_argument("--threads", type=int, metavar="N",
                       help="backend intra-op threads (default 0: one fewer than the CPU cores available, at least 1)")
    serve.add_argument("--max-message-bytes", type=int, metavar="BYTES",
                       help="largest request or response over gRPC, and request body over HTTP, bytes (default: a "
                            "full batch of the largest images the model accepts, about 1.7 MB for 28x28 grey and "
                            "batch 32)")
    serve.add_argument("--max-image-scale", type=int, metavar="K",
                       help="encoded images may be at most K times the model's height and width "
                            f"(default {defaults['max_image_scale']})")
    serve.add_argument("--no-allow-client-shm", dest="allow_client_shm", action="store_false", default=None,
                       help="refuse every shared-memory register call (Triton's --allow-client-shm=false); by default "
                            "clients on this host may pass tensors in system, and on a GPU CUDA, shared memory")
    serve.add_argument("--max-shm-regions", type=int, metavar="N",
                       help=f"shared-memory regions registered at once (default {defaults['max_shm_regions']})")
    serve.add_argument("--max-shm-bytes", type=int, metavar="BYTES",
                       help=f"bytes of all shared-memory regions registered (default {defaults['max_shm_bytes']})")
    serve.add_argument("--tls-cert", metavar="PEM", help="server certificate (enables TLS; with --tls-key)")
    serve.add_argument("--tls-key", metavar="PEM", help="server private key")
    serve.add_argument("--tls-client-ca", metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    serve.add_argument("--drain-window", dest="drain_window_s", type=float, metavar="SECONDS",
                       help="on SIGTERM, seconds health says NOT_SERVING while requests are still served, so load "
                            f"balancers stop sending first (default {defaults['drain_window_s']:g})")
    serve.add_argument("--grace-period", dest="grace_period_s", type=float, metavar="SECONDS",
                       help="seconds requests in flight get to finish after the drain window "
                            f"(default {defaults['grace_period_s']:g})")
    serve.add_argument("--workers", type=int, metavar="N",
                       help="front-end processes sharing the gRPC and REST ports, beside one engine process that "
                            "batches for all of them (default: one per 2 cores when neither --model-control nor "
                            "clients' shared memory is on, else 1; more than 1 needs --no-allow-client-shm)")
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from capsnet.serving.config import ServerConfig
    from capsnet.serving.observability.observe import use_json_logs
    from capsnet.serving.processes.supervisor import front_ends, supervise
    from capsnet.serving.transports.server import serve

    # every setting has a flag of its name (None: not given, so the environment's or the default)
    flags = {setting.name: getattr(args, setting.name) for setting in dataclasses.fields(ServerConfig)}
    config = ServerConfig.from_sources(flags)
    if config.log_format == "json":
        use_json_logs()
    if (workers := front_ends(config)) > 1:
        return asyncio.run(supervise(config, workers))
    return asyncio.run(serve(config))
