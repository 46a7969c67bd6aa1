"""Accuracy, per-class accuracy, confusion matrix and loss of a model on a data split.

Used for the per-epoch validation in `capsnet train` (each rank scores a shard; the counts are
summed, so the figures are exact under torchrun) and by `capsnet eval`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import Checkpoint, Model
from capsnet.models.config import CapsNetConfig
from capsnet.training.data import Dataset, Split, brief_list, load_dataset, to_float
from capsnet.training.distributed import DistributedContext, all_reduce_sum
from capsnet.training.loss import capsnet_loss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scoring:
    """How a model is scored: images per forward pass, on which device, among which ranks (each takes every
    world_size-th image, and the counts are summed), under which autocast."""
    batch_size: int
    device: torch.device
    context: DistributedContext = DistributedContext()
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()


@dataclass
class Evaluation:
    confusion: np.ndarray  # (J, J) counts: rows are true classes, columns predicted classes
    loss: float  # mean training loss (margin + weighted reconstruction, masked by the true label)
    class_names: tuple[str, ...]

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def correct(self) -> int:
        return int(np.trace(self.confusion))

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.count, 1)

    @property
    def per_class_accuracy(self) -> dict[str, float]:
        """Recall of each class; NaN would be unhelpful in JSON, so a class absent from the split scores 0."""
        per_class = self.confusion.sum(axis=1)  # (J,)
        return {name: float(self.confusion[k, k] / per_class[k]) if per_class[k] else 0.0
                for k, name in enumerate(self.class_names)}

    def to_dict(self) -> dict:
        return {
            "images": self.count,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "loss": self.loss,
            "class_names": list(self.class_names),
            "per_class_accuracy": self.per_class_accuracy,
            "confusion_matrix": self.confusion.tolist(),
        }

    def format_report(self) -> str:
        lines = [f"accuracy: {100 * self.accuracy:.2f}% ({self.correct}/{self.count})   loss: {self.loss:.4f}",
                 "per-class accuracy:"]
        name_width = max(len(name) for name in self.class_names)
        per_class_total = self.confusion.sum(axis=1)  # (J,)
        for k, (name, accuracy) in enumerate(self.per_class_accuracy.items()):
            lines.append(f"  {k:>2} {name:<{name_width}}  {100 * accuracy:6.2f}%  "
                         f"({self.confusion[k, k]}/{per_class_total[k]})")
        cell = max(len(str(self.confusion.max())), len(str(len(self.class_names) - 1))) + 1
        lines.append("confusion matrix (rows: true class, columns: predicted class):")
        lines.append("     " + "".join(f"{k:>{cell}}" for k in range(len(self.class_names))))
        for k, row in enumerate(self.confusion):
            lines.append(f"  {k:>2} " + "".join(f"{count:>{cell}}" for count in row))
        return "\n".join(lines)


def load_checkpoint_data(checkpoint: Checkpoint, checkpoint_path: Path, data: str | None,
                         every_class: bool = False, hold_out: bool = True) -> Dataset:
    """`data` (`--data`), or else the data the checkpoint was trained on, with the validation share its training
    run held out (so `validation` is the run's own split), checked to fit the model (`check_dataset_fits`).
    A caller that reads only the test split passes `hold_out=False`: a small data set whose classes are too
    few to hold anything out would otherwise be refused over a split it never uses."""
    if data is None:
        # checkpoints from before `data` was recorded name only the dataset; the embedded one is always here
        data = checkpoint.metrics.get("data") or ("embedded" if checkpoint.dataset == "embedded-mnist-5k" else None)
        if data is None or (data != "embedded" and not Path(data).is_dir()):
            where = f" ({data} is not here)" if data else ""
            raise CapsNetError(f"{checkpoint_path} was trained on {checkpoint.dataset or 'unrecorded data'}{where}; "
                               "pass --data with that dataset's IDX folder")
        log.info("--data: %s, the checkpoint's training data", data)
    dataset = load_dataset(data, checkpoint.metrics.get("validation_fraction", 0.0) if hold_out else 0.0)
    check_dataset_fits(checkpoint.config, dataset, f"checkpoint {checkpoint_path}", tuple(checkpoint.class_names),
                       every_class)
    return dataset


def check_dataset_fits(config: CapsNetConfig, dataset: Dataset, what: str, class_names: tuple[str, ...] = (),
                       every_class: bool = False) -> None:
    """A model only takes images of a size it takes (its own, or for an any-size model one within its
    `input_sizes`) and labels below its class count; given the model's `class_names`, only data of those classes
    (a digit model scored on clothes gives a meaningless figure), and with `every_class` all of them (export
    calibrates on them and gates on each)."""
    sizes = config.input_sizes
    if dataset.image_shape not in sizes:
        raise CapsNetError(f"{what} takes {sizes.describe()}{' images' if sizes.fixed else ''}; data "
                           f"{dataset.name!r} has {'x'.join(map(str, dataset.image_shape))}")
    highest = max(int(dataset.train.labels.max(initial=0)), int(dataset.test.labels.max(initial=0)))
    if highest >= config.num_classes:
        raise CapsNetError(f"{what} has {config.num_classes} classes; data {dataset.name!r} has label {highest}")
    # without `every_class`, data may hold fewer classes than the model (a subset of digits), never other ones
    wanted = tuple(class_names) if every_class else tuple(class_names)[:len(dataset.class_names)]
    if class_names and tuple(dataset.class_names) != wanted:
        need = " and needs data of all of them" if every_class else ""
        raise CapsNetError(f"{what} was trained on classes {brief_list(class_names)}{need}; data {dataset.name!r} has "
                           f"{brief_list(dataset.class_names)} (a classes.txt in the data folder names its classes)")


@torch.no_grad()
def evaluate(model: Model, split: Split, class_names: tuple[str, ...], scoring: Scoring) -> Evaluation:
    """Score `split`; each rank takes every world_size-th image and the counts are summed over ranks."""
    batch_size, device, context = scoring.batch_size, scoring.device, scoring.context
    was_training = model.training
    model.eval()
    num_classes = len(class_names)
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)  # (J*J,) flat counts
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    shard = np.arange(context.rank, len(split), context.world_size)
    for start in range(0, len(shard), batch_size):
        indices = shard[start : start + batch_size]
        images = to_float(split.images[indices]).to(device)  # (B, C, H, W)
        labels = torch.as_tensor(split.labels[indices]).to(device)  # (B,)
        with scoring.autocast:
            output = model(images, labels)
        loss_sum += capsnet_loss(output, images, labels, model.config).total.double() * len(indices)
        predicted = output.probabilities.argmax(dim=1)  # (B,)
        confusion += torch.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes)
    all_reduce_sum(confusion, context)
    all_reduce_sum(loss_sum, context)
    model.train(was_training)
    return Evaluation(
        confusion=confusion.reshape(num_classes, num_classes).cpu().numpy(),  # (J, J)
        loss=loss_sum.item() / max(len(split), 1),
        class_names=tuple(class_names),
    )
