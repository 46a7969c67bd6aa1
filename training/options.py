"""A run's settings: what `capsnet train` is given (TrainOptions), what the run trains with once the resumed
checkpoint and the defaults complete them (RunOptions), and the model config they make."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.models.config import PRESETS, CapsNetConfig, preset
from capsnet.runtime.cpu import MAX_THREADS
from capsnet.training.data import Dataset, channel_mean_std
from capsnet.training.resume import LR_SCHEDULES, MODEL_FLAGS, default


DYNAMIC_ROUTING_FLAGS = ("routing", "squash_constant", "detach_agreement")
# Routing flags an architecture has no such setting for, with why: refused, not silently ignored.
REFUSED_ROUTING_FLAGS = {
    "em": (DYNAMIC_ROUTING_FLAGS, "sets dynamic routing; EM routing (--arch em) has no such setting"),
    "gap-cnn": ((*DYNAMIC_ROUTING_FLAGS, "routing_iterations"),
                "sets capsule routing; a gap-cnn model has no capsules"),
}
# The architectures of the presets each --arch takes (the CNN baseline takes its input size from a fixed-size
# capsule preset, the any-size models have presets of their own).
PRESET_ARCHITECTURES = {"capsnet": ("capsnet",), "em": ("em",), "cnn-baseline": ("capsnet", "em"),
                        "shared-capsnet": ("shared-capsnet",), "gap-cnn": ("gap-cnn",)}
SEED_LIMIT = 2**63  # torch.manual_seed and numpy's SeedSequence both take 0 .. 2**63 - 1


@dataclass
class TrainOptions:
    """A run's settings; None: not given, so the resumed checkpoint's or the default (resume.SETTINGS)."""
    data: str = default("data")
    out: Path = Path(default("out"))
    # model: None keeps the preset's (or, with --resume, the checkpoint's)
    preset: str | None = None
    arch: str | None = None
    routing: str | None = None
    routing_iterations: int | None = None
    squash_constant: float | None = None
    reconstruction_weight: float | None = None
    detach_agreement: bool | None = None
    normalize: bool = default("normalize")  # standardise inputs with the training split's per-channel mean/std
    val_fraction: float | None = None  # share of the training images held out to choose the best epoch; 0: none
    # optimisation
    epochs: int = default("epochs")
    batch_size: int = default("batch_size")
    lr: float | None = None
    lr_schedule: str | None = None
    lr_decay: float | None = None  # exponential: multiplies the learning rate after every epoch
    warmup: float | None = None  # linear: share of the steps the rate rises over
    # the batches and their draws
    max_shift: int | None = None
    hflip: bool | None = None  # random left-right mirror (clothes, not digits)
    erase: float | None = None  # probability of random erasing per image
    seed: int | None = None
    # execution
    device: str = default("device")
    amp: bool = default("amp")  # fp16 autocast + gradient scaling on CUDA, bf16 autocast on a CPU with native bf16
    compile: bool = default("compile")
    threads: int | None = default("threads")
    resume: Path | None = None
    checkpoint_every: int | None = default("checkpoint_every")  # also write the last checkpoint every N steps
    progress: bool = True

    def __post_init__(self) -> None:
        checks = {
            # Path() would drop the separator, and the checkpoint would become a file named like the folder
            f"--out {self.out} names a folder; give a file name such as {Path(self.out) / 'model.ckpt'}":
                not str(self.out).endswith(os.sep),
            "--epochs must be at least 1": self.epochs >= 1,
            "--val-fraction must be at least 0 and below 1": self.val_fraction is None or 0 <= self.val_fraction < 1,
            "--batch-size must be at least 1": self.batch_size >= 1,
            "--lr must be a positive number": self.lr is None or (self.lr > 0 and np.isfinite(self.lr)),
            "--lr-schedule must be exponential or linear": self.lr_schedule in (None, *LR_SCHEDULES),
            "--lr-decay must be in (0, 1]": self.lr_decay is None or 0 < self.lr_decay <= 1,
            "--warmup must be at least 0 and below 1": self.warmup is None or 0 <= self.warmup < 1,
            "--max-shift must be 0 or more": self.max_shift is None or self.max_shift >= 0,
            "--erase must be in [0, 1]": self.erase is None or 0 <= self.erase <= 1,
            "--threads must be at least 1": self.threads is None or self.threads >= 1,
            f"--threads must be at most {MAX_THREADS}": self.threads is None or self.threads <= MAX_THREADS,
            "--checkpoint-every must be at least 1": self.checkpoint_every is None or self.checkpoint_every >= 1,
            "--routing-iterations must be at least 1": self.routing_iterations is None or self.routing_iterations >= 1,
            "--squash-constant must be a positive number": self.squash_constant is None or (
                self.squash_constant > 0 and np.isfinite(self.squash_constant)),
            f"--seed must be in [0, {SEED_LIMIT})": self.seed is None or 0 <= self.seed < SEED_LIMIT,
            "--reconstruction-weight must be 0 or more": self.reconstruction_weight is None or (
                self.reconstruction_weight >= 0 and np.isfinite(self.reconstruction_weight)),
        }
        for message, ok in checks.items():
            if not ok:
                raise CapsNetError(message)
        self.out = Path(self.out)
        self.resume = None if self.resume is None else Path(self.resume)


@dataclass(frozen=True)
class RunOptions:
    """The settings a run trains with: TrainOptions completed from the resumed checkpoint and the defaults
    (resume.run_options, resume.learning_rate_options), so none is left "not given"."""
    data: str
    out: Path
    resume: Path | None
    val_fraction: float
    epochs: int
    batch_size: int
    lr: float
    lr_schedule: str
    lr_decay: float | None  # the exponential schedule's; None under the linear one
    warmup: float | None  # the linear schedule's; None under the exponential one
    max_shift: int
    hflip: bool
    erase: float
    seed: int
    amp: bool
    compile: bool
    checkpoint_every: int | None
    progress: bool

    @classmethod
    def completed(cls, options: TrainOptions, resolved: dict[str, Any]) -> RunOptions:
        """`options`, with the settings the run resolved from the checkpoint and the defaults in place of its own."""
        given = {setting.name: getattr(options, setting.name) for setting in fields(cls)}
        return cls(**{**given, **resolved})

    @property
    def last_path(self) -> Path:
        return last_checkpoint_path(self.out)


def last_checkpoint_path(out: Path) -> Path:
    """The last epoch's checkpoint, next to the best one: model.ckpt -> model.last.ckpt."""
    return out.with_name(f"{out.stem}.last.ckpt")


def model_config(options: TrainOptions, dataset: Dataset, base: CapsNetConfig | None) -> CapsNetConfig:
    """The preset sized for the data, with the model flags applied; `base` (a resumed model) replaces the preset."""
    channels, height, width = dataset.image_shape
    if options.preset is not None or base is None:
        base = preset(options.preset or default("preset").of(options.arch), in_channels=channels, height=height,
                      width=width, num_classes=len(dataset.class_names))
        if options.arch is not None and base.arch not in PRESET_ARCHITECTURES[options.arch]:
            names = [name for name, config in PRESETS.items() if config.arch in PRESET_ARCHITECTURES[options.arch]]
            raise CapsNetError(f"--preset {options.preset} is a {base.arch} preset; --arch {options.arch} takes "
                               f"{' or '.join(names)}")
    changes = {name: getattr(options, name) for name in MODEL_FLAGS
               if getattr(options, name) is not None}
    refused, why = REFUSED_ROUTING_FLAGS.get(changes.get("arch") or base.arch, ((), ""))
    given = [name for name in refused if name in changes]
    if given:
        raise CapsNetError(f"--{given[0].replace('_', '-')} {why}")
    if changes.get("arch") == "cnn-baseline":
        changes["reconstruction_weight"] = 0.0  # the baseline has no decoder: margin loss only
    if options.normalize:
        changes["input_mean"], changes["input_std"] = channel_mean_std(dataset.train.images)
    return base.replace(**changes)
