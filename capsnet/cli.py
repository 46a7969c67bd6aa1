"""The `capsnet` command: one entry point, one subcommand per stage of the pipeline.

Each stage owns its subcommands in its own `cli` module, which registers them with
`register(subparsers)` and keeps heavy imports (torch, onnxruntime, grpc) inside the
handlers, so `capsnet --help` and `capsnet predict` stay fast. A command names its own
module only: `capsnet serve` imports serving, never training or export (whose code a
serving image need not carry, and which pyproject.toml's import-linter contracts keep
serving from importing).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from capsnet import __version__
from capsnet.errors import CapsNetError

# Each subcommand and the module that registers it, in pipeline order.
_COMMANDS = {
    "train": "capsnet.training.cli",
    "eval": "capsnet.training.cli",
    "visualize": "capsnet.training.visualize",
    "robustness": "capsnet.training.robustness",
    "export": "capsnet.export.cli",
    "serve": "capsnet.serving.cli",
    "predict": "capsnet.client.cli",
    "health": "capsnet.client.cli",
    "bench": "capsnet.bench.cli",
}


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, like every other user error, and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _CommandNotFound(Exception):
    pass


class _CommandFinder(argparse.ArgumentParser):
    """Reads the subcommand out of a command line by the top-level options' own rules (`--log-level X`,
    `--log-level=X`, `--log X`), ignoring everything after it."""

    def __init__(self):
        super().__init__(add_help=False)
        self.add_argument("--log-level")
        self.add_argument("command", nargs="?")

    def error(self, message: str):
        raise _CommandNotFound(message)


def command_in(argv: list[str]) -> str | None:
    """The subcommand that `argv` (the arguments after `capsnet`) names, or None: help, --version, a mistake."""
    try:
        known, _ = _CommandFinder().parse_known_args(argv)
    except _CommandNotFound:
        return None
    return known.command if known.command in _COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` (and the other subcommands of its module) alone, or of every subcommand: for
    help, usage mistakes and None."""
    parser = _Parser(
        prog="capsnet",
        description="Capsule Networks: train, export to ONNX/TensorRT, serve over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"capsnet-serve {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = [_COMMANDS[command]] if command in _COMMANDS else dict.fromkeys(_COMMANDS.values())
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_in(argv))
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
