"""`capsnet train` and `capsnet eval`. torch is imported inside the handlers so `capsnet --help` stays fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from capsnet.training.arguments import DATA_HELP, add_checkpoint, add_data, add_device, add_scoring_batch_size


def register(subparsers: argparse._SubParsersAction) -> None:
    from capsnet.model_description.pose import DEFAULT_POSE_IMAGES, POSE_STEP
    from capsnet.models.config import ARCHITECTURES
    from capsnet.training.resume import LR_SCHEDULES, default, default_help
    from capsnet.training.pairs import PAIR_LAYOUTS
    from capsnet.training.robustness import MAX_PAIRS

    train = subparsers.add_parser(
        "train",
        help="train a CapsNet and write checkpoints",
        description="Train a CapsNet (Adam, per-epoch learning-rate decay, random shifts), score the validation "
                    "and test splits after each epoch, keep the best checkpoint by validation accuracy at --out "
                    "and the last at <out stem>.last.ckpt. "
                    "Under torchrun every process runs this command (DistributedDataParallel).",
    )
    # Defaults and what a resume keeps come from resume.SETTINGS; a flag a resume keeps is None when left out.
    add_data(train, default("data"), DATA_HELP)
    train.add_argument("--val-fraction", type=float, metavar="F",
                       help="share of the training images held out (per class, with a fixed seed) as the validation "
                            "split that chooses the best epoch; the test split is only reported "
                            f"({default_help('val_fraction')}; 0: no validation split and no selection, --out is the "
                            "last epoch)")
    train.add_argument("--preset", metavar="paper|tiny|em|em-tiny|shared|gap-cnn|...",
                       help="model size: paper (Sabour et al., 8.2M parameters) or tiny, em or em-tiny for "
                            "--arch em, shared, shared-article or shared-tiny for --arch shared-capsnet, gap-cnn, "
                            f"gap-cnn-article or gap-cnn-tiny for --arch gap-cnn ({default_help('preset')})")
    train.add_argument("--epochs", type=int, default=default("epochs"), metavar="N",
                       help=f"total epochs, counting resumed ones ({default_help('epochs')})")
    train.add_argument("--batch-size", type=int, default=default("batch_size"), metavar="B",
                       help=f"global batch size, split across torchrun processes ({default_help('batch_size')})")
    train.add_argument("--lr", type=float, help=f"Adam learning rate ({default_help('lr')})")
    train.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                       help="exponential: the rate times --lr-decay after every epoch; linear: per step, a warmup "
                            "over --warmup of the steps, then down to 0 at the last step of --epochs "
                            f"({default_help('lr_schedule')})")
    train.add_argument("--lr-decay", type=float, metavar="FACTOR",
                       help=f"exponential schedule: learning-rate factor per epoch ({default_help('lr_decay')})")
    train.add_argument("--warmup", type=float, metavar="SHARE",
                       help=f"linear schedule: share of all steps over which the rate rises to --lr "
                            f"({default_help('warmup')})")
    train.add_argument("--max-shift", type=int, metavar="PIXELS",
                       help="random shift augmentation in pixels: a random crop of the image zero-padded by PIXELS "
                            f"({default_help('max_shift')})")
    train.add_argument("--hflip", action="store_true", default=None,
                       help="also mirror each training image left-right with probability 1/2 (for clothes such as "
                            f"Fashion-MNIST; not for digits) ({default_help('hflip')})")
    train.add_argument("--erase", type=float, metavar="P",
                       help="random erasing (Zhong et al. 2020): with probability P set a random rectangle of 2-40%% "
                            f"of each training image, aspect ratio 0.3-3.3, to 0; 0 is off ({default_help('erase')})")
    train.add_argument("--seed", type=int, metavar="N",
                       help=f"seed for weights, shuffling and augmentation ({default_help('seed')})")
    # a string, not a Path, which would drop the trailing / that TrainOptions refuses
    train.add_argument("--out", default=default("out"), metavar="CKPT",
                       help=f"best checkpoint ({default_help('out')})")
    train.add_argument("--resume", nargs="?", const="", metavar="CKPT",
                       help="continue a run from CKPT (default: <out stem>.last.ckpt) up to --epochs")
    train.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                       help="also write <out stem>.last.ckpt every STEPS training steps, so --resume loses at most "
                            "that many (default: at each epoch's end only)")
    model = train.add_argument_group("model (default: the preset's, or the resumed checkpoint's)")
    model.add_argument("--arch", choices=ARCHITECTURES,
                       help="capsnet (dynamic routing), em (matrix capsules with EM routing and the "
                            "spread loss), cnn-baseline: a plain CNN of the paper CapsNet's size, trained with "
                            "the same margin loss; shared-capsnet (any image size: a convolutional backbone, then "
                            "capsules whose transformation is shared across positions) or gap-cnn (its CNN "
                            "baseline: the backbone, global average pooling, sigmoids)")
    model.add_argument("--routing", metavar="sabour|leaky|su", help="routing variant: sabour (paper), leaky or su")
    model.add_argument("--routing-iterations", type=int, metavar="N",
                       help="routing iterations, dynamic or EM (papers: 3)")
    model.add_argument("--squash-constant", type=float, metavar="C", help="c in |s|²/(c+|s|²): 1 (paper) or 0.5")
    model.add_argument("--reconstruction-weight", type=float, metavar="W",
                       help="weight of the reconstruction term in the loss (paper: 0.0005; 0 trains without it)")
    model.add_argument("--detach-agreement", action="store_true", default=None,
                       help="stop the gradient through the routing agreement update (default: it flows)")
    model.add_argument("--normalize", action="store_true",
                       help="standardise inputs with the training split's per-channel mean/std "
                            "(default: mean 0, std 1)")
    execution = train.add_argument_group("execution")
    add_device(execution, default("device"))
    execution.add_argument("--amp", action="store_true",
                           help="mixed precision: fp16 on CUDA; bf16 on a CPU with native bf16 (AVX512_BF16 or AMX), "
                           "else fp32 with a note")
    execution.add_argument("--compile", action="store_true", help="torch.compile the training step")
    execution.add_argument("--threads", type=int, metavar="N",
                           help="CPU threads per process (default: torch's; under torchrun the cores shared out)")
    execution.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(handler=run_train)

    evaluate = subparsers.add_parser(
        "eval",
        help="accuracy, per-class accuracy and confusion matrix of a checkpoint",
        description="Evaluate a checkpoint on a data split: accuracy, per-class accuracy, confusion matrix.",
    )
    add_checkpoint(evaluate)
    add_data(evaluate)
    evaluate.add_argument("--split", choices=("train", "validation", "test"), default="test",
                          help="which split (default test); validation and train are the checkpoint's: the "
                               "training images less the share its training run held out (--val-fraction)")
    add_scoring_batch_size(evaluate)
    add_device(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    pairs = evaluate.add_argument_group("pairs of digits in one image")
    pairs.add_argument("--pairs", choices=PAIR_LAYOUTS,
                       help="also score pairs of different digits of the split in one image: side-by-side (HxW "
                            "digits on an Hx2W image), stacked (2HxW) or overlap (HxW, shifted up to 4 pixels, as "
                            "capsnet robustness): the top-2 set accuracy, and the same with both classes' lengths "
                            "> 0.5; side-by-side and stacked need a model that takes any size")
    pairs.add_argument("--pair-count", type=int, metavar="N",
                       help=f"pairs, at most {MAX_PAIRS:,} (default: one per image of the split)")
    pairs.add_argument("--seed", type=int, metavar="N", help="seed of the pairs (default 0)")
    pose = evaluate.add_argument_group("how far the poses show in the decoder's drawings")
    pose.add_argument("--pose", action="store_true",
                      help="also measure, on the split: fidelity (reconstruction MSE / class-template MSE) and how "
                           f"many grey levels moving each pose dimension by ±{POSE_STEP:g} changes the drawing")
    pose.add_argument("--pose-images", type=int, default=DEFAULT_POSE_IMAGES, metavar="N",
                      help=f"images measured (default {DEFAULT_POSE_IMAGES})")
    pose.add_argument("--pose-out", type=Path, metavar="FILE", help="also write the pose figures to FILE as JSON")
    evaluate.set_defaults(handler=run_eval)


def run_train(args: argparse.Namespace) -> int:
    from capsnet.training.distributed import ReportedError
    from capsnet.training.options import TrainOptions, last_checkpoint_path
    from capsnet.training.train import train

    if args.resume is None:
        resume = None
    else:
        resume = Path(args.resume) if args.resume else last_checkpoint_path(Path(args.out))
    options = TrainOptions(
        data=args.data, out=args.out, preset=args.preset, arch=args.arch, routing=args.routing,
        routing_iterations=args.routing_iterations, squash_constant=args.squash_constant,
        reconstruction_weight=args.reconstruction_weight, detach_agreement=args.detach_agreement,
        normalize=args.normalize, val_fraction=args.val_fraction,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, lr_schedule=args.lr_schedule,
        lr_decay=args.lr_decay, warmup=args.warmup, max_shift=args.max_shift, hflip=args.hflip, erase=args.erase,
        seed=args.seed, device=args.device, amp=args.amp, compile=args.compile, threads=args.threads,
        resume=resume, checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
    )
    try:
        train(options)
    except ReportedError:  # under torchrun: rank 0 printed it for every process
        return 2
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from capsnet.errors import CapsNetError
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.training.distributed import DistributedContext, resolve_device
    from capsnet.training.evaluate import Scoring, evaluate, load_checkpoint_data
    from capsnet.training.pose import pose_report
    from capsnet.training.options import SEED_LIMIT
    from capsnet.training.pairs import PairSpec, build_pairs, score_pairs
    from capsnet.training.robustness import MAX_PAIRS

    if args.batch_size < 1:
        raise CapsNetError("--batch-size must be at least 1")
    if args.pairs is None and (args.pair_count is not None or args.seed is not None):
        raise CapsNetError(f"{'--pair-count' if args.pair_count is not None else '--seed'} sets the pairs; "
                           "add --pairs side-by-side|stacked|overlap")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise CapsNetError(f"--seed must be in [0, {SEED_LIMIT})")
    if args.pair_count is not None and not 1 <= args.pair_count <= MAX_PAIRS:
        raise CapsNetError(f"--pair-count must be from 1 to {MAX_PAIRS:,}, got {args.pair_count:,}")
    device = resolve_device(args.device, DistributedContext())
    checkpoint = load_checkpoint(args.checkpoint)
    dataset = load_checkpoint_data(checkpoint, args.checkpoint, args.data, hold_out=args.split != "test")
    split = {"train": dataset.train, "validation": dataset.validation, "test": dataset.test}[args.split]
    if split is None:  # the validation split of a run that held none out
        raise CapsNetError(f"checkpoint {args.checkpoint} was trained without a validation split")
    pairs = spec = None
    if args.pairs is not None:  # built before the scoring, so a model that cannot take them fails at once
        spec = PairSpec(args.pairs, len(split) if args.pair_count is None else args.pair_count, args.seed or 0)
        pairs = build_pairs(checkpoint.config, split, spec, f"checkpoint {args.checkpoint}")
    model = checkpoint.build_model().to(device)
    scoring = Scoring(args.batch_size, device)
    result = evaluate(model, split, tuple(checkpoint.class_names), scoring)
    pair_scores = None if spec is None else score_pairs(model, pairs, spec, scoring)[1]
    pose = pose_report(model, dataset, args.split, args.pose_images, device, args.pose_out) if args.pose else None
    if args.json:
        # the checkpoint's share, also where the test split alone needed nothing held out
        print(json.dumps({"checkpoint": str(args.checkpoint), "data": dataset.name, "split": args.split,
                          "validation_fraction": checkpoint.metrics.get("validation_fraction", 0.0),
                          **result.to_dict(), **({"pairs": pair_scores.to_dict()} if pair_scores else {}),
                          **({"pose": pose.to_json()} if pose else {})}))
    else:
        print(f"checkpoint {args.checkpoint} (epoch {checkpoint.epoch}) on {dataset.name}, {args.split} split")
        print(result.format_report())
        if pair_scores:
            print(pair_scores.format_report())
        if pose:
            print(pose.describe())
    return 0
