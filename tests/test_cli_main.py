"""capsnet.cli.main(): how a subcommand's exceptions become exit codes, shown with a fake subcommand."""

from __future__ import annotations

import argparse

import pytest

from capsnet import cli


def run_raising(monkeypatch, error: BaseException) -> int:
    def handler(args):
        raise error

    def build_parser():
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
