"""`capsnet export CHECKPOINT --out DIR`: ONNX (+ INT8, FP16), AOTInductor packages, TensorRT and a Triton
repository."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from capsnet.errors import CapsNetError
from capsnet.export.config import DEFAULT_OPSET, MAX_INT8_OPSET, MAX_OPSET, MIN_OPSET, PRECISIONS, ExportConfig
from capsnet.training.arguments import add_checkpoint, add_data

DEFAULTS = ExportConfig()
# The export was written, but without a variant it was asked for: the precision gate refused it (named on stderr and
# in model.json's `refused`). Distinct from 2, a mistake or failure, after which nothing is written (but a TensorRT
# engine that could not be built: the other artifacts are written), so that a script can tell the two apart.
EXIT_REFUSED = 3
EXIT_CODES = f"""exit status:
  0  every artifact asked for was written
  {EXIT_REFUSED}  written without the reduced-precision variants (--int8, --fp16, --aoti cuda fp16|bf16) that the
     precision gate refused; FP32 and the variants that pass are in DIR, each refused one is named on stderr
     and in DIR/model.json (`refused`, its measured accuracy drop under `precision_gate`)
  2  a mistake or failure, named in one line; nothing written (but for a TensorRT engine that could not be
     built: the other artifacts are written)"""
# The artifacts each option shapes: set for none that is written, it would do nothing.
APPLIES_TO = {
    "calibration_images": ("--int8",),
    "tensorrt_precision": ("--tensorrt",), "min_batch": ("--tensorrt",), "workspace_mib": ("--tensorrt",),
    "timing_cache": ("--tensorrt",), "gpu": ("--tensorrt", "--aoti cuda"), "aoti_precision": ("--aoti cuda",),
    "opt_batch": ("--tensorrt", "--triton"), "max_batch": ("--tensorrt", "--triton", "--aoti"),
    "max_queue_delay_us": ("--triton",),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint to ONNX / TensorRT / a Triton model repository",
        description="Write DIR/model.onnx (+ model.json sidecar, optional INT8/FP16 variants and TensorRT engine),\n"
        "checked against PyTorch on real images. Written atomically: a failed export leaves DIR as it was.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint(parser)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (new, empty, or a previous export)")
    parser.add_argument("--reconstruction", action="store_true", help="also output the decoder's reconstruction")
    add_data(parser, DEFAULTS.data, "real images for parity and the self-check set (test split), INT8 calibration "
             "(train) and accuracy (test); its classes must be the checkpoint's (default: the data the checkpoint was "
             "trained on)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                        help=f"ONNX opset, {MIN_OPSET}-{MAX_OPSET}; with INT8 at most {MAX_INT8_OPSET} "
                        "(default: %(default)s)")

    parser.add_argument("--max-accuracy-drop", type=float, default=DEFAULTS.max_accuracy_drop, metavar="POINTS",
                        help="the precision gate: refuse an INT8, FP16 or BF16 variant that loses more test accuracy "
                        "than this, in percentage points (default: %(default)s)")

    int8 = parser.add_argument_group("INT8 / FP16 (ONNX Runtime)")
    int8.add_argument("--int8", action="store_true", help="also write model.int8.onnx (static QDQ, for CPUs)")
    int8.add_argument("--calibration-images", type=int, default=DEFAULTS.calibration_images, metavar="N",
                      help="training images that calibrate the INT8 ranges (default: %(default)s)")
    int8.add_argument("--fp16", action="store_true", help="also write model.fp16.onnx (for GPU execution providers)")

    trt = parser.add_argument_group("TensorRT (needs a CUDA GPU and the tensorrt package)")
    trt.add_argument("--tensorrt", action="store_true", help="also build model.plan + model.plan.json")
    trt.add_argument("--tensorrt-precision", choices=PRECISIONS, default=DEFAULTS.tensorrt_precision,
                     help="engine precision; fp16/int8 also write that ONNX variant (default: %(default)s)")
    trt.add_argument("--min-batch", type=int, default=DEFAULTS.min_batch,
                     help="optimisation profile: smallest batch (default: %(default)s)")
    trt.add_argument("--opt-batch", type=int, default=DEFAULTS.opt_batch,
                     help="optimisation profile: batch tuned for (default: 32, or --max-batch if smaller)")
    trt.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch,
                     help="optimisation profile: largest batch, also Triton's max_batch_size (default: %(default)s)")
    trt.add_argument("--workspace-mib", type=int, default=DEFAULTS.workspace_mib,
                     help="TensorRT workspace limit (default: %(default)s)")
    trt.add_argument("--timing-cache", metavar="PATH", default=None,
                     help="TensorRT timing cache reused across builds "
                          "(default: ~/.cache/capsnet/tensorrt.timing-cache)")
    trt.add_argument("--gpu", type=int, default=DEFAULTS.gpu, metavar="N",
                     help="CUDA device to build and check the engine and the CUDA packages on, the one that will serve "
                     "them (default: 0)")

    aoti = parser.add_argument_group("AOTInductor (compiled PyTorch; needs a C++ compiler, and a CUDA GPU for cuda)")
    aoti.add_argument("--aoti", nargs="?", const="cpu", metavar="cpu|cuda|cpu,cuda",
                      help="also compile model.<device>.<precision>.pt2 packages from the exported program, for "
                      "batches of 1 to --max-batch (bare --aoti: cpu; cuda: on --gpu)")
    aoti.add_argument("--aoti-precision", default=DEFAULTS.aoti_precision, metavar="fp32[,fp16][,bf16]",
                      help="precisions of the CUDA packages; the CPU package is fp32 (default: %(default)s)")

    triton = parser.add_argument_group("Triton Inference Server")
    triton.add_argument("--triton", dest="triton_repo", metavar="REPO", default=None,
                        help="also write the model repository REPO/capsnet (config.pbtxt + 1/model.onnx or model.plan)")
    triton.add_argument("--max-queue-delay-us", type=int, default=DEFAULTS.max_queue_delay_us,
                        help="Triton dynamic batching: longest wait to fill a batch (default: %(default)s)")
    parser.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import onnx

    from capsnet.export.exporter import export_model
    from capsnet.export.onnx_export import op_counts

    options = {field.name: getattr(args, field.name) for field in dataclasses.fields(ExportConfig)}
    check_options_apply(ExportConfig(**options))
    description = export_model(args.checkpoint, args.out, **options)

    out = Path(args.out)
    fp32_name = description.artifacts["onnx"]
    assert fp32_name is not None  # the FP32 model is always exported
    counts = op_counts(onnx.load(str(out / fp32_name)))
    parity = description.parity
    decoder = description.decoder
    files = [name for name in description.artifacts.values() if name] + ([decoder.file] if decoder else [])
    written = ", ".join(files)
    print(f"wrote {out}: {written}, model.json")
    print(f"  ONNX opset {description.opset}, {sum(counts.values())} nodes "
          f"({', '.join(f'{op} {n}' for op, n in counts.most_common())})")
    diffs = ", ".join(f"{name} {diff:.1e}" for name, diff in parity["onnxruntime"]["max_abs_diff"].items())
    print(f"  ONNX Runtime vs PyTorch, batches {'/'.join(map(str, parity['batch_sizes']))}: max |diff| {diffs}; "
          f"same class {parity['onnxruntime']['argmax_agreement']:.0%}")
    if decoder is not None:
        print(f"  the decoder alone ({decoder.file}) vs PyTorch's on {decoder.parity['rows']} poses: max |diff| "
              f"{decoder.parity['max_abs_diff']:.1e}")
    if "sizes" in parity:
        worst = {size: max(max(result[what]["max_abs_diff"].values()) for what in ("pytorch", "batch_invariance"))
                 for size, result in parity["sizes"].items()}
        print(f"  input: {description.sizes.describe()}; vs PyTorch and alone vs in a batch, max |diff| "
              f"{', '.join(f'{size} {diff:.1e}' for size, diff in worst.items())}")
    for name, gate in description.precision_gate.items():
        print(f"  precision gate {name}: test accuracy {gate.accuracy_fp32:.2%} -> {gate.accuracy:.2%} "
              f"({gate.accuracy_change_points:+.2f} points, {gate.test_images} images); on the {gate.reference_images} "
              f"reference images same class {gate.argmax_agreement:.1%}, max |diff| {gate.max_abs_diff:.1e}")
    if description.int8:
        print(f"  INT8: {description.int8['calibration_images']} calibration images")
    for package in description.aoti:
        print(f"  AOTInductor {package.describe()}")
    if "tensorrt" in parity:
        engine = parity["tensorrt"]
        print(f"  TensorRT {engine['precision']} vs ONNX Runtime: max |diff| "
              f"{max(engine['max_abs_diff'].values()):.1e}, same class {engine['argmax_agreement']:.0%}")
    if args.triton_repo:
        print(f"  Triton model repository: {Path(args.triton_repo) / description.name}")
    for name, why in description.refused.items():
        print(f"capsnet export: not written: {name}: {why}", file=sys.stderr)
    return EXIT_REFUSED if description.refused else 0


def check_options_apply(config: ExportConfig) -> None:
    """Refuse an option changed for an artifact this export does not write: ignored, `--tensorrt-precision int8`
    without --tensorrt looked as if something had been quantised."""
    writes = {"--int8": config.wants_int8, "--tensorrt": config.tensorrt, "--triton": config.triton_repo is not None,
              "--aoti": config.aoti is not None, "--aoti cuda": "cuda" in config.aoti_devices}
    for name, artifacts in APPLIES_TO.items():
        if getattr(config, name) != getattr(DEFAULTS, name) and not any(writes[flag] for flag in artifacts):
            raise CapsNetError(f"--{name.replace('_', '-')} does nothing without {' or '.join(artifacts)}")
