"""`capsnet robustness`: a checkpoint on test sets built from its test split that it never trained on.

- affine: every test digit rotated up to ±20°, scaled 0.8–1.2 and sheared (`transforms.affine_split`),
  scored like `capsnet eval`, beside the clean test accuracy;
- overlap: pairs of different test digits overlaid with shifts (`transforms.overlay_pairs`): top-2
  accuracy (the two most probable classes are the two digits), and the same requiring both of their
  lengths (probabilities) > 0.5, as a capsule network should report two digits present.

numpy and torch are imported inside the functions, so `capsnet --help` and `capsnet predict` stay fast.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from capsnet.model_description.classes import PRESENT_THRESHOLD  # the one default, which serving uses too
from capsnet.training.arguments import add_checkpoint, add_data, add_device, add_scoring_batch_size

if TYPE_CHECKING:
    from capsnet.training.evaluate import Scoring

# The pairs are built in memory at once, about 6 kB each for 28x28 images (200,000: 1.2 GB, 20 s): this many
# is 6 GB; 10**12 asked numpy for terabytes and ended in a traceback.
MAX_PAIRS = 1_000_000


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "robustness",
        help="accuracy on affine-distorted and on overlaid pairs of test digits",
        description="Score a checkpoint on its test split under random affine distortions (rotation ±20°, "
                    "scale 0.8-1.2, shear) and on MultiMNIST-style pairs of different digits overlaid with "
                    "shifts of up to 4 pixels (top-2 accuracy, with and without both lengths > 0.5). "
                    "Every set is rebuilt exactly from --seed.",
    )
    add_checkpoint(parser)
    add_data(parser)
    parser.add_argument("--pairs", type=int, metavar="N",
                        help=f"overlaid pairs, at most {MAX_PAIRS:,} (default: one per test image)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seed of the distortions and pairs (default 0)")
    add_scoring_batch_size(parser)
    add_device(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.set_defaults(handler=run_robustness)


def class_probabilities(model, images, scoring: Scoring):
    """uint8 (N, C, H, W) images -> (N, J) float32 numpy probabilities (capsule lengths), in batches."""
    import torch

    from capsnet.training.data import to_float

    batch_size = scoring.batch_size
    model.eval()
    with torch.no_grad():
        chunks = [model(to_float(images[start : start + batch_size]).to(scoring.device)).probabilities.float().cpu()
                  for start in range(0, len(images), batch_size)]  # (B, J) each
    return torch.cat(chunks).numpy()  # (N, J)


def overlap_scores(probabilities, labels) -> dict[str, float]:
    """probabilities (N, J), labels (N, 2) -> top-2 accuracy, and with both labels' lengths > 0.5 too."""
    import numpy as np

    top2 = np.sort(np.argsort(-probabilities, axis=1, kind="stable")[:, :2], axis=1)  # (N, 2)
    found = (top2 == np.sort(labels, axis=1)).all(axis=1)  # (N,)
    present = (np.take_along_axis(probabilities, labels, axis=1) > PRESENT_THRESHOLD).all(axis=1)  # (N,)
    return {"top2_accuracy": float(found.mean()), "top2_both_present_accuracy": float((found & present).mean())}


def run_robustness(args: argparse.Namespace) -> int:
    from capsnet.errors import CapsNetError
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.training.distributed import DistributedContext, resolve_device
    from capsnet.training.evaluate import Scoring, evaluate, load_checkpoint_data
    from capsnet.training.options import SEED_LIMIT
    from capsnet.training.transforms import MAX_ROTATION_DEGREES, MAX_SHEAR, OVERLAY_MAX_SHIFT, SCALE_RANGE, \
        affine_split, overlay_pairs

    if args.batch_size < 1:
        raise CapsNetError("--batch-size must be at least 1")
    if args.pairs is not None and args.pairs < 1:
        raise CapsNetError("--pairs must be at least 1")
    if args.pairs is not None and args.pairs > MAX_PAIRS:
        raise CapsNetError(f"--pairs must be at most {MAX_PAIRS:,}, got {args.pairs:,}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise CapsNetError(f"--seed must be in [0, {SEED_LIMIT})")
    device = resolve_device(args.device, DistributedContext())
    checkpoint = load_checkpoint(args.checkpoint)
    dataset = load_checkpoint_data(checkpoint, args.checkpoint, args.data, hold_out=False)  # the test split only
    model = checkpoint.build_model().to(device)
    names = tuple(checkpoint.class_names)
    scoring = Scoring(args.batch_size, device)
    clean = evaluate(model, dataset.test, names, scoring)
    affine = evaluate(model, affine_split(dataset.test, args.seed)[0], names, scoring)
    pairs = args.pairs or len(dataset.test)
    try:
        overlay = overlay_pairs(dataset.test, pairs, args.seed)
    except MemoryError:  # images larger than digits, or a machine with little memory
        shape = "x".join(map(str, dataset.image_shape))
        raise CapsNetError(f"not enough memory for {pairs:,} overlaid pairs of {shape} images; ask for fewer with "
                           "--pairs") from None
    overlap = overlap_scores(class_probabilities(model, overlay.images, scoring), overlay.labels)
    report = {
        "checkpoint": str(args.checkpoint), "arch": checkpoint.config.arch, "data": dataset.name, "seed": args.seed,
        "split": "test", "test_images": len(dataset.test), "pairs": len(overlay.labels),  # as eval --json names it
        "clean_accuracy": clean.accuracy, "affine_accuracy": affine.accuracy,
        "overlap_top2_accuracy": overlap["top2_accuracy"],
        "overlap_top2_both_present_accuracy": overlap["top2_both_present_accuracy"],
        "affine_ranges": {"rotation_degrees": MAX_ROTATION_DEGREES, "scale": list(SCALE_RANGE), "shear": MAX_SHEAR},
        "overlap_max_shift": OVERLAY_MAX_SHIFT,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"checkpoint {args.checkpoint} ({report['arch']}, epoch {checkpoint.epoch}) on {dataset.name}, "
          f"test split, seed {args.seed}")
    print(f"  clean accuracy           {100 * clean.accuracy:6.2f}%  ({len(dataset.test)} digits)")
    print(f"  affine accuracy          {100 * affine.accuracy:6.2f}%  (rotation ±{MAX_ROTATION_DEGREES:g}°, scale "
          f"{SCALE_RANGE[0]:g}-{SCALE_RANGE[1]:g}, shear ±{MAX_SHEAR:g})")
    print(f"  overlap top-2 accuracy   {100 * overlap['top2_accuracy']:6.2f}%  ({len(overlay.labels)} pairs, shifts "
          f"up to {OVERLAY_MAX_SHIFT} px)")
    print(f"  ... both lengths > {PRESENT_THRESHOLD:g}   {100 * overlap['top2_both_present_accuracy']:6.2f}%")
    return 0
