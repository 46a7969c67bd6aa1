"""`capsnet bench`: every engine (each backend at each precision) side by side and end-to-end gRPC in one run, with
the analysis (the CPU's limit, ONNX Runtime's profile, the public reference, the targets and plots) where the bench
extra is installed."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path
from typing import Any

from capsnet.errors import CapsNetError
from capsnet.runtime.cpu import MAX_THREADS

# (full run, --quick) for each setting the user did not give
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "batch_sizes": ((1, 8, 32, 128), (1, 8)),
    "concurrency": ((1, 4, 16, 64), (1, 16)),
    "seconds": (6.0, 0.3),
    "rounds": (6, 1),
    "grpc_seconds": (5.0, 0.5),
    "peak_seconds": (2.0, 0.2),
    "accuracy_images": (0, 200),
    "profile_runs": (10, 2),
}
# Largest batch size and concurrency: the export and the timing buffers scale with them, and a CapsNet batch of
# 1024 already needs about 1 GB for its routing; far larger values ended in a NumPy out-of-memory traceback.
MAX_BATCH = 1024


def register(subparsers) -> None:
    from capsnet.bench.engines import engine_names
    from capsnet.bench.results import PUBLIC

    names = (PUBLIC, *engine_names())
    parser = subparsers.add_parser(
        "bench", help="benchmark the engines, the CPU's limit and gRPC serving",
        description="Measure every engine (each backend at each precision it serves) in-process, interleaved and "
                    "side by side, and `capsnet serve` end to end over gRPC; "
                    "write results.json and README.md. With the bench extra (pip install 'capsnet-serve[bench]') "
                    "also the machine's fp32 peak and the model's FLOPs (its ceiling), ONNX Runtime's profile, the "
                    "public PyTorch CapsNet as a backend, the targets and PNG plots.")
    parser.add_argument("model", type=Path, metavar="MODEL",
                        help="a checkpoint (exported first, with INT8) or an export directory (capsnet export)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR",
                        help="where results.json, README.md and the plots go (default bench-results)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (batch 1 and 8, concurrency 1 and 16, fractions of a second per point)")
    parser.add_argument("--backends", type=_names(names), metavar="A,B",
                        help="engines to time in-process, each a backend at one precision as the server names them "
                             f"(BACKEND:PRECISION), or {PUBLIC}, the public PyTorch CapsNet's formulation; of "
                             f"{','.join(names)}. Default: {PUBLIC} and every backend at each precision it serves on "
                             "the CPU (with a GPU, also those that serve on a GPU only); those that cannot run here "
                             "are skipped with the reason")
    parser.add_argument("--batch-sizes", type=_positive_ints, metavar="N,N",
                        help=f"in-process batch sizes, at most {MAX_BATCH} (default {_show('batch_sizes')})")
    parser.add_argument("--concurrency", type=_positive_ints, metavar="N,N",
                        help=f"concurrent gRPC requests, at most {MAX_BATCH} (default {_show('concurrency')})")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false", help="skip the end-to-end gRPC benchmark")
    parser.add_argument("--threads", type=int, default=0,
                        help="compute threads per engine (default 0: one per CPU core available)")
    parser.add_argument("--seconds", type=float,
                        help=f"timed seconds per in-process point (default {_show('seconds')})")
    parser.add_argument("--rounds", type=int,
                        help=f"interleaved rounds the in-process seconds are split into (default {_show('rounds')})")
    parser.add_argument("--grpc-seconds", type=float,
                        help=f"timed seconds per gRPC point (default {_show('grpc_seconds')})")
    parser.add_argument("--peak-seconds", type=float,
                        help="timed seconds per peak microbenchmark, with the bench extra "
                             f"(default {_show('peak_seconds')})")
    parser.add_argument("--accuracy-images", type=int,
                        help="evaluation images for each engine's accuracy "
                             f"(default {_show('accuracy_images')}; 0: all)")
    parser.add_argument("--profile-runs", type=int,
                        help="runs profiled by ONNX Runtime's profiler, with the bench extra "
                             f"(default {_show('profile_runs')})")
    parser.add_argument("--data", default="embedded",
                        help="images for timing and accuracy: embedded or an IDX directory")
    parser.set_defaults(handler=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from capsnet.bench.analysis import missing
    from capsnet.bench.machine import cores
    from capsnet.bench.report_files import check_out_dir, verdict
    from capsnet.bench.results import portable_command
    from capsnet.bench.run import Analysis, BenchOptions, run_bench

    settings = {name: getattr(args, name) if getattr(args, name) is not None else values[args.quick]
                for name, values in DEFAULTS.items()}
    for name in ("seconds", "grpc_seconds", "peak_seconds", "rounds", "profile_runs"):
        if not (math.isfinite(settings[name]) and settings[name] > 0):  # inf ran forever; nan skipped the timing
            raise CapsNetError(f"--{name.replace('_', '-')} must be finite and > 0, got {settings[name]}")
    if settings["accuracy_images"] < 0 or args.threads < 0:
        raise CapsNetError("--accuracy-images and --threads must be >= 0")
    if args.threads > MAX_THREADS:
        raise CapsNetError(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
    check_out_dir(args.out)
    options = BenchOptions(
        model=args.model,
        out=args.out,
        backends=args.backends or default_engines(),
        threads=args.threads or cores(),
        grpc=args.grpc,
        quick=args.quick,
        data=args.data,
        command=portable_command(["capsnet", *sys.argv[1:]], Path.cwd()),
        **settings,
    )
    if why := missing():
        print(f"capsnet bench: measuring throughput and latency only: {why}", file=sys.stderr)
        analysis = Analysis(why)
    else:
        from capsnet.bench.analysis.hooks import BenchAnalysis

        analysis = BenchAnalysis(options)
    # SIGTERM (`timeout`, a job scheduler, `kill`) unwinds like Ctrl-C: the server and the workers are stopped and
    # the temporary export removed; the default action would end this process alone and leave them running.
    # Ctrl-C raises KeyboardInterrupt wherever it lands: Python's own handler would let asyncio.run() turn it into
    # a cancellation that the gRPC load generator's calls absorb, and the benchmark went on as if not interrupted.
    previous = {signum: signal.signal(signum, handler)
                for signum, handler in ((signal.SIGTERM, _terminate), (signal.SIGINT, _interrupt))}
    try:
        results = run_bench(options, analysis)
    except Terminated:
        print(f"capsnet bench: terminated by SIGTERM; {options.out} was left as it was", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"capsnet bench: wrote {options.out}/README.md and results.json")
    for target in results["targets"]:
        print(f"  [{verdict(target, results['quick'])}] {target['target']}: {target['measured']}")
    return 0


def default_engines() -> tuple[str, ...]:
    """The public reference and every served engine this host runs (capsnet.bench.engines.served_here)."""
    from capsnet.bench.engines import served_here
    from capsnet.bench.results import PUBLIC
    from capsnet.serving.engine.backends import gpu_host

    return (PUBLIC, *served_here(gpu_host()))


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised where the program is, so every `finally` and `with` on the way out runs."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _show(name: str) -> str:
    full, quick = DEFAULTS[name]
    as_text = (lambda v: ",".join(map(str, v))) if isinstance(full, tuple) else str
    return f"{as_text(full)}; --quick {as_text(quick)}"


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1 or max(values) > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"expected integers from 1 to {MAX_BATCH}, got {text!r}")
    return values


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown backend {', '.join(unknown) or '(none)'}; "
                                             f"choose from {', '.join(allowed)}")
        return names

    return parse
