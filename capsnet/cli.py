"""The `capsnet` command: one entry point, one subcommand per stage of the pipeline.

Each stage owns its subcommands in its own `cli` module, which registers them with
`register(subparsers)` and keeps heavy imports (torch, onnxruntime, grpc) inside the
handlers, so `capsnet --help` and `capsnet predict` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from capsnet import __version__
from capsnet.errors import CapsNetError

# Modules that register subcommands, in pipeline order.
_COMMAND_MODULES = (
    "capsnet.training.cli",  # train, eval
    "capsnet.training.visualize",  # visualize
    "capsnet.training.robustness",  # robustness
    "capsnet.export.cli",  # export
    "capsnet.serving.cli",  # serve, predict, health
    "capsnet.bench.cli",  # bench
)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, like every other user error, and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="capsnet",
        description="Capsule Networks: train, export to ONNX/TensorRT, serve over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"capsnet-serve {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except CapsNetError as err:
        print(f"capsnet {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(args.command)
    except BrokenPipeError:
        # The reader went away (`capsnet predict --json | head`): stop quietly as Unix tools do, with stdout
        # pointed at /dev/null so the flush at exit cannot raise again; 141 is a shell's SIGPIPE status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # after BrokenPipeError, an Exception too
        # Ctrl-C inside a library can come back wrapped: torch's ONNX exporter re-raises it as its own error.
        if _caused_by_interrupt(err):
            return _interrupted(args.command)
        raise


def _interrupted(command: str) -> int:
    print(f"capsnet {command}: interrupted", file=sys.stderr)
    return 130


def _caused_by_interrupt(err: BaseException | None) -> bool:
    """Whether a KeyboardInterrupt is in err's __cause__/__context__ chain (each exception visited once)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False
