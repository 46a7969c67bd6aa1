"""`capsnet visualize`: PNG pictures of what a trained CapsNet learned, written to --out:

- reconstructions.png: test digits above the decoder's reconstruction from their predicted capsule,
  for correct and for wrong predictions;
- pose-perturbation-<k>.png (3 digits): each of the 16 dimensions of the predicted capsule moved from
  -0.25 to +0.25 in steps of 0.05 and decoded, one row per dimension (Sabour et al. 2017, figure 4);
- routing.png: the last routing iteration's coupling coefficients c_ij of 4 digits, averaged over the
  primary capsule channels at each grid position: which primary capsules sent their votes to which class;
- confusion.png: the confusion matrix on the scored test digits;
- training-curves.png: loss and accuracy per epoch of each split, from the checkpoint's history; the epoch
  chosen on validation marked;
- pairs.png, for a model that takes any image size (`--arch shared-capsnet` or `gap-cnn`): pairs of different
  test digits side by side, each beside its length (sigmoid) per class, the true classes coloured and those
  above 0.5 (present) marked, with the top-2 set figures of `capsnet eval --pairs side-by-side` on the scored pairs.

An EM checkpoint (`--arch em`) gets the same pictures: its class activations stand for lengths, its
4×4 pose matrices (flattened to 16) are perturbed, and routing shows the class layer's assignments R.
A cnn-baseline checkpoint has no capsules: it gets the confusion matrix and the training curves; the any-size
models get those and pairs.png (no decoder to reconstruct from).
torch and matplotlib are imported inside the functions, so `capsnet --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from capsnet.training.arguments import add_checkpoint, add_data, add_device, add_scoring_batch_size

if TYPE_CHECKING:
    import numpy as np

    from capsnet.training.pairs import PairScores
    from capsnet.training.transforms import PairSet

INSTALL = "pip install 'capsnet-serve[visualize]'"

PERTURBATION_STEP = 0.05
PERTURBATION_STEPS = 11  # -0.25 ... +0.25
PERTURBED_DIGITS = 3
ROUTED_CORRECT, ROUTED_WRONG = 3, 1  # digits in the routing picture
PAIRS_SHOWN = 8  # rows of pairs.png
PAIRS_LAYOUT = "side-by-side"
DPI = 100
# Columns of reconstructions.png: its layout time grows faster than the column count (64: half a minute,
# 200 ran past 5 minutes without finishing, 600 exceeds matplotlib's 2**16-pixel image limit).
MAX_EXAMPLES = 32


@dataclass(frozen=True)
class VisualizeOptions:
    """What `capsnet visualize` draws, from what, and where."""
    checkpoint: Path
    data: str | None  # None: the data the checkpoint was trained on
    out: Path  # the folder for the pictures
    images: int  # test images scored, and pairs for a model that takes any size
    examples: int  # correct and wrong predictions shown in reconstructions.png
    batch_size: int
    device: str


@dataclass(frozen=True)
class Labelled:
    """Images as a picture shows them, each with its true and its predicted class."""
    images: np.ndarray  # (K, C, H, W) floats in [0, 1]
    labels: np.ndarray  # (K,)
    predicted: np.ndarray  # (K,)
    names: tuple[str, ...]  # the class names


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "visualize",
        help="draw reconstructions, pose perturbations, routing, confusion matrix, training curves and pairs (PNG)",
        description="Write PNG pictures of a checkpoint on the test split of --data: reconstructions from the "
                    "predicted capsule (correct and wrong predictions), pose perturbations of 3 digits, routing "
                    "coupling heat maps, the confusion matrix and the training curves; for a model that takes any "
                    "image size, pairs of digits side by side with their lengths per class.",
    )
    add_checkpoint(parser)
    add_data(parser)
    # a string, not a Path: Path("") would be the working directory, so an empty --out could not be told apart
    parser.add_argument("--out", default="pictures", metavar="DIR", help="folder for the PNG files (default pictures)")
    parser.add_argument("--images", type=int, default=1000, metavar="N",
                        help="score N test images, a fixed random choice of them, for the confusion matrix and "
                             "examples, and for a model that takes any size N pairs of them (default 1000)")
    parser.add_argument("--examples", type=int, default=8, metavar="K",
                        help=f"correct and wrong predictions shown in reconstructions.png, at most {MAX_EXAMPLES} "
                             "(default 8 each)")
    add_scoring_batch_size(parser)
    add_device(parser)
    parser.set_defaults(handler=run_visualize)


def run_visualize(args: argparse.Namespace) -> int:
    from capsnet.errors import CapsNetError

    try:
        import matplotlib  # noqa: F401 - what draws the pictures: the visualize extra, not in the serving image
    except ImportError:
        raise CapsNetError(f"the pictures are drawn with matplotlib: {INSTALL}") from None
    if not args.out:  # `--out "$UNSET"`: the pictures would land in the working directory unasked
        raise CapsNetError("--out needs a folder for the pictures, got an empty path")
    out = Path(args.out)
    written = visualize(VisualizeOptions(args.checkpoint, args.data, out, args.images, args.examples, args.batch_size,
                                         args.device))
    for path in written:
        print(f"wrote {path}")
    # A picture of an earlier run into this folder that this checkpoint did not get (a cnn-baseline has no
    # capsules; fewer correct digits, fewer perturbations) would pass for this checkpoint's.
    for stale in (out / name for name in picture_names()):
        if stale not in written and stale.is_file():
            try:
                stale.unlink()
            except OSError as err:
                raise CapsNetError(f"cannot remove {stale}, an earlier run's picture this checkpoint does not get: "
                                   f"{err.strerror or err}") from None
            print(f"removed {stale}, an earlier run's picture this checkpoint does not get")
    return 0


def picture_names() -> list[str]:
    """Every file name visualize can write."""
    return ["confusion.png", "training-curves.png", "reconstructions.png", "routing.png", "pairs.png",
            *(f"pose-perturbation-{k}.png" for k in range(PERTURBED_DIGITS))]


def visualize(options: VisualizeOptions) -> list[Path]:
    """Draw every picture the checkpoint has what it takes for into `options.out`; returns the files written."""
    import tempfile

    import numpy as np
    import torch

    from capsnet.errors import CapsNetError
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.models.config import ANY_SIZE_ARCHITECTURES, CAPSULE_ARCHITECTURES
    from capsnet.training.data import Split, to_float
    from capsnet.training.distributed import DistributedContext, resolve_device
    from capsnet.training.evaluate import Scoring, evaluate, load_checkpoint_data
    from capsnet.training.pairs import PairSpec, build_pairs, score_pairs
    from capsnet.training.robustness import class_probabilities

    checkpoint_path, out, examples, batch_size = options.checkpoint, options.out, options.examples, options.batch_size
    for flag, value in (("--images", options.images), ("--examples", examples), ("--batch-size", batch_size)):
        if value < 1:
            raise CapsNetError(f"{flag} must be at least 1")
    if examples > MAX_EXAMPLES:
        raise CapsNetError(f"--examples must be at most {MAX_EXAMPLES}, got {examples}")
    device = resolve_device(options.device, DistributedContext())
    checkpoint = load_checkpoint(checkpoint_path)
    dataset = load_checkpoint_data(checkpoint, checkpoint_path, options.data, hold_out=False)  # the test split only
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CapsNetError(f"cannot create --out {out}: {err.strerror or err}") from None
    try:  # a real write, before the scoring: os.access says yes to root even where nothing can be created (/sys)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise CapsNetError(f"cannot write to --out {out}: {err.strerror or err}") from None
    # A fixed random choice, not the first N: test splits are often sorted by class (the embedded digits are, so
    # their first 300 were 0s, 1s and 2s only); all of them, in their order, when N covers the split.
    chosen = np.sort(np.random.default_rng(0).permutation(len(dataset.test))[:options.images])
    split = Split(dataset.test.images[chosen], dataset.test.labels[chosen])
    names = tuple(checkpoint.class_names)
    model = checkpoint.build_model().to(device)

    scoring = Scoring(batch_size, device)
    written = [draw_confusion(evaluate(model, split, names, scoring), out / "confusion.png")]
    if checkpoint.history:
        written.append(draw_training_curves(checkpoint.history, out / "training-curves.png"))
    arch = checkpoint.config.arch
    if arch in ANY_SIZE_ARCHITECTURES:
        spec = PairSpec(PAIRS_LAYOUT, options.images, 0)
        pairs = build_pairs(checkpoint.config, dataset.test, spec, f"checkpoint {checkpoint_path}")
        lengths, scores = score_pairs(model, pairs, spec, scoring)
        written.append(_save(pairs_figure(pairs, lengths, scores, names, arch), out / "pairs.png"))
    if arch not in CAPSULE_ARCHITECTURES:
        # said, not only left out: the help promises reconstructions, perturbations and routing
        what = "decoder or fixed capsule grid" if arch == "shared-capsnet" else "capsules"
        logging.getLogger(__name__).info("%s is a %s: it has no %s, so no reconstructions, pose perturbations "
                                         "or routing", checkpoint_path, arch, what)
        return written

    predicted = class_probabilities(model, split.images, scoring).argmax(axis=1)  # (N,)
    # Examples in a fixed shuffled order: test splits are often sorted by class.
    order = np.random.default_rng(0).permutation(len(split))
    correct = order[predicted[order] == split.labels[order]]
    wrong = order[predicted[order] != split.labels[order]]
    with torch.no_grad():
        shown = np.concatenate([correct[:examples], wrong[:examples]])
        pixels = to_float(split.images[shown])  # (K, C, H, W)
        flat = model(pixels.to(device)).reconstruction.cpu()  # (K, C*H*W)
        reconstructions = flat.reshape(pixels.shape)  # (K, C, H, W)
        written.append(draw_reconstructions(Labelled(pixels.numpy(), split.labels[shown], predicted[shown], names),
                                            reconstructions.numpy(), min(examples, len(correct)),
                                            out / "reconstructions.png"))
        for k, index in enumerate(correct[:PERTURBED_DIGITS]):
            grid = pose_perturbations(model, to_float(split.images[index : index + 1]).to(device))  # (D, S, C, H, W)
            written.append(draw_perturbations(grid.cpu().numpy(), names[predicted[index]],
                                              out / f"pose-perturbation-{k}.png"))
        routed = np.concatenate([correct[:ROUTED_CORRECT], wrong[:ROUTED_WRONG]])
        pixels = to_float(split.images[routed])  # (B, C, H, W)
        maps = coupling_maps(model(pixels.to(device)).coupling, model.config)  # (B, J, grid_h, grid_w)
        written.append(draw_routing(Labelled(pixels.numpy(), split.labels[routed], predicted[routed], names),
                                    maps.cpu().numpy(), out / "routing.png"))
    return written


def perturbation_deltas():
    """(S,) offsets -0.25, -0.20, ..., +0.25."""
    import torch

    return (torch.arange(PERTURBATION_STEPS) - PERTURBATION_STEPS // 2) * PERTURBATION_STEP


def pose_perturbations(model, image):
    """image (1, C, H, W) -> (D, S, C, H, W): the decoder's reconstruction from the predicted capsule's pose
    with dimension d moved by delta s, every other capsule masked as in training."""
    import torch

    output = model(image)
    target = output.probabilities.argmax(dim=1)  # (1,)
    _, num_classes, dim = output.poses.shape
    deltas = perturbation_deltas().to(image.device)  # (S,)
    change = torch.eye(dim, device=image.device)[:, None, :] * deltas[None, :, None]  # (D, S, D)
    poses = output.poses.expand(dim, len(deltas), num_classes, dim).clone()  # (D, S, J, D)
    poses[:, :, target[0]] += change
    flat = poses.reshape(dim * len(deltas), num_classes, dim)  # (D*S, J, D)
    reconstruction = model.decoder(flat, target.expand(len(flat)))  # (D*S, C*H*W)
    return reconstruction.reshape(dim, len(deltas), *image.shape[1:])  # (D, S, C, H, W)


def coupling_maps(coupling, config):
    """coupling (B, I, J) -> (B, J, grid_h, grid_w): each class's coupling coefficient averaged over the
    capsule channels at each grid position of the layer below the classes (PrimaryCaps for dynamic
    routing, whose capsules are ordered (channel, y, x); ConvCaps2 for EM routing, ordered (y, x, type))."""
    batch, _, num_classes = coupling.shape
    if config.arch == "em":
        grid_h, grid_w = config.em_grids[-1]
        per_type = coupling.reshape(batch, grid_h, grid_w, config.conv_caps_types[-1], num_classes)  # (B, 4, 4, 16, J)
        return per_type.mean(dim=3).permute(0, 3, 1, 2)  # (B, J, 4, 4)
    grid_h, grid_w = config.primary_grid
    per_channel = coupling.reshape(batch, config.primary_caps_channels, grid_h, grid_w, num_classes)  # (B, 32, 6, 6, J)
    return per_channel.mean(dim=1).permute(0, 3, 1, 2)  # (B, J, 6, 6)


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # a bare Figure saves PNG through the Agg backend, no pyplot state

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(figure, path: Path) -> Path:
    """Write the PNG; a failure (a folder of that name, a full disk) is the user's to fix, not a traceback."""
    from capsnet.errors import CapsNetError

    try:
        figure.savefig(path)
    except OSError as err:
        raise CapsNetError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def _show(axes, image, title: str = "") -> None:
    """One (C, H, W) [0, 1] image, grey for one channel."""
    pixels = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)  # (H, W) or (H, W, C)
    axes.imshow(pixels.clip(0, 1), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    axes.set_axis_off()
    axes.set_title(title, fontsize=8)


def draw_reconstructions(shown: Labelled, reconstructions, num_correct: int, path: Path) -> Path:
    """`shown` and their reconstructions (K, C, H, W): the first `num_correct` correctly classified, then the wrong
    ones."""
    images, labels, predicted, names = shown.images, shown.labels, shown.predicted, shown.names
    columns = max(num_correct, len(images) - num_correct, 1)
    figure = _figure(1.1 * columns, 5.2)
    sections = {"correct predictions": range(num_correct),
                "wrong predictions (true → predicted)": range(num_correct, len(images))}
    for subfigure, (heading, indices) in zip(figure.subfigures(2, 1), sections.items()):
        subfigure.suptitle(f"{heading}: input (top), reconstruction from the predicted capsule (bottom)", fontsize=9)
        axes = subfigure.subplots(2, columns, squeeze=False)
        for column in range(columns):
            if column >= len(indices):
                axes[0, column].set_axis_off()
                axes[1, column].set_axis_off()
                continue
            k = indices[column]
            title = names[labels[k]] if labels[k] == predicted[k] else f"{names[labels[k]]} → {names[predicted[k]]}"
            _show(axes[0, column], images[k], title)
            _show(axes[1, column], reconstructions[k])
        if not indices:
            subfigure.text(0.5, 0.5, "none among the scored digits", ha="center", va="center")
    return _save(figure, path)


def draw_perturbations(grid, name: str, path: Path) -> Path:
    """grid (D, S, C, H, W) -> one mosaic: a row per pose dimension, a column per offset."""
    dims, steps, channels, height, width = grid.shape
    mosaic = grid.transpose(0, 3, 1, 4, 2).reshape(dims * height, steps * width, channels)  # (D*H, S*W, C)
    figure = _figure(0.5 + steps * width / 60, 0.8 + dims * height / 60)
    axes = figure.subplots()
    axes.imshow(mosaic[..., 0] if channels == 1 else mosaic.clip(0, 1), cmap="gray", vmin=0, vmax=1,
                interpolation="nearest")
    axes.set_xticks([(s + 0.5) * width - 0.5 for s in range(steps)],
                    [f"{d:+.2f}" for d in perturbation_deltas().tolist()], fontsize=7, rotation=90)
    axes.set_yticks([(d + 0.5) * height - 0.5 for d in range(dims)], [str(d) for d in range(dims)], fontsize=7)
    axes.set_xlabel("offset added to the dimension")
    axes.set_ylabel("pose dimension")
    axes.set_title(f"pose perturbation of a '{name}' capsule", fontsize=9)
    return _save(figure, path)


def draw_routing(shown: Labelled, maps, path: Path) -> Path:
    """`shown` (B images) and their coupling maps (B, J, grid_h, grid_w)."""
    images, labels, predicted, names = shown.images, shown.labels, shown.predicted, shown.names
    batch, num_classes = maps.shape[:2]
    figure = _figure(1.0 * (num_classes + 1) + 0.8, 1.15 * batch + 0.6)
    axes = figure.subplots(batch, num_classes + 1, squeeze=False)
    for row in range(batch):
        _show(axes[row, 0], images[row], f"true {names[labels[row]]}, pred {names[predicted[row]]}")
        for j in range(num_classes):
            heat = axes[row, j + 1].imshow(maps[row, j], cmap="viridis", vmin=float(maps.min()), vmax=float(maps.max()),
                                           interpolation="nearest")
            axes[row, j + 1].set_axis_off()
            if row == 0:
                axes[row, j + 1].set_title(names[j], fontsize=8)
    figure.colorbar(heat, ax=axes[:, 1:], shrink=0.8, label="mean coupling c_ij (EM: assignment R_ij)")
    figure.suptitle("routing: last iteration's coupling of the capsules below the classes (grid positions) to each "
                    "class", fontsize=9)
    return _save(figure, path)


def pairs_figure(pairs: PairSet, lengths: np.ndarray, scores: PairScores, names: tuple[str, ...], arch: str):
    """The first PAIRS_SHOWN of `pairs` (images of two digits each, their labels (N, 2)) and their lengths (N, J): a
    row a pair, the image beside a bar per class; the pair's classes in orange, bars above the threshold (present)
    outlined and marked; `scores` (of all of them) in the title."""
    import numpy as np

    from capsnet.training.robustness import PRESENT_THRESHOLD

    images, labels, lengths = pairs.images[:PAIRS_SHOWN], pairs.labels[:PAIRS_SHOWN], lengths[:PAIRS_SHOWN]
    count, num_classes = lengths.shape
    figure = _figure(8.5, 1.15 * count + 0.9)
    axes = figure.subplots(count, 2, squeeze=False, width_ratios=(1, 2.4))
    for row in range(count):
        _show(axes[row, 0], images[row], f"{names[labels[row, 0]]} and {names[labels[row, 1]]}")
        present = lengths[row] > PRESENT_THRESHOLD  # (J,)
        colours = ["tab:orange" if k in labels[row] else "tab:grey" for k in range(num_classes)]
        bars = axes[row, 1].bar(range(num_classes), lengths[row], color=colours, edgecolor="black",
                                linewidth=[1.5 if p else 0 for p in present])
        for bar, is_present in zip(bars, present):
            if is_present:
                axes[row, 1].text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.03, "present",
                                  ha="center", va="bottom", fontsize=6)
        axes[row, 1].axhline(PRESENT_THRESHOLD, color="black", linestyle=":", linewidth=0.8)
        axes[row, 1].set_ylim(0, 1.25)
        axes[row, 1].set_yticks([0, PRESENT_THRESHOLD, 1])
        axes[row, 1].set_xticks(range(num_classes), names, fontsize=7)
        axes[row, 1].tick_params(axis="y", labelsize=7)
        top2 = set(np.argsort(-lengths[row], kind="stable")[:2].tolist())
        found = top2 == set(labels[row].tolist())
        verdict = ("top 2 right, both present" if found and present[labels[row]].all()
                   else "top 2 right" if found else "top 2 wrong")
        axes[row, 1].set_title(verdict, fontsize=7, loc="right")
    length = "capsule length" if arch == "shared-capsnet" else "sigmoid output"
    figure.suptitle(f"{arch}: {length} per class of pairs of test digits, {scores.layout}\n"
                    f"orange: the pair's two classes; outlined: above {PRESENT_THRESHOLD:g} (present)\n"
                    f"over {scores.count} such pairs: top-2 set {100 * scores.top2_accuracy:.1f}%, with both > "
                    f"{PRESENT_THRESHOLD:g} {100 * scores.top2_both_present_accuracy:.1f}%", fontsize=9)
    return figure


def draw_confusion(evaluation, path: Path) -> Path:
    confusion = evaluation.confusion
    names = evaluation.class_names
    figure = _figure(5.2, 4.6)
    axes = figure.subplots()
    image = axes.imshow(confusion, cmap="Blues")
    for (true, guess), count in zip(((t, g) for t in range(len(names)) for g in range(len(names))), confusion.flat):
        if count:
            colour = "white" if count > confusion.max() / 2 else "black"
            axes.text(guess, true, str(count), ha="center", va="center", fontsize=7, color=colour)
    axes.set_xticks(range(len(names)), names, fontsize=7, rotation=90)
    axes.set_yticks(range(len(names)), names, fontsize=7)
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    axes.set_title(f"confusion matrix: {100 * evaluation.accuracy:.2f}% of {evaluation.count} test images", fontsize=9)
    figure.colorbar(image, ax=axes, shrink=0.8)
    return _save(figure, path)


def training_curves(history: list[dict]):
    """Loss and accuracy per epoch of every split the history holds; the epoch chosen on validation marked."""
    from matplotlib.ticker import MaxNLocator

    epochs = [record["epoch"] for record in history]
    figure = _figure(8, 3.2)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    splits = [split for split in ("train", "validation", "test") if f"{split}_accuracy" in history[0]]
    for split in splits:
        loss_axes.plot(epochs, [record[f"{split}_loss"] for record in history], marker="o", markersize=3, label=split)
        accuracy_axes.plot(epochs, [100 * record[f"{split}_accuracy"] for record in history], marker="o", markersize=3,
                           label=split)
    chosen = max(history, key=lambda record: record["validation_accuracy"]) if "validation" in splits else None
    for axes, what in ((loss_axes, "loss"), (accuracy_axes, "accuracy (%)")):
        if chosen is not None:
            axes.axvline(chosen["epoch"], color="grey", linestyle=":",
                         label=f"best on validation (epoch {chosen['epoch']})")
        axes.set_xlabel("epoch")
        axes.set_ylabel(what)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle("training curves: validation chooses the checkpoint, test is only reported" if chosen is not None
                    else "training curves (no validation split: test is the held-out split)", fontsize=9)
    return figure


def draw_training_curves(history: list[dict], path: Path) -> Path:
    figure = training_curves(history)
    return _save(figure, path)
