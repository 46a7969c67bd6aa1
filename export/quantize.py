"""INT8 for the CPU: static QDQ quantisation with ONNX Runtime, calibrated on training images.

Only the convolutions are quantised (their inputs, weights and outputs): PrimaryCaps' convolution
is ~94% of the FLOPs, while quantising squash and the routing softmax collapsed accuracy to chance
in our measurements.
Weights are per output channel, and activations are symmetric int8 (zero point 0): that is what
TensorRT's explicit quantisation accepts, so the same model.int8.onnx serves ONNX Runtime and
TensorRT, at the CPU speed of uint8 activations (measured within 3% of each other).

Weights use 7 of their 8 bits (`reduce_range`). CPUs without VNNI (AVX2 only) run int8 convolutions
through VPMADDUBSW, whose 16-bit intermediate sums saturate with full-range weights: on an AVX2-only
AMD EPYC the paper model lost 0.4 points (97.4% -> 97.0%) and a Fashion-MNIST model 4.6 points with
8-bit weights, and 0.1 points with 7-bit ones, at the same speed. VNNI/AMX hosts never saturate, so
the halved weight resolution is the price of one file that keeps its accuracy on every x86 kind.

Activation ranges are the 99.9th percentile of |values| over the calibration images, not their extremes: a model
trained to convergence has rare large activations that stretch a min-max range, so that every common value loses
resolution. A `paper` Fashion-MNIST model trained 21 epochs (91.62%) lost 1.93 points with min-max ranges and
0.03 with the 99.9th percentile, on a 2-core AMD EPYC with AVX-512 VNNI (docs/export.md, "Calibration choices").
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from capsnet.export.logs import quiet
from capsnet.export.onnx_export import INPUT_NAME
from capsnet.training.data import to_float

QUANTIZED_OP_TYPES = ["Conv"]
CALIBRATION_BATCH = 32


def _calibration_reader(images_uint8: np.ndarray):
    from onnxruntime.quantization import CalibrationDataReader

    class CalibrationImages(CalibrationDataReader):
        """Feeds the calibration images batch by batch, as [0, 1] floats like the server's input."""

        def __init__(self):
            # batches of one size: ONNX Runtime's histogram calibrators (percentile, entropy) stack them
            self.batch = max(size for size in range(1, CALIBRATION_BATCH + 1) if len(images_uint8) % size == 0)
            self.starts = iter(range(0, len(images_uint8), self.batch))

        def get_next(self):
            start = next(self.starts, None)
            if start is None:
                return None
            return {INPUT_NAME: to_float(images_uint8[start : start + self.batch]).numpy()}  # (b, C, H, W)

    return CalibrationImages()


@dataclass(frozen=True)
class Calibration:
    """How the activation ranges are chosen: ONNX Runtime's calibration `method` (minmax, percentile: the
    `percentile`-th of the |values|, entropy: the range that keeps the histogram's KL divergence least), and whether
    the first convolution, on the image itself, stays FP32."""

    method: str = "percentile"
    percentile: float = 99.9
    float_first_convolution: bool = False

    def __post_init__(self):
        if self.method not in CALIBRATION_METHODS:
            raise ValueError(f"calibration method {self.method!r} is not one of {', '.join(CALIBRATION_METHODS)}")

    def describe(self) -> str:
        method = f"percentile {self.percentile:g}" if self.method == "percentile" else self.method
        return method + (", first convolution FP32" if self.float_first_convolution else "")


CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
# Recorded in model.json, so a served model says how it was quantised.
SCHEME = {"format": "QDQ", "op_types": QUANTIZED_OP_TYPES, "activations": "int8 symmetric per tensor",
          "weights": "int8 symmetric per output channel, 7-bit range (reduce_range)",
          "calibration": Calibration().describe()}


def first_convolution(model: onnx.ModelProto) -> str:
    """The name of the graph's first Conv node (Conv1, on the image)."""
    return next(node.name for node in model.graph.node if node.op_type == "Conv")


def quantize_int8(fp32_path: Path, int8_path: Path, calibration_images: np.ndarray,
                  calibration: Calibration = Calibration()) -> None:
    """Write the QDQ INT8 model for `fp32_path`, its ranges calibrated on `calibration_images` (uint8)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    method = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
              "entropy": CalibrationMethod.Entropy}[calibration.method]
    excluded = [first_convolution(onnx.load(str(fp32_path)))] if calibration.float_first_convolution else []
    # quiet: its advice to run quant_pre_process, whose shape inference fails on our graph; and the histogram
    # calibrators (percentile, entropy) print their progress, which is not export's to show
    with quiet(""), contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(fp32_path),
            str(int8_path),
            _calibration_reader(calibration_images),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=QUANTIZED_OP_TYPES,
            nodes_to_exclude=excluded,
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            reduce_range=True,
            calibrate_method=method,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "CalibPercentile": calibration.percentile, "CalibTensorRangeSymmetric": True},
        )
