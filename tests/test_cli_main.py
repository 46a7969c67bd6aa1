"""capsnet.cli.main(): how a subcommand's exceptions become exit codes, shown with a fake subcommand, and which
stages a command imports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from capsnet import cli


def run_raising(monkeypatch, error: BaseException) -> int:
    def handler(args):
        raise error

    def build_parser(command=None):
        parser = argparse.ArgumentParser(prog="capsnet")
        parser.add_argument("--log-level", default="INFO")
        parser.set_defaults(command="export", handler=handler)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    return cli.main([])


def raised_from(cause: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("export failed") from cause
    except RuntimeError as err:
        return err


def raised_while_handling(context: BaseException) -> RuntimeError:
    try:
        try:
            raise context
        except BaseException:
            raise RuntimeError("export failed")  # noqa: B904 - an implicit __context__ is the point
    except RuntimeError as err:
        return err


@pytest.mark.parametrize("error", [
    KeyboardInterrupt(),
    raised_from(KeyboardInterrupt()),  # what torch's ONNX exporter raises on Ctrl-C
    raised_while_handling(KeyboardInterrupt()),
    raised_from(raised_while_handling(KeyboardInterrupt())),  # two wrappers deep
], ids=["plain", "cause", "context", "nested"])
def test_interrupts_wrapped_or_not_exit_130(monkeypatch, capsys, error):
    assert run_raising(monkeypatch, error) == 130
    assert capsys.readouterr().err == "capsnet export: interrupted\n"


def test_other_errors_still_propagate(monkeypatch):
    error = raised_from(ValueError("a bug"))
    with pytest.raises(RuntimeError) as caught:
        run_raising(monkeypatch, error)
    assert caught.value is error


def test_a_cyclic_exception_chain_does_not_hang(monkeypatch):
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__context__, second.__context__ = second, first
    with pytest.raises(RuntimeError):
        run_raising(monkeypatch, first)


# A fresh interpreter runs `capsnet ARGS` and prints the stages (capsnet.<stage>) it imported.
IMPORTED_STAGES = """
import json, sys
from capsnet import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
stages = {"training", "export", "serving", "client", "bench"}
print(json.dumps(sorted({name.split(".")[1] for name in sys.modules if name.count(".") and name.startswith("capsnet.")
                         and name.split(".")[1] in stages})))
"""


@pytest.mark.parametrize("argv, stages", [
    (["serve", "--help"], ["serving"]),
    (["--log-level", "DEBUG", "predict", "--help"], ["client"]),
    (["--log=WARNING", "health", "--help"], ["client"]),
    (["train", "--help"], ["training"]),
    (["--help"], ["bench", "client", "export", "serving", "training"]),
], ids=["serve", "predict", "health", "train", "help"])
def test_a_command_imports_the_stage_it_belongs_to_only(argv, stages):
    """A server's process holds none of training's or export's code: `capsnet serve` imports serving's command
    module alone, and the import-linter contracts keep serving's modules from importing those stages. The client
    commands import no server code."""
    result = subprocess.run([sys.executable, "-c", IMPORTED_STAGES, *argv], capture_output=True, text=True,
                            timeout=120, check=True)
    assert json.loads(result.stdout.splitlines()[-1]) == stages


def test_the_command_is_read_by_the_top_level_options_rules():
    assert cli.command_in(["--log", "DEBUG", "serve", "--model", "m"]) == "serve"
    assert cli.command_in(["--log-level=ERROR", "export", "x.ckpt"]) == "export"
    for no_command in (["--help"], ["--version"], ["serv"], ["--log-level"], []):
        assert cli.command_in(no_command) is None, no_command
