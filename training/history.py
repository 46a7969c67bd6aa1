"""A training run's history: one record per epoch, as a checkpoint keeps it.

On disk (a checkpoint's "history") each record is a dict of these keys in this order, a split's scores and the
timings only where the run had them: checkpoints of the first format carry the rate and the training figures alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SplitScore:
    loss: float
    accuracy: float


SCORED_SPLITS = ("validation", "test")
TIMINGS = ("train_seconds", "train_images_per_second", "eval_seconds")


@dataclass(frozen=True)
class EpochRecord:
    epoch: int  # from 1
    lr: float  # the learning rate the epoch started at
    train_loss: float
    train_accuracy: float
    validation: SplitScore | None = None  # None: no validation split (--val-fraction 0)
    test: SplitScore | None = None
    train_seconds: float | None = None
    train_images_per_second: float | None = None
    eval_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"epoch": self.epoch, "lr": self.lr, "train_loss": self.train_loss,
                                  "train_accuracy": self.train_accuracy}
        for name in SCORED_SPLITS:
            score = getattr(self, name)
            if score is not None:
                record.update({f"{name}_loss": score.loss, f"{name}_accuracy": score.accuracy})
        record.update({name: getattr(self, name) for name in TIMINGS if getattr(self, name) is not None})
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> EpochRecord:
        def score(split: str) -> SplitScore | None:
            return SplitScore(record[f"{split}_loss"], record[f"{split}_accuracy"]) if f"{split}_loss" in record \
                else None

        return cls(record["epoch"], record["lr"], record["train_loss"], record["train_accuracy"],
                   validation=score("validation"), test=score("test"), train_seconds=record.get("train_seconds"),
                   train_images_per_second=record.get("train_images_per_second"),
                   eval_seconds=record.get("eval_seconds"))
