"""Fixtures of the quality tests: running a command module's subcommand the way `capsnet` does."""

from __future__ import annotations

import argparse

import pytest


@pytest.fixture()
def run_command():
    """run(module, *argv) -> exit status: the module's `register(subparsers)` on a fresh parser, then its handler."""

    def run(module, *argv: str) -> int:
        parser = argparse.ArgumentParser(prog="capsnet")
        module.register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        return int(args.handler(args) or 0)

    return run
