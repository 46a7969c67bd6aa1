"""How far a model's poses show in its decoder's drawings (model.json's `decoder.pose`), measured on held-out
images by `capsnet eval --pose` and recorded by `capsnet export --reconstruction`, so that the server and the
capsule explorer can say what moving a pose will show.

- fidelity: the reconstruction's mean squared error over the class template's, the template being the class's mean
  training image; 1 draws no better than the template, 0 draws the digit it saw.
- sensitivity: per pose dimension, the mean absolute change of the drawing, in grey levels of 255, between that
  dimension of the true class's capsule moved by −step and by +step (the paper's figure 4 spans ±0.25).
- visible dimensions: those whose sensitivity reaches `visible_grey_levels`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

POSE_STEP = 0.25  # the paper's figure 4 moves each dimension over -0.25..+0.25
GREY_LEVELS = 255
DEFAULT_POSE_IMAGES = 1000  # held-out images measured: the embedded test split; a full test split's first 1,000
# A mean change of 8 grey levels over the whole image is a stroke visibly moving or thickening; a capsule whose
# dimensions stay below it draws the same shape whatever its pose.
VISIBLE_GREY_LEVELS = 8.0


@dataclass(frozen=True)
class PoseFigures:
    images: int  # held-out images measured
    split: str  # which split of `dataset` they came from
    dataset: str
    reconstruction_mse: float  # per pixel, on the [0, 1] scale
    template_mse: float
    sensitivity: tuple[float, ...]  # grey levels per pose dimension
    step: float = POSE_STEP
    visible_grey_levels: float = VISIBLE_GREY_LEVELS

    @property
    def fidelity(self) -> float:
        return self.reconstruction_mse / self.template_mse if self.template_mse > 0 else math.inf

    @property
    def visible_dimensions(self) -> int:
        return sum(level >= self.visible_grey_levels for level in self.sensitivity)

    def describe(self) -> str:
        levels = sorted(self.sensitivity)
        return (f"pose on {self.images} {self.split} images of {self.dataset}: fidelity {self.fidelity:.3f} "
                f"(reconstruction MSE {self.reconstruction_mse:.5f} / class template {self.template_mse:.5f}); "
                f"moving one dimension by ±{self.step:g} changes the drawing by {levels[0]:.1f}–{levels[-1]:.1f} "
                f"grey levels (median {levels[len(levels) // 2]:.1f}); {self.visible_dimensions} of "
                f"{len(levels)} dimensions reach {self.visible_grey_levels:g}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sensitivity": [round(level, 4) for level in self.sensitivity],
                "fidelity": self.fidelity, "visible_dimensions": self.visible_dimensions}

    @classmethod
    def from_json(cls, value: Any, fail, pose_dim: int) -> "PoseFigures":
        """`value` as to_json wrote it for `pose_dim` dimensions; `fail(message)` makes the error naming the file."""
        if not isinstance(value, dict):
            raise fail("decoder.pose must be an object")
        try:
            figures = cls(images=value["images"], split=value["split"], dataset=value["dataset"],
                          reconstruction_mse=value["reconstruction_mse"], template_mse=value["template_mse"],
                          sensitivity=tuple(value["sensitivity"]), step=value["step"],
                          visible_grey_levels=value["visible_grey_levels"])
        except (KeyError, TypeError) as err:
            raise fail(f"decoder.pose lacks {err}") from None
        numbers = [figures.reconstruction_mse, figures.template_mse, figures.step, figures.visible_grey_levels,
                   *figures.sensitivity]
        if (not all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
                    for n in numbers) or len(figures.sensitivity) != pose_dim
                or not isinstance(figures.images, int) or figures.images < 1
                or not isinstance(figures.split, str) or not isinstance(figures.dataset, str)):
            raise fail(f"decoder.pose needs images >= 1, split and dataset names, finite figures >= 0 and "
                       f"{pose_dim} sensitivities")
        return figures

