"""Pairs of different digits in one image (`capsnet eval --pairs LAYOUT`, visualize's pairs.png): does the model
say both are present?

A capsule's length says whether its class is present, on its own, not as a share of one answer, so a model
trained on single digits can name two at once. Su Jianlin's test (2018): two test digits of different classes side
by side; a pair counts when the two longest capsules are its two classes (top-2 set accuracy), and under the
stricter figure when both of their lengths are also above 0.5.

numpy and torch are imported inside the functions, so `capsnet --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from capsnet.errors import CapsNetError

if TYPE_CHECKING:
    from capsnet.training.evaluate import Scoring

# How two digits share one image: side by side (H × 2W), one above the other (2H × W), or overlaid with shifts
# (H × W, transforms.overlay_pairs)
PAIR_LAYOUTS = ("side-by-side", "stacked", "overlap")


@dataclass(frozen=True)
class PairSpec:
    """Which pairs: how two digits share an image (PAIR_LAYOUTS), how many, drawn from which seed."""
    layout: str
    count: int
    seed: int


@dataclass(frozen=True)
class PairScores:
    layout: str
    count: int
    seed: int
    image_shape: tuple[int, int, int]  # (C, H, W) of each pair image
    top2_accuracy: float
    top2_both_present_accuracy: float

    def to_dict(self) -> dict:
        from capsnet.training.robustness import PRESENT_THRESHOLD

        return {"layout": self.layout, "count": self.count, "seed": self.seed, "image_shape": list(self.image_shape),
                "top2_accuracy": self.top2_accuracy, "top2_both_present_accuracy": self.top2_both_present_accuracy,
                "present_threshold": PRESENT_THRESHOLD}

    def format_report(self) -> str:
        from capsnet.training.robustness import PRESENT_THRESHOLD

        shape = "x".join(map(str, self.image_shape[1:]))
        return (f"pairs ({self.layout}, {self.count} images of {shape}, seed {self.seed}):\n"
                f"  top-2 set accuracy                {100 * self.top2_accuracy:6.2f}%\n"
                f"  ... with both lengths > {PRESENT_THRESHOLD:g}      {100 * self.top2_both_present_accuracy:6.2f}%")


def build_pairs(config, split, spec: PairSpec, what: str):
    """`spec.count` pair images of `split`'s digits (transforms.digit_pairs), after checking that the model of
    `config` (named `what` in an error) takes their size: a fixed-size model takes overlaid pairs only."""
    from capsnet.training.transforms import digit_pairs

    layout, count = spec.layout, spec.count
    channels, height, width = split.images.shape[1:]
    shape = {"side-by-side": (channels, height, 2 * width), "stacked": (channels, 2 * height, width),
             "overlap": (channels, height, width)}[layout]
    sizes = config.input_sizes
    if shape not in sizes:
        hint = " (models of --arch shared-capsnet or gap-cnn take any size)" if sizes.fixed else ""
        raise CapsNetError(f"{what} takes {sizes.describe()}{' images' if sizes.fixed else ''}; {layout} pairs are "
                           f"{'x'.join(map(str, shape))}{hint}")
    try:
        return digit_pairs(split, count, spec.seed, layout)
    except MemoryError:
        raise CapsNetError(f"not enough memory for {count:,} pairs of {'x'.join(map(str, shape))} images; ask for "
                           "fewer with --pair-count") from None


def score_pairs(model, pairs, spec: PairSpec, scoring: Scoring):
    """The model's (N, J) lengths on `pairs` (a transforms.PairSet) and its PairScores."""
    from capsnet.training.robustness import class_probabilities, overlap_scores

    probabilities = class_probabilities(model, pairs.images, scoring)  # (N, J)
    scores = overlap_scores(probabilities, pairs.labels)
    return probabilities, PairScores(spec.layout, len(pairs.labels), spec.seed, tuple(pairs.images.shape[1:]),
                                     scores["top2_accuracy"], scores["top2_both_present_accuracy"])
