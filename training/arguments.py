"""The command-line arguments the commands share, each concept declared once: the checkpoint a command reads, the
data it reads with it, the device it runs on, and the batch a checkpoint is scored in. `capsnet train`, `eval`,
`visualize`, `robustness` and `export` take them from here, so a flag means the same in every command.

Nothing heavy is imported: `capsnet --help` builds every parser."""

from __future__ import annotations

import argparse
from pathlib import Path

DATA_HELP = "'embedded' (5,000 MNIST digits shipped in the package) or a folder of MNIST-format IDX files"
CHECKPOINT_DATA_HELP = DATA_HELP + "; its classes must be the checkpoint's (default: the data it was trained on)"
DEVICE_HELP = "auto (CUDA if present, else CPU), cpu, cuda or cuda:N"
SCORING_BATCH_SIZE = 256


def add_checkpoint(parser: argparse.ArgumentParser, text: str = "a checkpoint written by capsnet train") -> None:
    """The checkpoint a command reads, as its first positional argument."""
    parser.add_argument("checkpoint", type=Path, help=text)


def add_data(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
             text: str = CHECKPOINT_DATA_HELP) -> None:
    """--data: the images a command reads; None (the default) for a command with a checkpoint: the checkpoint's."""
    parser.add_argument("--data", default=default, metavar="embedded|DIR", help=text)


def add_device(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "auto") -> None:
    """--device: where torch runs the model (training.distributed.resolve_device reads it)."""
    parser.add_argument("--device", default=default, metavar="auto|cpu|cuda[:N]", help=DEVICE_HELP)


def add_scoring_batch_size(parser: argparse.ArgumentParser) -> None:
    """--batch-size of a command that scores a checkpoint: images per forward pass, no training batch."""
    parser.add_argument("--batch-size", type=int, default=SCORING_BATCH_SIZE, metavar="B",
                        help=f"images per forward pass (default {SCORING_BATCH_SIZE})")
