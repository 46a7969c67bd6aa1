"""The one table of training settings (training/resume.py): every option of a run is in it, and `capsnet train`'s
parser, its help and TrainOptions take their defaults from it, so a default lives in one place."""

from __future__ import annotations

import argparse
import dataclasses

from capsnet.cli import build_parser
from capsnet.training.resume import SETTINGS, Resume, default_help
from capsnet.training.options import TrainOptions

# what is not a setting of the run: how this invocation starts (--resume) and shows progress (--no-progress)
INVOCATION = {"resume", "progress"}
NO_FLAG = {"train_images", "world_size"}  # facts of the run, which a resume mid-epoch keeps


def train_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["train"]


def test_every_option_of_a_run_is_in_the_table():
    fields = {field.name for field in dataclasses.fields(TrainOptions)}
    assert fields - INVOCATION == set(SETTINGS) - NO_FLAG


def test_the_parser_and_train_options_take_the_tables_defaults():
    actions = {action.dest: action for action in train_parser()._actions}
    options = TrainOptions()
    for name, setting in SETTINGS.items():
        if name in NO_FLAG:
            continue
        action = actions[name]
        assert setting.flag in action.option_strings, name
        if setting.resume is Resume.KEEPS:
            # left out, it must reach the run as None: the checkpoint's value then, or the default
            assert action.default in (None, False) and getattr(options, name) in (None, False), name
        else:
            assert action.default == setting.default == getattr(options, name) or (name == "out" and str(
                options.out) == action.default == setting.default), name


def test_the_help_states_the_tables_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a flag's help
    text = train_parser().format_help()
    for name in ("val_fraction", "epochs", "batch_size", "lr", "lr_schedule", "lr_decay", "warmup", "max_shift",
                 "hflip", "erase", "seed", "preset", "out"):
        assert default_help(name) in text, name
    assert "default 0.001; 0.01 for --arch em; with --resume the checkpoint's" in text
    assert "(default 10)" in text and "default exponential; linear for --arch em" in text
